"""``LossScaleOptimizer.step()`` warns once on gradients that did not come from a scaled loss
(issue 16 item 4), and never on correct use (clarification F4)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lossscale.torch import LossScaleOptimizer, experimental, step_together

# fused optimizers: both the CPU's host decision and a GPU's device decision (conftest)
pytestmark = pytest.mark.usefixtures("fused_decision")


def _setup(fused: bool = False) -> tuple[torch.nn.Linear, LossScaleOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused or None)
    return model, LossScaleOptimizer(inner, initial_scale=2.0**10)


def _loss(model: torch.nn.Linear) -> torch.Tensor:
    return model(torch.ones(4, 3)).pow(2).mean()


def _unscaled_warnings(fn: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "no scaled loss" in str(w.message)]


@pytest.mark.parametrize("fused", [False, True])
def test_a_framework_style_unscaled_backward_warns_once(fused: bool) -> None:
    model, opt = _setup(fused)

    def three_steps() -> None:
        for _ in range(3):
            _loss(model).backward()  # what Lightning/Accelerate do with a plain optimizer
            opt.step()
            opt.zero_grad()

    messages = _unscaled_warnings(three_steps)
    assert len(messages) == 1
    assert "lossscale.torch.GradScaler" in messages[0] and "opt.loss_scale" in messages[0]


def test_correct_uses_never_warn() -> None:
    model, opt = _setup()
    other_model, other = _setup()

    def correct() -> None:
        opt.get_scaled_loss(_loss(model)).backward()  # get_scaled_loss
        opt.step()
        opt.minimize(_loss(model))  # minimize
        opt.minimize(lambda: _loss(model))
        for _ in range(3):  # gradient accumulation: several scaled backward passes, one step
            opt.get_scaled_loss(_loss(model) / 3).backward()
        opt.step()
        opt.zero_grad()

        def closure() -> torch.Tensor:  # a scaled closure
            opt.zero_grad()
            loss = _loss(model)
            opt.get_scaled_loss(loss).backward()
            return loss

        opt.step(closure)
        (_loss(model) * opt.loss_scale).backward()  # scaling by hand, the documented way
        opt.step()
        opt.zero_grad()
        opt.get_scaled_loss(_loss(model)).backward()  # step_together
        other.get_scaled_loss(_loss(other_model)).backward()
        step_together(opt, other)
        opt.unscale_()  # unscale_ before clipping, after a scaled backward
        opt.get_scaled_loss(_loss(model)).backward()
        opt.unscale_()
        opt.step()

    assert _unscaled_warnings(correct) == []


def test_an_unscaled_closure_warns() -> None:
    model, opt = _setup()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model)
        loss.backward()
        return loss

    assert len(_unscaled_warnings(lambda: opt.step(closure))) == 1


def test_experimental_form_and_step_together_warn_too() -> None:
    model = torch.nn.Linear(3, 1)
    exp = experimental.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "dynamic")

    def unscaled() -> None:
        _loss(model).backward()
        step_together(exp)

    messages = _unscaled_warnings(unscaled)
    assert len(messages) == 1 and messages[0].startswith("LossScaleOptimizer.step()")
