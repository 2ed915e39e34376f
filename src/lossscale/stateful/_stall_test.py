"""The stall alarm of the stateful :class:`lossscale.DynamicLossScale` (issue 19, item 1)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import lossscale
from lossscale.core import LossScaleStalledError, LossScaleStalledWarning

NAN = [np.array([np.nan], np.float32)]
ONE = [np.array([1.0], np.float32)]


def drive(ls: lossscale.DynamicLossScale, grads: list[list[np.ndarray]]) -> list[str]:
    """Run ``update`` over ``grads``; the messages of the stall warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for g in grads:
            ls.update(g)
    return [str(w.message) for w in caught if w.category is LossScaleStalledWarning]


def test_warns_once_at_the_floor_with_scale_count_and_advice() -> None:
    ls = lossscale.DynamicLossScale(8, stall_steps=5)
    messages = drive(ls, [NAN] * 3)  # 8 -> 4 -> 2 -> 1: the floor, no stall counted yet
    assert messages == [] and ls.stalled_steps == 0
    messages = drive(ls, [NAN] * 20)
    assert len(messages) == 1
    assert "last 5 steps" in messages[0] and "minimum (1.0)" in messages[0]
    assert "DynamicLossScale" in messages[0] and "stall_steps=None" in messages[0]
    assert ls.stalled_steps == 20


def test_a_finite_step_rearms_the_alarm() -> None:
    ls = lossscale.DynamicLossScale(1, stall_steps=3)
    assert len(drive(ls, [NAN] * 4 + [ONE] + [NAN] * 3)) == 2


def test_default_fires_within_a_thousand_steps_and_never_in_a_healthy_run() -> None:
    healthy = lossscale.DynamicLossScale(2.0**15, increment_period=10)
    rng = np.random.default_rng(0)
    run = [NAN if r < 0.02 else ONE for r in rng.random(3000)]  # rare overflows
    assert drive(healthy, run) == []
    stalled = lossscale.DynamicLossScale(1.0)
    assert len(drive(stalled, [NAN] * 1000)) == 1


def test_raise_option() -> None:
    ls = lossscale.DynamicLossScale(2, stall_steps=2, on_stall="raise")
    drive(ls, [NAN] * 2)  # 2 -> 1, then one skip at the floor
    with pytest.raises(LossScaleStalledError, match="last 2 steps"):
        ls.update(NAN)
    # the step that raised was still taken by the rule (the scale is at its floor anyway)
    assert float(ls()) == 1.0


def test_off_switch() -> None:
    ls = lossscale.DynamicLossScale(1, stall_steps=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2000):
            ls.update(NAN)
    assert ls.stalled_steps == 2000


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="stall_steps must be an integer >= 1, got 0"):
        lossscale.DynamicLossScale(stall_steps=0)
    with pytest.raises(ValueError, match="on_stall must be 'warn' or 'raise', got 'log'"):
        lossscale.DynamicLossScale(on_stall="log")


def test_config_round_trips_non_default_alarm_settings() -> None:
    assert "stall_steps" not in lossscale.DynamicLossScale().get_config()
    ls = lossscale.DynamicLossScale(4, stall_steps=7, on_stall="raise")
    config = ls.get_config()
    assert (config["stall_steps"], config["on_stall"]) == (7, "raise")
    again = lossscale.DynamicLossScale.from_config(config)
    assert again.get_config() == config
    off = lossscale.DynamicLossScale(stall_steps=None).get_config()
    assert off["stall_steps"] is None
    assert lossscale.DynamicLossScale.from_config(off).get_config() == off


def test_load_state_dict_restarts_the_count() -> None:
    ls = lossscale.DynamicLossScale(1, stall_steps=3)
    drive(ls, [NAN] * 2)
    ls.load_state_dict(ls.state_dict())
    assert ls.stalled_steps == 0
    assert drive(ls, [NAN] * 2) == []


def test_torch_cpu_tensors_are_checked_in_update() -> None:
    torch = pytest.importorskip("torch")
    ls = lossscale.DynamicLossScale(1, stall_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ls.update([torch.tensor([float("inf")])])
    assert [w.category for w in caught] == [LossScaleStalledWarning]
    assert isinstance(ls._stalled, torch.Tensor)


def test_jax_cpu_arrays_are_checked_in_update() -> None:
    jnp = pytest.importorskip("jax.numpy")
    ls = lossscale.DynamicLossScale(1, stall_steps=3, on_stall="raise")
    ls.update([jnp.array([jnp.nan])])
    ls.update([jnp.array([jnp.nan])])
    with pytest.raises(LossScaleStalledError):
        ls.update([jnp.array([jnp.nan])])
