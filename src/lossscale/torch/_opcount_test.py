"""Issue 20 item 2: the scale update's device ops.

Where ``torch._amp_update_scale_`` provably computes the core rule (``_fused_factors``), the
engine runs it instead of the rule's branch-free ``where`` chain: an execution strategy, tested
here bit for bit against :func:`lossscale.core.dynamic_update` over random sequences; and the
aten ops of one step, counted with a ``TorchDispatchMode`` beside torch.amp.GradScaler's.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale.core import dynamic_rule, dynamic_state, dynamic_update, scale_settings
from lossscale.torch import GradScaler, LossScaleOptimizer
from lossscale.torch._engine import ScaleState, _fused_factors

KERNEL_RULES = [
    dynamic_rule(1, 2.0),  # TensorFlow: divide by a power of two
    dynamic_rule(3, 4.0, min_loss_scale=64.0),  # the floor binds
    dynamic_rule(2, 2.0, backoff_factor=0.5),  # torch's GradScaler
    dynamic_rule(4, 1.5, backoff_factor=0.75, min_loss_scale=0.25),
    dynamic_rule(5, 8.0, backoff_factor=0.125, min_loss_scale=2.0**-20),
]


def test_the_kernel_is_used_only_where_it_computes_the_rule() -> None:
    for rule in KERNEL_RULES:
        assert _fused_factors(rule) is not None
    for rule in [
        dynamic_rule(2, 3.0),  # TF division by 3 is not a product
        dynamic_rule(2, 2.0, hysteresis=2),
        dynamic_rule(2, 2.0, max_loss_scale=2.0**20),
        dynamic_rule(2, 1.1, backoff_factor=0.5),  # float64 products: the wide path
        dynamic_rule(2, 2.0, backoff_factor=0.3),
    ]:
        assert _fused_factors(rule) is None


@pytest.mark.parametrize("rule", KERNEL_RULES, ids=str)
def test_the_kernel_path_equals_the_core_rule_bit_for_bit(rule: Any) -> None:
    rng = np.random.default_rng(3)
    for trial in range(4):
        initial = float(np.float32(rng.choice([rule.min_loss_scale, 2.0**10, 3.0e38, 777.0])))
        settings = scale_settings(True, initial, rule.increment_period)._replace(rule=rule)
        ls = ScaleState(settings, torch.device("cpu"))
        ref = dynamic_state(initial, rule)
        for finite in rng.random(300) < rng.uniform(0.3, 0.9):
            ls.record(torch.tensor(bool(finite)), None)
            ref = dynamic_update(ref, np.asarray(bool(finite)), rule)
            scale, good, bad = ls.state
            got = (scale.numpy().tobytes(), int(good), int(bad))
            assert got == (ref.loss_scale.tobytes(), int(ref.good_steps), int(ref.nonfinite_steps))
        assert ls.above_floor, trial


def test_a_scale_below_the_floor_takes_the_rules_own_path() -> None:
    """initial_scale < min_loss_scale: the rule keeps a finite step's scale (only back-offs are
    floored), the kernel + clamp would lift it; the engine uses the rule there."""
    rule = dynamic_rule(5, 2.0, min_loss_scale=4.0)
    settings = scale_settings(True, 1.0, 5)._replace(rule=rule)
    ls = ScaleState(settings, torch.device("cpu"))
    assert not ls.above_floor
    ls.record(torch.tensor(True), None)
    assert float(ls.scale) == 1.0


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def _inner(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.1, foreach=kind == "foreach")


def _extra_ops(kind: str, front_end: str) -> int:
    """Aten ops of the second step beyond the bare inner optimizer's."""
    x = torch.randn(4, 8)
    model = _model()
    bare = _inner(model, kind)
    for _ in range(2):
        model(x).sum().backward()
        with _Count() as base:
            bare.step()
    model = _model()
    opt = _inner(model, kind)
    lso = LossScaleOptimizer(opt) if front_end == "optimizer" else None
    scaler = {"grad_scaler": GradScaler, "torch": torch.amp.GradScaler}.get(front_end)
    s = scaler("cpu") if scaler is not None else None
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).sum()
        with _Count() as count, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if lso is not None:
                lso.get_scaled_loss(loss).backward()
                lso.step()
            else:
                s.scale(loss).backward()  # type: ignore[union-attr]
                s.step(opt)  # type: ignore[union-attr]
                s.update()  # type: ignore[union-attr]
    with _Count() as fwd:
        loss = model(x).sum()
        loss.backward()
        loss.mul(1.0)  # the scale's multiply, counted in both
    return sum(count.ops.values()) - sum(base.ops.values()) - sum(fwd.ops.values())


# Exact counts on torch 2.13 CPU, beyond the bare inner step, the forward/backward and the loss
# multiply: torch.amp.GradScaler 5 on every path. With the rule's where chain instead of the
# fused kernel (``_fused_factors`` returning None): 11 more each (before this change 28 / 28 / 27
# and 33 / 33 / 26). The rest: the check and unscale kernel, the skip/stall/skipped-steps
# records, the flag's compare.
TORCH_COUNT = 5
EXPECTED = {
    ("plain", "optimizer"): 16,
    ("foreach", "optimizer"): 16,
    ("fused", "optimizer"): 13,
    ("plain", "grad_scaler"): 14,
    ("foreach", "grad_scaler"): 14,
    ("fused", "grad_scaler"): 12,
}


@pytest.mark.parametrize(("kind", "front_end"), list(EXPECTED))
def test_op_counts_of_one_step(kind: str, front_end: str) -> None:
    assert _extra_ops(kind, "torch") == TORCH_COUNT
    assert _extra_ops(kind, front_end) == EXPECTED[kind, front_end]


def test_op_counts_fall_back_to_the_rule_where_the_kernel_does_not_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard for the strategy itself: the rule's where chain costs 11 more ops."""
    monkeypatch.setattr("lossscale.torch._engine._fused_factors", lambda rule: None)
    assert _extra_ops("foreach", "optimizer") == EXPECTED["foreach", "optimizer"] + 11
