"""Pickle and deepcopy of the torch front end's classes, through their public API only."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lossscale.torch import GradScaler, LossScaleOptimizer  # noqa: E402

COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    "deepcopy": copy.deepcopy,
}


def _step(scaler: Any, opt: Any, w: Any, bad: bool) -> None:
    opt.zero_grad()
    scaler.scale(w.sum()).backward()
    if bad:
        w.grad[0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("how", COPIES)
def test_gradscaler_pickles_and_copies_between_iterations(how: str) -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = GradScaler("cpu", init_scale=8.0, growth_factor=1.1, growth_interval=2)
    for bad in (False, True, False):
        _step(scaler, opt, w, bad)
    copied = COPIES[how](scaler)
    assert copied.state_dict() == scaler.state_dict()
    for bad in (False, False, True, False):  # the copy goes on alike, independently
        _step(copied, opt, w, bad)
        _step(scaler, opt, w, bad)
        assert copied.state_dict() == scaler.state_dict()
    _step(copied, opt, w, True)
    assert copied.get_scale() < scaler.get_scale()


@pytest.mark.parametrize("how", COPIES)
def test_loss_scale_optimizer_pickles_and_copies(how: str) -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.1), initial_scale=8.0)
    copied = COPIES[how](opt)
    assert copied.state_dict() == opt.state_dict()
    # the copy steps its own (copied) parameters, with its own scale, after an overflow
    (p,) = copied.param_groups[0]["params"]
    assert p is not w and copied.inner_optimizer.param_groups is copied.param_groups
    p.grad = torch.tensor([float("inf"), 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradients set by hand: no scaled loss
        copied.step()
    assert float(copied.loss_scale) == 4.0 and float(opt.loss_scale) == 8.0
    assert int(copied.skipped_steps) == 1 and int(opt.skipped_steps) == 0
    p.grad = torch.tensor([8.0, 8.0])
    copied.get_scaled_loss(p.sum())  # counts as scaled
    copied.step()
    assert torch.equal(p.detach(), torch.tensor([0.8, 0.8])) and w.tolist() == [1.0, 1.0]
