"""The two homes of a torch front end's loss scale (``_state.py``), against the core rule.

Where the rule runs is an execution strategy: on the host (NumPy) after a synced step, on the
device (torch's fused update kernel where it provably computes the rule, else the rule on
tensors) after a fused one. Every path, and any interleaving of them, must give the core rule's
values bit for bit: the scale, both counters, the skipped steps and the stall count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lossscale.core import (
    dynamic_rule,
    dynamic_state,
    dynamic_update,
    scale_settings,
    stall_alarm,
    stall_update,
)
from lossscale.torch._state import fused_factors, scale_state

KERNEL_RULES = [
    dynamic_rule(1, 2.0),  # TensorFlow: divide by a power of two
    dynamic_rule(3, 4.0, min_loss_scale=64.0),  # the floor binds
    dynamic_rule(2, 2.0, backoff_factor=0.5),  # torch's GradScaler
    dynamic_rule(4, 1.5, backoff_factor=0.75, min_loss_scale=0.25),
    dynamic_rule(5, 8.0, backoff_factor=0.125, min_loss_scale=2.0**-20),
]
RULE_RULES = [  # the rule itself on tensors (or on float64 copies)
    dynamic_rule(2, 3.0),  # TF division by 3 is not a product
    dynamic_rule(2, 2.0, hysteresis=3),
    dynamic_rule(2, 2.0, max_loss_scale=2.0**20),
    dynamic_rule(2, 1.1, backoff_factor=0.5),  # float64 products
    dynamic_rule(3, 2.0, backoff_factor=0.3, min_loss_scale=4.0),
]


def test_the_kernel_is_used_only_where_it_computes_the_rule() -> None:
    for rule in KERNEL_RULES:
        assert fused_factors(rule) is not None
    for rule in RULE_RULES:
        assert fused_factors(rule) is None


class _Reference:
    """The core rule and stall count on NumPy, with the skipped steps."""

    def __init__(self, initial: float, rule: Any) -> None:
        self.rule = rule
        self.state = dynamic_state(initial, rule)
        self.stalled = np.asarray(0)
        self.skipped = 0

    def step(self, finite: bool) -> None:
        flag = np.asarray(finite)
        self.stalled = stall_update(self.stalled, flag, self.state.loss_scale, self.rule)
        if self.rule.backoff_factor is not None and any(
            float(np.float32(f)) != f for f in (self.rule.multiplier, self.rule.backoff_factor)
        ):
            wide = self.state._replace(loss_scale=self.state.loss_scale.astype(np.float64))
            new = dynamic_update(wide, flag, self.rule)
            self.state = new._replace(loss_scale=new.loss_scale.astype(np.float32))
        else:
            self.state = dynamic_update(self.state, flag, self.rule)
        self.skipped += not finite


def _run(rule: Any, homes: str, seed: int) -> None:
    """Random steps, each in the home named by ``homes`` ('h' host, 'd' device, 'm' mixed),
    compared with the reference after every step."""
    rng = np.random.default_rng(seed)
    for trial in range(3):
        initial = float(np.float32(rng.choice([rule.min_loss_scale, 2.0**10, 3.0e38, 777.0])))
        initial = min(initial, float(np.float32(rule.max_loss_scale)))
        settings = scale_settings(True, initial, rule.increment_period)._replace(rule=rule)
        ls = scale_state(settings, torch.device("cpu"), stall_alarm(10**6), "test")
        ref = _Reference(initial, rule)
        for i, finite in enumerate(rng.random(250) < rng.uniform(0.3, 0.9)):
            home = homes if homes != "m" else "hd"[int(rng.integers(2))]
            if home == "h":
                ls.record_host(bool(finite))
            else:
                ls.record_device(torch.tensor(0.0 if finite else 1.0))
            ref.step(bool(finite))
            scale, good, bad, skipped, stalled = ls.host_values()
            want = ref.state
            assert np.float32(scale).tobytes() == want.loss_scale.tobytes(), (trial, i)
            assert (good, bad) == (int(want.good_steps), int(want.nonfinite_steps)), (trial, i)
            assert (skipped, stalled) == (ref.skipped, int(ref.stalled)), (trial, i)
            assert ls.scale.numpy().tobytes() == want.loss_scale.tobytes(), (trial, i)
            assert bool(ls.applied) is bool(finite) and int(ls.skipped) == ref.skipped


@pytest.mark.parametrize("homes", ["h", "d", "m"], ids=["host", "device", "mixed"])
@pytest.mark.parametrize("rule", KERNEL_RULES + RULE_RULES, ids=str)
def test_every_home_follows_the_core_rule_bit_for_bit(rule: Any, homes: str) -> None:
    _run(rule, homes, seed=len(str(rule)))


def test_a_broken_kernel_strategy_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard for the test itself: the kernel with the TF division as a growth-sized
    back-off (a wrong factor) fails the comparison."""
    monkeypatch.setattr(
        "lossscale.torch._state.fused_factors", lambda rule: (rule.multiplier, rule.multiplier)
    )
    with pytest.raises(AssertionError):
        _run(KERNEL_RULES[0], "d", seed=1)


def test_a_scale_below_the_floor_takes_the_rules_own_path() -> None:
    """initial_scale < min_loss_scale: the rule keeps a finite step's scale (only back-offs are
    floored), the kernel + clamp would lift it; the device home uses the rule there."""
    rule = dynamic_rule(5, 2.0, min_loss_scale=4.0)
    settings = scale_settings(True, 1.0, 5)._replace(rule=rule)
    ls = scale_state(settings, torch.device("cpu"), None, "test")
    ls.record_device(torch.tensor(0.0))
    assert float(ls.scale) == 1.0
    ls.record_device(torch.tensor(1.0))
    assert float(ls.scale) == 4.0


def test_snapshots_keep_their_value_across_homes() -> None:
    rule = dynamic_rule(1, 2.0)
    settings = scale_settings(True, 8.0, 1)._replace(rule=rule)
    ls = scale_state(settings, torch.device("cpu"), None, "test")
    before = ls.scale_snapshot()
    ls.record_device(torch.tensor(0.0))  # grows in place on the device
    during = ls.scale_snapshot()
    ls.record_device(torch.tensor(1.0))
    ls.record_host(True)
    assert (float(before), float(during), float(ls.scale)) == (8.0, 16.0, 16.0)


def test_the_float32_reciprocal_is_torchs_float64_one() -> None:
    """Both front ends unscale by ``torch.reciprocal`` of the float32 scale; torch's
    GradScaler computes it in float64 and rounds. Double rounding is innocuous for division
    when 53 >= 2 * 24 + 2: equal for every float32 (here 4M random normal ones, both ends of
    the range, and the subnormal reciprocals)."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0x00800000, 0x7F7FFFFF, (4_000_000,), dtype=torch.int32, generator=gen)
    x = torch.cat([bits.view(torch.float32), torch.tensor([1.0, 2.0**-126, 3.0e38, 3.0])])
    ours = torch.reciprocal(x)
    torchs = x.double().reciprocal().float()
    assert torch.equal(ours.view(torch.int32), torchs.view(torch.int32))
