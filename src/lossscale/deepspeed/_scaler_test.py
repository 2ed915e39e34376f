"""DeepSpeedLossScaler on its own: the rule, the stall alarm, errors, state and pickling."""

from __future__ import annotations

import io
import pickle
import warnings

import numpy as np
import pytest
import torch

from lossscale.core import LossScaleStalledError, LossScaleStalledWarning
from lossscale.deepspeed import DeepSpeedLossScaler


def scales(scaler: DeepSpeedLossScaler, overflows: str) -> list[float]:
    out = []
    for flag in overflows:
        scaler.update_scale(flag == "x")
        out.append(scaler.cur_scale)
    return out


def test_rule_floor_and_growth() -> None:
    s = DeepSpeedLossScaler(initial_scale=4.0, dynamic_growth_steps=2, min_loss_scale=0.5)
    assert scales(s, "xxxx..") == [2.0, 1.0, 0.5, 0.5, 0.5, 1.0]
    assert s.skipped_steps == 4 and s.last_step_applied and s.dynamic


def test_hysteresis_modes() -> None:
    grow = DeepSpeedLossScaler(initial_scale=64.0, hysteresis=2, hysteresis_refill="on_growth")
    assert scales(grow, "x.xx") == [64.0, 64.0, 32.0, 16.0]
    each = DeepSpeedLossScaler(initial_scale=64.0, hysteresis=2, hysteresis_refill="on_finite_step")
    assert scales(each, "x.x.xx") == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]


def test_fixed_scale_never_changes_and_counts_skips() -> None:
    s = DeepSpeedLossScaler(dynamic=False, initial_scale=128)
    assert scales(s, ".xx.") == [128.0] * 4 and s.skipped_steps == 2 and not s.dynamic
    with pytest.raises(ValueError, match="cannot change"):
        s.cur_scale = 64.0
    s.cur_scale = 128.0  # the same value: allowed


def test_scale_loss_promotes_half_losses() -> None:
    s = DeepSpeedLossScaler(initial_scale=2.0**16)
    half = torch.tensor(2.0, dtype=torch.float16)
    assert s.scale_loss(half).dtype == torch.float32 and s.scale_loss(half).item() == 2.0**17
    assert s.scale_loss(torch.tensor(1.5, dtype=torch.float64)).dtype == torch.float64
    w = torch.ones(1, requires_grad=True)
    s.backward((w * 3).sum())
    assert w.grad is not None and w.grad.item() == 3 * 2.0**16


def test_stall_alarm_warns_once_per_stall_and_raises_when_asked() -> None:
    s = DeepSpeedLossScaler(initial_scale=1.0, stall_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales(s, "xxxx.xx")
    stalls = [w for w in caught if issubclass(w.category, LossScaleStalledWarning)]
    assert len(stalls) == 2  # once per stall; the finite step re-arms it
    strict = DeepSpeedLossScaler(initial_scale=1.0, stall_steps=2, on_stall="raise")
    strict.update_scale(True)
    with pytest.raises(LossScaleStalledError, match=r"last 2 steps .* minimum \(1\.0\)"):
        strict.update_scale(True)


def test_a_healthy_run_never_warns() -> None:
    rng = np.random.default_rng(0)
    s = DeepSpeedLossScaler(initial_scale=2.0**16, dynamic_growth_steps=50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for overflow in rng.random(3000) < 0.01:
            s.update_scale(bool(overflow))


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"min_loss_scale": 0}, ValueError, "min_loss_scale must be finite and > 0, got 0"),
        ({"hysteresis": 0}, ValueError, "hysteresis must be an integer >= 1, got 0"),
        ({"hysteresis_refill": "never"}, ValueError, "hysteresis_refill must be one of"),
        ({"stall_steps": 0}, ValueError, "stall_steps must be an integer >= 1, got 0"),
        ({"dynamic": "dynamic"}, TypeError, "dynamic must be a bool"),
        ({"dynamic_growth_steps": 2.5}, TypeError, "dynamic_growth_steps must be an integer"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        DeepSpeedLossScaler(**kwargs)  # type: ignore[arg-type]


def test_bad_overflow_and_scale_leave_the_state_unchanged() -> None:
    s = DeepSpeedLossScaler(initial_scale=8.0, max_loss_scale=64.0)
    before = s.state_dict()
    with pytest.raises(TypeError, match="overflow must be a bool, got 1"):
        s.update_scale(1)
    with pytest.raises(ValueError, match=r"cur_scale=128\.0 exceeds max_loss_scale=64\.0"):
        s.cur_scale = 128.0
    assert s.state_dict() == before
    s.update_scale(torch.tensor(True))  # a one-element bool tensor is read
    assert s.cur_scale == 4.0


def test_state_dict_round_trip_and_errors() -> None:
    s = DeepSpeedLossScaler(initial_scale=64.0, dynamic_growth_steps=3, hysteresis=2)
    scales(s, "x.x.")
    state = s.state_dict()
    assert state == {
        "loss_scale": {
            "version": 1,
            "class_name": "DynamicLossScale",
            "current_loss_scale": 32.0,
            "num_good_steps": 1,
            "num_nonfinite_steps": 0,
        },
        "skipped_steps": 2,
    }
    fresh = DeepSpeedLossScaler(initial_scale=64.0, dynamic_growth_steps=3, hysteresis=2)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    bad = {**state, "loss_scale": {**state["loss_scale"], "num_good_steps": 3}}
    with pytest.raises(ValueError, match=r"num_good_steps.*\[0, increment_period=3\)"):
        fresh.load_state_dict(bad)
    with pytest.raises(
        ValueError, match=r"state_dict\[.skipped_steps.\] must be an int >= 0, got -1"
    ):
        fresh.load_state_dict({**state, "skipped_steps": -1})
    with pytest.raises(ValueError, match="with keys"):
        fresh.load_state_dict({"scale": 1.0})
    fixed = DeepSpeedLossScaler(dynamic=False, initial_scale=64.0)
    with pytest.raises(ValueError, match="cannot load it into a FixedLossScale"):
        fixed.load_state_dict(state)
    assert fresh.state_dict() == state and fixed.cur_scale == 64.0


def test_pickles_as_plain_values_and_loads_with_weights_only() -> None:
    s = DeepSpeedLossScaler(initial_scale=64.0, hysteresis=2, hysteresis_refill="on_growth",
                            stall_steps=7, on_stall="raise")  # fmt: skip
    scales(s, "x.")
    copy = pickle.loads(pickle.dumps(s))
    assert copy.state_dict() == s.state_dict() and copy.get_config() == s.get_config()
    buffer = io.BytesIO()
    torch.save({"loss_scaler": s}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["loss_scaler"]  # registered on import
    assert type(loaded) is DeepSpeedLossScaler and loaded.state_dict() == s.state_dict()
    assert loaded.get_config() == {
        "dynamic": True,
        "initial_scale": 64.0,
        "dynamic_growth_steps": 2000,
        "hysteresis": 2,
        "hysteresis_refill": "on_growth",
        "stall_steps": 7,
        "on_stall": "raise",
    }
