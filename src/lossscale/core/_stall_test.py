"""Tests of the stall alarm: :func:`stall_alarm`, :func:`stall_update`, :func:`report_stall`."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from lossscale.core import (
    DEFAULT_STALL_STEPS,
    LossScaleStalledError,
    LossScaleStalledWarning,
    StallAlarm,
    dynamic_rule,
    dynamic_state,
    dynamic_update,
    report_stall,
    stall_alarm,
    stall_update,
)


def test_default_fires_within_a_thousand_steps() -> None:
    # clarification U1: the default must fire within 1,000 consecutive skipped steps
    assert stall_alarm() == StallAlarm(DEFAULT_STALL_STEPS, "warn")
    assert 1 <= DEFAULT_STALL_STEPS <= 1000


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"stall_steps": 0}, ValueError, "stall_steps must be an integer >= 1, got 0"),
        ({"stall_steps": 2.5}, TypeError, "stall_steps.*2.5"),
        ({"stall_steps": True}, TypeError, "stall_steps.*True"),
        ({"on_stall": "ignore"}, ValueError, "on_stall must be 'warn' or 'raise', got 'ignore'"),
        ({"on_stall": None}, TypeError, "on_stall.*None"),
    ],
)
def test_stall_alarm_rejects(
    kwargs: dict[str, object], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        stall_alarm(**kwargs)  # type: ignore[arg-type]


def test_stall_alarm_names_the_front_ends_argument() -> None:
    with pytest.raises(ValueError, match="stall_alarm_steps must be"):
        stall_alarm(0, names={"stall_steps": "stall_alarm_steps"})


def run_counts(steps: list[bool], initial: float, **rule_kwargs: object) -> list[int]:
    """The stall count after each step of a NumPy run of the rule."""
    rule = dynamic_rule(**rule_kwargs)  # type: ignore[arg-type]
    state, count, out = dynamic_state(initial, rule), np.asarray(0), []
    for finite in steps:
        flag = np.asarray(finite)
        count = stall_update(count, flag, state.loss_scale, rule)
        state = dynamic_update(state, flag, rule)
        out.append(int(count))
    return out


def test_counts_only_skips_taken_at_the_floor() -> None:
    # 8 -> 4 -> 2 -> 1 (floor reached by the third skip), then skips at the floor count
    assert run_counts([False] * 6, 8.0) == [0, 0, 0, 1, 2, 3]


def test_a_finite_step_resets_the_count() -> None:
    assert run_counts([False, False, True, False, False], 1.0) == [1, 2, 0, 1, 2]


def test_floor_is_min_loss_scale_and_a_scale_below_it_counts() -> None:
    assert run_counts([False] * 3, 16.0, min_loss_scale=4) == [0, 0, 1]
    assert run_counts([False] * 2, 0.5) == [1, 2]  # C3: starts below the floor of 1


def test_hysteresis_skips_at_the_floor_still_count() -> None:
    assert run_counts([False] * 4, 1.0, hysteresis=3) == [1, 2, 3, 4]


def test_count_keeps_library_device_and_dtype() -> None:
    torch = pytest.importorskip("torch")
    count = torch.zeros((), dtype=torch.int32)
    out = stall_update(count, torch.tensor(False), torch.tensor(1.0), dynamic_rule())
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int32 and int(out) == 1


def test_count_under_jax_jit() -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    rule = dynamic_rule()
    step = jax.jit(lambda c, f, s: stall_update(c, f, s, rule))
    count = jnp.asarray(0)
    for _ in range(3):
        count = step(count, jnp.asarray(False), jnp.float32(1.0))
    assert int(count) == 3
    assert int(step(count, jnp.asarray(True), jnp.float32(1.0))) == 0


def test_report_warns_once_per_stall_and_rearms() -> None:
    alarm, warned = stall_alarm(3), False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for count in [1, 2, 3, 4, 5, 0, 1, 2, 3]:
            warned = report_stall(count, 1.0, alarm, warned=warned, where="test loop")
    assert [w.category for w in caught] == [LossScaleStalledWarning] * 2
    message = str(caught[0].message)
    assert "test loop" in message and "last 3 steps" in message and "(1.0)" in message
    assert "stall_steps=None" in message and "NaN" in message


def test_report_raises_when_asked() -> None:
    with pytest.raises(LossScaleStalledError, match=r"last 4 steps .* minimum \(0\.5\)"):
        report_stall(4, 0.5, stall_alarm(4, "raise"), warned=False, where="x")
    assert report_stall(3, 0.5, stall_alarm(4, "raise"), warned=False, where="x") is False


def test_report_off_never_fires() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert report_stall(10**9, 1.0, stall_alarm(None), warned=False, where="x") is False
