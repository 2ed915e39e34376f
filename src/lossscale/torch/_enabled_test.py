"""``LossScaleOptimizer(..., enabled=False)``: the inner optimizer exactly (issue 19 item 2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale.torch import LossScaleOptimizer, experimental, step_together
from lossscale.torch._state import DisabledScale


class _Ops(TorchDispatchMode):
    """Every aten op dispatched inside the block (host syncs are ``_local_scalar_dense``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not str(func).startswith("profiler."):  # the Optimizer step's profiling marker
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _run(wrap: bool, make: Any, steps: int = 6) -> tuple[list[torch.Tensor], list[list[str]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    inner = make(model.parameters())
    opt = LossScaleOptimizer(inner, enabled=False) if wrap else inner
    ops = []
    for i in range(steps):
        loss = model(torch.randn(8, 5)).pow(2).mean()
        (opt.get_scaled_loss(loss) if wrap else loss).backward()
        if i == 3:
            model[0].weight.grad[0, 0] = float("inf")  # applied, as the inner optimizer does
        with _Ops() as mode:
            opt.step()
        ops.append(mode.ops)
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], ops


INNERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("name", list(INNERS))
def test_disabled_is_the_inner_optimizer_exactly_with_the_same_device_ops(name: str) -> None:
    plain_params, plain_ops = _run(False, INNERS[name])
    ours_params, ours_ops = _run(True, INNERS[name])
    for a, b in zip(ours_params, plain_params, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    assert ours_ops == plain_ops  # no extra kernel, no check, no host sync of its own


def test_disabled_surface() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), enabled=False)
    assert opt.enabled is False and isinstance(opt._ls, DisabledScale)  # no loss-scale state at all
    loss = (w**2).sum()
    assert opt.get_scaled_loss(loss) is loss
    grads = [torch.ones(2), None]
    assert opt.get_unscaled_gradients(grads) == grads
    assert float(opt.loss_scale) == 1.0 and opt.dynamic_counter == 0
    assert bool(opt.last_step_applied) and int(opt.skipped_steps) == 0
    assert opt.get_config()["enabled"] is False
    assert "enabled" not in LossScaleOptimizer(torch.optim.SGD([w], lr=0.5)).get_config()
    again = LossScaleOptimizer.from_config(opt.get_config(), [torch.nn.Parameter(torch.ones(2))])
    assert again.enabled is False
    with pytest.raises(TypeError, match="enabled"):
        LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), enabled="no")  # type: ignore[arg-type]


def test_closure_and_return_value_pass_through() -> None:
    w = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    opt = LossScaleOptimizer(torch.optim.LBFGS([w], lr=0.5, max_iter=3), enabled=False)
    twin = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    ref = torch.optim.LBFGS([twin], lr=0.5, max_iter=3)

    def closure_for(p: torch.nn.Parameter, o: Any) -> Any:
        def closure() -> torch.Tensor:
            o.zero_grad()
            loss = (p**2).sum()
            loss.backward()
            return loss

        return closure

    assert torch.equal(opt.step(closure_for(w, opt)), ref.step(closure_for(twin, ref)))
    assert torch.equal(w, twin)


def test_state_dict_round_trips_and_crosses_to_an_enabled_optimizer() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    off = LossScaleOptimizer(torch.optim.Adam([w], lr=0.1), enabled=False)
    off.get_scaled_loss(w.sum()).backward()
    off.step()
    sd = off.state_dict()
    assert set(sd) == {"state", "param_groups"}  # the inner optimizer's, as is
    off2 = LossScaleOptimizer(torch.optim.Adam([w], lr=0.1), enabled=False)
    off2.load_state_dict(sd)
    assert off2.state_dict()["state"][0]["step"] == sd["state"][0]["step"]
    on = LossScaleOptimizer(torch.optim.Adam([w], lr=0.1), initial_scale=64.0)
    on.load_state_dict(sd)  # keeps its own scale
    assert float(on.loss_scale) == 64.0
    off2.load_state_dict(on.state_dict())  # the loss-scale entries are ignored
    assert set(off2.state_dict()) == {"state", "param_groups"}


def test_experimental_and_step_together() -> None:
    w, v = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    exp = experimental.LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), "dynamic", enabled=False)
    on = LossScaleOptimizer(torch.optim.SGD([v], lr=0.5), initial_scale=4.0)
    assert exp.enabled is False
    exp.get_scaled_loss(w.sum()).backward()
    on.get_scaled_loss(v.sum()).backward()
    assert bool(step_together(exp, on))
    assert w.tolist() == [0.5, 0.5] and v.tolist() == [0.5, 0.5]
