"""The hysteresis refills of :class:`lossscale.core.DynamicRule` against the engines' own rules.

The oracles: a port of the update rule of DeepSpeed 0.19.8's
``deepspeed/runtime/fp16/loss_scaler.py`` (``DynamicLossScaler.__init__`` L219-238,
``update_scale`` L253-288), written here line for line in plain Python so that the tests run
without DeepSpeed, and for Megatron-core the one port of its ``DynamicGradScaler``,
:class:`lossscale.megatron._testing.MegatronDynamicPort` (cited there), which the Megatron
classes' tests use too. Two deliberate changes to DeepSpeed's, each a parameter of the port
and tested both ways:

* DeepSpeed's growth comes on the (W+1)-th finite step after a start or an overflow
  (``stable > 0 and stable % W == 0``, since its PR 6976); lossscale keeps TensorFlow's timing,
  the W-th (``(stable + 1) % W == 0``, DeepSpeed's condition before that PR). Bit-identical with
  the latter; the former is shown to differ by exactly one step.
* DeepSpeed raises at the floor (``raise_error_at_min_scale=True``, its constructor default);
  lossscale keeps the floor and skips (the stall alarm warns). The port uses the constructor's
  ``raise_error_at_min_scale=False``, DeepSpeed's own non-raising mode.
"""

from __future__ import annotations

import numpy as np
import pytest

from lossscale.core import (
    FLOAT32_MAX,
    HYSTERESIS_REFILLS,
    dynamic_rule,
    dynamic_state,
    dynamic_update,
)


class DeepSpeedDynamicLossScaler:
    """Port of DeepSpeed 0.19.8 ``DynamicLossScaler`` (loss_scaler.py L219-288): its state and
    ``update_scale``. ``tf_growth_timing=False`` is the shipped condition (L279)."""

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        tf_growth_timing: bool,
    ) -> None:
        self.cur_scale = init_scale  # L227
        self.cur_iter = 0  # L228
        self.last_overflow_iter = -1  # L229
        self.scale_factor = 2.0  # L230 (hard-coded since PR 6976)
        self.scale_window = scale_window  # L231
        self.min_scale = min_scale  # L232
        self.delayed_shift = delayed_shift  # L233
        self.cur_hysteresis = delayed_shift  # L234
        self.consecutive_hysteresis = consecutive_hysteresis  # L235
        self.raise_error_at_min_scale = False  # L236 (constructor argument; True by default)
        self.tf_growth_timing = tf_growth_timing

    def update_scale(self, overflow: bool) -> None:  # L253-288
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise AssertionError("unreachable: raise_error_at_min_scale is False")
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if self.tf_growth_timing:
                grow = (stable + 1) % self.scale_window == 0  # before PR 6976
            else:
                grow = stable > 0 and stable % self.scale_window == 0  # 0.19.8, L279
            if grow:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def lossscale_scales(flags: list[bool], initial: float, **rule_kwargs: object) -> list[float]:
    rule = dynamic_rule(**rule_kwargs)  # type: ignore[arg-type]
    state = dynamic_state(initial, rule)
    out = []
    for finite in flags:
        state = dynamic_update(state, np.asarray(finite), rule)
        assert 0 <= int(state.nonfinite_steps) < rule.hysteresis  # never below zero, never past
        out.append(float(state.loss_scale))
    return out


def random_flags(seed: int, n: int) -> list[bool]:
    """Finite/non-finite flags with runs of both: overflow bursts and long finite stretches."""
    rng = np.random.default_rng(seed)
    p_overflow = rng.choice([0.02, 0.2, 0.5, 0.8])
    return [bool(x) for x in rng.random(n) >= p_overflow]


def below_ceiling(ours: list[float], theirs: list[float]) -> tuple[list[float], list[float]]:
    """Both trajectories up to the step where the engine's passes float32's maximum, which
    lossscale refuses (``max_loss_scale``) and the engines do not check."""
    n = next((i for i, s in enumerate(theirs) if s > FLOAT32_MAX), len(theirs))
    assert n >= 50
    return ours[:n], theirs[:n]


def deepspeed_scales(flags: list[bool], initial: float, **kwargs: object) -> list[float]:
    ds = DeepSpeedDynamicLossScaler(initial, **kwargs)  # type: ignore[arg-type]
    out = []
    for finite in flags:
        ds.update_scale(not finite)
        out.append(ds.cur_scale)
    return out


def megatron_scales(flags: list[bool], initial: float, **kwargs: object) -> list[float]:
    """Megatron's trajectory, from the one port of its scaler (its scale may pass float32's
    maximum: it has no ceiling)."""
    pytest.importorskip("torch")  # the port keeps Megatron's one-element float32 tensors
    from lossscale.megatron._testing import MegatronDynamicPort

    mg = MegatronDynamicPort(initial, **kwargs)  # type: ignore[arg-type]
    out = []
    for finite in flags:
        mg.update(not finite)
        out.append(float(mg.scale.item()))
    return out


# -- the side-by-side trace: W=3, H=2, initial 64 ------------------------------------------

TRACE = [False, True, False, True, False, False, False, True, True, True, True, True, True]


def test_trace_of_the_three_refills() -> None:
    kw = {"increment_period": 3, "hysteresis": 2}
    # on_backoff absorbs every second non-finite step, even right after a back-off
    assert lossscale_scales(TRACE, 64, **kw) == [64, 64, 32, 32, 32, 16, 16, 16, 16, 32, 32, 32, 64]
    # on_growth: after the first back-off every non-finite step backs off until a growth
    assert lossscale_scales(TRACE, 64, hysteresis_refill="on_growth", **kw) == (
        [64, 64, 32, 32, 16, 8, 4, 4, 4, 8, 8, 8, 16]
    )
    # on_finite_step: back off only on the 2nd non-finite step in a row (and each one after)
    assert lossscale_scales(TRACE, 64, hysteresis_refill="on_finite_step", **kw) == (
        [64, 64, 64, 64, 64, 32, 16, 16, 16, 32, 32, 32, 64]
    )


def test_refills_are_one_rule_at_hysteresis_one() -> None:
    for seed in range(5):
        flags = random_flags(seed, 300)
        expected = lossscale_scales(flags, 2.0**10, increment_period=4)
        for refill in HYSTERESIS_REFILLS:
            got = lossscale_scales(flags, 2.0**10, increment_period=4, hysteresis_refill=refill)
            assert got == expected


# -- bit for bit against the engines' rules over random sequences ---------------------------


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("consecutive", [False, True])
def test_deepspeed_rule_with_tensorflow_growth_timing(seed: int, consecutive: bool) -> None:
    rng = np.random.default_rng(1000 + seed)
    window, hyst = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    initial, floor = 2.0 ** int(rng.integers(0, 17)), 2.0 ** int(rng.integers(-3, 3))
    flags = random_flags(seed, 400)
    ds = deepspeed_scales(
        flags,
        initial,
        scale_window=window,
        min_scale=floor,
        delayed_shift=hyst,
        consecutive_hysteresis=consecutive,
        tf_growth_timing=True,
    )
    ours = lossscale_scales(
        flags,
        initial,
        increment_period=window,
        min_loss_scale=floor,
        hysteresis=hyst,
        hysteresis_refill="on_finite_step" if consecutive else "on_growth",
    )
    assert below_ceiling(ours, ds)[0] == below_ceiling(ours, ds)[1]


def test_deepspeed_0_19_8_grows_one_step_later() -> None:
    """The documented difference: DeepSpeed's first growth after a start or an overflow comes on
    the (W+1)-th finite step; lossscale's (and TensorFlow's, Megatron's) on the W-th."""
    flags = [True] * 7 + [False] + [True] * 7
    kw = {"scale_window": 3, "min_scale": 1.0, "delayed_shift": 1, "consecutive_hysteresis": False}
    shipped = deepspeed_scales(flags, 64, tf_growth_timing=False, **kw)
    ours = lossscale_scales(flags, 64, increment_period=3)
    assert ours[:7] == [64, 64, 128, 128, 128, 256, 256]
    assert shipped[:7] == [64, 64, 64, 128, 128, 128, 256]
    assert ours[7:] == [128, 128, 128, 256, 256, 256, 512, 512]
    assert shipped[7:] == [128, 128, 128, 128, 256, 256, 256, 512]


@pytest.mark.parametrize("seed", range(12))
def test_megatron_rule(seed: int) -> None:
    rng = np.random.default_rng(2000 + seed)
    interval, hyst = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    growth, backoff = [(2.0, 0.5), (1.5, 0.75), (4.0, 0.25), (2.0, 0.75)][seed % 4]
    initial = 2.0 ** int(rng.integers(0, 20))
    flags = random_flags(seed, 400)
    mg = megatron_scales(
        flags,
        initial,
        min_scale=1.0,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hyst,
    )
    ours = lossscale_scales(
        flags,
        initial,
        increment_period=interval,
        multiplier=growth,
        backoff_factor=backoff,
        hysteresis=hyst,
        hysteresis_refill="on_growth",
    )
    assert below_ceiling(ours, mg)[0] == below_ceiling(ours, mg)[1]


# -- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [("on_overflow", ValueError), ("", ValueError), (1, TypeError), (None, TypeError)],
)
def test_refill_is_validated(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"hysteresis_refill must be one of .*got {value!r}"):
        dynamic_rule(hysteresis=2, hysteresis_refill=value)


def test_refill_error_uses_the_front_end_name() -> None:
    with pytest.raises(ValueError, match=r"^refill must be one of"):
        dynamic_rule(hysteresis_refill="x", names={"hysteresis_refill": "refill"})
