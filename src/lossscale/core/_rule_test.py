"""Tests of the pure rule: :func:`dynamic_rule`, :func:`dynamic_state`, :func:`dynamic_update`,
:func:`all_finite` (NumPy here; torch and JAX at the end, skipped when not installed)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
import pytest

from lossscale.core import (
    FLOAT32_MAX,
    DynamicRule,
    DynamicState,
    all_finite,
    dynamic_rule,
    dynamic_state,
    dynamic_update,
)

F32 = np.float32


def run(
    steps: Iterable[bool], initial: float = 8.0, **rule_kwargs: object
) -> list[tuple[float, int, int]]:
    """(scale, good_steps, nonfinite_steps) after each step of a NumPy trajectory."""
    rule = dynamic_rule(**rule_kwargs)  # type: ignore[arg-type]
    state = dynamic_state(initial, rule)
    out = []
    for finite in steps:
        state = dynamic_update(state, np.asarray(finite), rule)
        out.append((float(state.loss_scale), int(state.good_steps), int(state.nonfinite_steps)))
    return out


def scales(steps: Iterable[bool], initial: float = 8.0, **rule_kwargs: object) -> list[float]:
    return [s for s, _, _ in run(steps, initial, **rule_kwargs)]


# -- dynamic_rule ---------------------------------------------------------------------------


def test_rule_defaults_are_tensorflow() -> None:
    assert dynamic_rule() == DynamicRule(2000, 2.0, 1.0, FLOAT32_MAX, 1)
    assert float(np.finfo(np.float32).max) == FLOAT32_MAX


def test_rule_types_are_python_numbers() -> None:
    rule = dynamic_rule(np.int64(3), np.float32(4), min_loss_scale=1, max_loss_scale=100)
    assert rule == DynamicRule(3, 4.0, 1.0, 100.0, 1)
    assert type(rule.increment_period) is int
    assert type(rule.multiplier) is float
    assert type(rule.min_loss_scale) is float


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"increment_period": 2.7}, TypeError, "increment_period.*2.7"),
        ({"increment_period": True}, TypeError, "increment_period.*True"),
        ({"increment_period": "3"}, TypeError, "increment_period.*'3'"),
        ({"increment_period": None}, TypeError, "increment_period.*None"),
        ({"increment_period": 0}, ValueError, "increment_period.*0"),
        ({"increment_period": -5}, ValueError, "increment_period.*-5"),
        ({"multiplier": 1}, ValueError, "multiplier.*1"),
        ({"multiplier": 0.5}, ValueError, "multiplier.*0.5"),
        ({"multiplier": 0}, ValueError, "multiplier.*0"),
        ({"multiplier": -2.0}, ValueError, "multiplier.*-2.0"),
        ({"multiplier": float("nan")}, ValueError, "multiplier.*nan"),
        ({"multiplier": float("inf")}, ValueError, "multiplier.*inf"),
        ({"multiplier": 1e39}, ValueError, "multiplier.*1e\\+39"),
        ({"multiplier": 1 + 1e-9}, ValueError, "multiplier=1.000000001 rounds to 1"),
        ({"multiplier": "2"}, TypeError, "multiplier.*'2'"),
        ({"multiplier": True}, TypeError, "multiplier.*True"),
        ({"min_loss_scale": 0}, ValueError, "min_loss_scale.*0"),
        ({"min_loss_scale": -1.0}, ValueError, "min_loss_scale.*-1.0"),
        ({"min_loss_scale": float("nan")}, ValueError, "min_loss_scale.*nan"),
        ({"min_loss_scale": 1e-50}, ValueError, "min_loss_scale=1e-50 rounds to 0"),
        ({"min_loss_scale": 1e-40}, ValueError, "min_loss_scale=1e-40 is subnormal"),
        ({"max_loss_scale": 0.0}, ValueError, "max_loss_scale.*0.0"),
        ({"max_loss_scale": float("inf")}, ValueError, "max_loss_scale.*inf"),
        ({"max_loss_scale": 1e39}, ValueError, "max_loss_scale=1e\\+39 overflows float32"),
        (
            {"min_loss_scale": 10, "max_loss_scale": 5},
            ValueError,
            "min_loss_scale=10 must not exceed max_loss_scale=5",
        ),
        ({"hysteresis": 0}, ValueError, "hysteresis.*0"),
        ({"hysteresis": 1.5}, TypeError, "hysteresis.*1.5"),
        ({"hysteresis": True}, TypeError, "hysteresis.*True"),
    ],
)
def test_rule_rejects(kwargs: dict[str, object], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        dynamic_rule(**kwargs)  # type: ignore[arg-type]


def test_rule_accepts_min_below_one_and_min_equal_max() -> None:
    assert dynamic_rule(min_loss_scale=0.25).min_loss_scale == 0.25
    rule = dynamic_rule(min_loss_scale=4, max_loss_scale=4)
    assert (rule.min_loss_scale, rule.max_loss_scale) == (4.0, 4.0)


# -- dynamic_state --------------------------------------------------------------------------


def test_state_is_float32_scale_and_zero_counters() -> None:
    state = dynamic_state(0.1, dynamic_rule())
    assert isinstance(state, DynamicState)
    for array in state:
        assert isinstance(array, np.ndarray)
        assert array.shape == ()
    assert state.loss_scale.dtype == np.float32
    assert float(state.loss_scale) == 0.10000000149011612  # float32(0.1), as TensorFlow
    assert state.good_steps.dtype.kind == "i"
    assert int(state.good_steps) == 0
    assert int(state.nonfinite_steps) == 0


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (float("nan"), ValueError, "initial_loss_scale.*nan"),
        (float("inf"), ValueError, "initial_loss_scale.*inf"),
        (0, ValueError, "initial_loss_scale.*0"),
        (-4.0, ValueError, "initial_loss_scale.*-4.0"),
        (1e39, ValueError, "initial_loss_scale=1e\\+39 overflows float32"),
        (1e-50, ValueError, "initial_loss_scale=1e-50 rounds to 0"),
        (1e-40, ValueError, "initial_loss_scale=1e-40 is subnormal"),
        (1.4e-45, ValueError, "initial_loss_scale=1.4e-45 is subnormal"),
        ("5", TypeError, "initial_loss_scale.*'5'"),
        (None, TypeError, "initial_loss_scale.*None"),
    ],
)
def test_state_rejects_initial(value: object, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        dynamic_state(value, dynamic_rule())  # type: ignore[arg-type]


def test_state_rejects_initial_above_max() -> None:
    with pytest.raises(ValueError, match=r"initial_loss_scale=1000 exceeds max_loss_scale=100"):
        dynamic_state(1000, dynamic_rule(max_loss_scale=100))


def test_state_accepts_the_smallest_normal_float32() -> None:
    tiny = float(np.finfo(np.float32).tiny)
    state = dynamic_state(tiny, dynamic_rule(min_loss_scale=tiny))
    assert float(state.loss_scale) == tiny


def test_state_allows_initial_below_min() -> None:
    # C3: TensorFlow starts at 0.5 with floor 1 and lifts it to 1 on the first back-off.
    state = dynamic_state(0.5, dynamic_rule(min_loss_scale=1))
    assert float(state.loss_scale) == 0.5


# -- dynamic_update: TensorFlow's algorithm ------------------------------------------------


def test_float32_arithmetic_is_observable() -> None:
    # 10 -> /3 -> 3.3333333 -> x3 -> 10.0 (spec 3.3)
    out = scales([False, True], initial=10, increment_period=1, multiplier=3)
    assert out == [3.3333332538604736, 10.0]
    assert out[0] == float(F32(10) / F32(3))
    # 10/3/3 = 1.111111 -> x3 -> 3.333333 (3.3333330154418945, not 3.3333333)
    out = scales([False, False, True], initial=10, increment_period=1, multiplier=3)
    assert out[2] == 3.3333330154418945
    # 0.1 -> x3 -> 0.3 -> x3 -> 0.90000004
    out = scales([True, True], initial=0.1, increment_period=1, multiplier=3)
    assert out[1] == float(F32(0.90000004))
    assert out[1] != 0.9000000000000000


def test_scale_stays_float32() -> None:
    rule = dynamic_rule(increment_period=1, multiplier=3)
    state = dynamic_state(10, rule)
    for finite in (False, True, True):
        state = dynamic_update(state, np.asarray(finite), rule)
        assert state.loss_scale.dtype == np.float32
        assert state.loss_scale.shape == ()


def test_counter_sequence_and_growth_on_the_period_th_finite_step() -> None:
    out = run([True] * 7, initial=8, increment_period=3)
    assert [g for _, g, _ in out] == [1, 2, 0, 1, 2, 0, 1]
    assert [s for s, _, _ in out] == [8, 8, 16, 16, 16, 32, 32]


def test_period_one_grows_every_finite_step() -> None:
    assert scales([True] * 4, initial=1, increment_period=1) == [2, 4, 8, 16]


def test_counter_never_reaches_period() -> None:
    out = run([True] * 50, increment_period=4)
    assert max(g for _, g, _ in out) == 3


def test_non_finite_step_resets_counter_and_halves() -> None:
    out = run([True, True, False, True], initial=8, increment_period=3)
    assert out == [(8, 1, 0), (8, 2, 0), (4, 0, 0), (4, 1, 0)]


def test_shrink_floor_is_one_by_default() -> None:
    assert scales([False] * 6, initial=16, increment_period=5) == [8, 4, 2, 1, 1, 1]
    assert scales([False], initial=1.5) == [1.0]
    out = scales([False, False], initial=4, multiplier=3)
    assert out == [float(F32(4) / F32(3)), 1.0]
    assert out[0] == 1.3333333730697632


def test_floor_lifts_a_scale_below_min_on_back_off_only() -> None:
    assert scales([False], initial=0.5) == [1.0]  # TF: initial 0.5, non-finite -> 1.0
    # no floor on finite steps: 0.5 grows to 1.0, then 2.0
    assert scales([True, True], initial=0.5, increment_period=1) == [1.0, 2.0]


def test_min_loss_scale_below_one_is_the_floor() -> None:
    out = scales([False] * 4, initial=1, min_loss_scale=0.25)
    assert out == [0.5, 0.25, 0.25, 0.25]


def test_min_loss_scale_above_one_is_the_floor() -> None:
    assert scales([False] * 3, initial=64, min_loss_scale=10) == [32, 16, 10]


def test_growth_refused_at_float32_overflow() -> None:
    big = 2.0**127
    out = run([True, True], initial=big, increment_period=1)
    assert out == [(big, 0, 0), (big, 0, 0)]  # scale unchanged, counter reset
    # float32max/4 -> x2 -> x2 = exactly float32max -> stays (not clamped, not inf)
    out = scales([True, True, True], initial=FLOAT32_MAX / 4, increment_period=1)
    assert out == [FLOAT32_MAX / 2, FLOAT32_MAX, FLOAT32_MAX]


def test_growth_refused_above_max_loss_scale() -> None:
    out = run([True, True, True, True], initial=25, increment_period=1, max_loss_scale=100)
    assert out == [(50, 0, 0), (100, 0, 0), (100, 0, 0), (100, 0, 0)]  # == max is allowed
    out = run([True, True], initial=64, increment_period=2, max_loss_scale=100)
    assert out == [(64, 1, 0), (64, 0, 0)]  # refused: scale kept, counter reset


# From this scale, scale * 1.1 is above the float32 maximum in float64 but rounds to it.
_TOP = 3.0934759522862973e38


def _wide_growth(xp_name: str, max_loss_scale: float) -> float:
    """One finite step of the rule on a float64 copy of ``_TOP`` (torch's front end evaluates
    the rule so for factors float32 cannot hold), rounded to float32 as that front end does."""
    rule = dynamic_rule(1, 1.1, backoff_factor=0.5, max_loss_scale=max_loss_scale)
    good, bad = np.asarray(0), np.asarray(0)
    if xp_name == "numpy":
        state, flag = DynamicState(np.asarray(_TOP), good, bad), np.asarray(True)
        return float(np.float32(dynamic_update(state, flag, rule).loss_scale))
    if xp_name == "numpy_scalars":
        from lossscale.core._backends import NUMPY_SCALARS

        state = DynamicState(np.float64(_TOP), np.int64(0), np.int64(0))
        out = dynamic_update(state, np.bool_(True), rule, NUMPY_SCALARS).loss_scale
        return float(np.float32(out))
    torch = pytest.importorskip("torch")
    t = DynamicState(torch.tensor(_TOP, dtype=torch.float64), torch.tensor(0), torch.tensor(0))
    return float(dynamic_update(t, torch.tensor(True), rule).loss_scale.float())


@pytest.mark.parametrize("xp_name", ["numpy", "numpy_scalars", "torch"])
def test_wider_scale_is_judged_against_max_after_rounding_to_float32(xp_name: str) -> None:
    # torch.amp.GradScaler rounds its float64 product to float32 and keeps it when finite
    assert float(np.float32(_TOP * 1.1)) == FLOAT32_MAX < _TOP * 1.1
    assert _wide_growth(xp_name, FLOAT32_MAX) == FLOAT32_MAX
    # a lower ceiling: the rounded candidate is above it, so growth is refused
    assert _wide_growth(xp_name, float(np.nextafter(F32(FLOAT32_MAX), F32(0)))) == float(F32(_TOP))


def test_no_float_warning_on_refused_growth(recwarn: pytest.WarningsRecorder) -> None:
    scales([True, False], initial=FLOAT32_MAX, increment_period=1)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_update_is_pure() -> None:
    rule = dynamic_rule(increment_period=1)
    state = dynamic_state(8, rule)
    new = dynamic_update(state, np.asarray(True), rule)
    assert float(new.loss_scale) == 16
    assert float(state.loss_scale) == 8  # the input state is not modified
    assert new.loss_scale is not state.loss_scale


def test_should_apply_is_not_part_of_state() -> None:
    rule = dynamic_rule(increment_period=2)
    state = dynamic_state(8, rule)
    # a NumPy bool scalar works as well as a 0-d array
    state = dynamic_update(state, np.bool_(True), rule)
    assert int(state.good_steps) == 1


# -- hysteresis (C1) ------------------------------------------------------------------------


def test_hysteresis_one_is_tensorflow() -> None:
    assert run([False, False], initial=8, hysteresis=1) == [(4, 0, 0), (2, 0, 0)]


def test_hysteresis_backs_off_on_the_nth_non_finite_step() -> None:
    out = run([False, False, False, False], initial=64, hysteresis=3)
    assert out == [(64, 0, 1), (64, 0, 2), (32, 0, 0), (32, 0, 1)]


def test_hysteresis_finite_steps_without_growth_do_not_refill() -> None:
    out = run([False, True, True, False], initial=64, increment_period=10, hysteresis=2)
    assert out == [(64, 0, 1), (64, 1, 1), (64, 2, 1), (32, 0, 0)]


def test_hysteresis_refills_on_growth() -> None:
    out = run([False, True, False], initial=64, increment_period=1, hysteresis=2)
    assert out == [(64, 0, 1), (128, 0, 0), (128, 0, 1)]


def test_hysteresis_refills_on_refused_growth() -> None:
    out = run([False, True, False], initial=64, increment_period=1, max_loss_scale=64, hysteresis=2)
    assert out == [(64, 0, 1), (64, 0, 0), (64, 0, 1)]


# -- all_finite -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("grads", "expected"),
    [
        ([np.ones(3, np.float32)], True),
        ([np.array([1.0, np.nan])], False),
        ([np.array([np.inf])], False),
        ([np.array([-np.inf])], False),
        ([np.ones(2), {"a": [None, np.array([np.nan])]}], False),
        ([], True),
        ((), True),
        ({}, True),
        (None, True),
        ([None], True),
        ([np.zeros(0, np.float32)], True),
        ([np.array(65504, np.float16)], True),
        ([np.array(np.inf, np.float16)], False),
        ([np.array(1e300)], True),
        ([1.0, 2.0], True),
        ([float("nan")], False),
    ],
)
def test_all_finite(grads: object, expected: bool) -> None:
    result = all_finite(grads)
    assert isinstance(result, np.ndarray)
    assert result.shape == ()
    assert result.dtype == np.bool_
    assert bool(result) is expected


def test_all_finite_rejects_integer_grads() -> None:
    with pytest.raises(TypeError, match=re.escape("grads[1]")):
        all_finite([np.ones(2), np.ones(2, np.int32)])


# -- torch and JAX --------------------------------------------------------------------------

STEPS = [True, True, False, True, True, True, False, False, True, True, True, True]


def numpy_trajectory(rule: DynamicRule, initial: float) -> list[tuple[float, int, int]]:
    state = dynamic_state(initial, rule)
    out = []
    for finite in STEPS:
        state = dynamic_update(state, np.asarray(finite), rule)
        out.append((float(state.loss_scale), int(state.good_steps), int(state.nonfinite_steps)))
    return out


def test_torch_dynamic_update_matches_numpy() -> None:
    torch = pytest.importorskip("torch")
    rule = dynamic_rule(increment_period=2, multiplier=3, hysteresis=2)
    like = torch.zeros(2)
    state = dynamic_state(10, rule, like=like)
    assert isinstance(state.loss_scale, torch.Tensor)
    assert state.loss_scale.dtype == torch.float32
    assert state.good_steps.dtype == torch.int64
    out = []
    for finite in STEPS:
        state = dynamic_update(state, torch.tensor(finite), rule)
        out.append((state.loss_scale.item(), state.good_steps.item(), state.nonfinite_steps.item()))
    assert out == numpy_trajectory(rule, 10)


def test_torch_all_finite() -> None:
    torch = pytest.importorskip("torch")
    ok = all_finite([torch.ones(2, dtype=torch.float16), None])
    assert isinstance(ok, torch.Tensor)
    assert ok.dtype == torch.bool
    assert bool(ok)
    assert not bool(all_finite({"a": torch.ones(2), "b": torch.tensor([float("nan")])}))


def test_jax_dynamic_update_under_jit_matches_numpy() -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    rule = dynamic_rule(increment_period=2, multiplier=3, hysteresis=2)

    @jax.jit
    def step(state: DynamicState, grads: list[object]) -> DynamicState:
        return dynamic_update(state, all_finite(grads), rule)

    state = dynamic_state(10, rule, like=jnp.zeros(()))
    out = []
    for finite in STEPS:
        grads = [jnp.ones(3, jnp.float16), jnp.array([1.0 if finite else jnp.nan])]
        state = step(state, grads)
        assert isinstance(state.loss_scale, jax.Array)
        assert state.loss_scale.dtype == jnp.float32
        out.append((float(state.loss_scale), int(state.good_steps), int(state.nonfinite_steps)))
    assert out == numpy_trajectory(rule, 10)


def test_jax_dynamic_state_under_jit() -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    rule = dynamic_rule(increment_period=1)

    @jax.jit
    def fresh_then_step(g: object) -> DynamicState:
        state = dynamic_state(8.0, rule, like=g)
        return dynamic_update(state, all_finite([g]), rule)

    assert float(fresh_then_step(jnp.ones(2)).loss_scale) == 16.0
    assert float(fresh_then_step(jnp.array([jnp.inf])).loss_scale) == 4.0


@pytest.mark.parametrize(
    ("initial", "multiplier", "expected"),
    [
        (10.0, 3.0, 3.3333332538604736),
        (7.0, 1.5, 4.666666507720947),
        (10.0, 1.1, 9.090909004211426),
    ],
)
def test_jax_jit_back_off_is_a_correctly_rounded_division(
    initial: float, multiplier: float, expected: float
) -> None:
    # XLA turns x / constant into x * (1 / constant) unless prevented: 10 / 3 would be 3.3333335
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    rule = dynamic_rule(increment_period=1, multiplier=multiplier)
    assert expected == float(F32(initial) / F32(multiplier))
    step = jax.jit(lambda state, finite: dynamic_update(state, finite, rule))
    state = step(dynamic_state(initial, rule, like=jnp.zeros(())), jnp.asarray(False))
    assert float(state.loss_scale) == expected
    assert float(step(state, jnp.asarray(True)).loss_scale) == float(
        F32(expected) * F32(multiplier)
    )


# -- backoff_factor: torch.amp.GradScaler's separate back-off factor ------------------------


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (0, ValueError, "backoff_factor must be > 0 and < 1, got 0"),
        (1, ValueError, "backoff_factor must be > 0 and < 1, got 1"),
        (-0.5, ValueError, "backoff_factor.*-0.5"),
        (float("nan"), ValueError, "backoff_factor.*nan"),
        (1e-50, ValueError, "backoff_factor=1e-50 rounds to 0.0 in float32"),
        (1 - 1e-9, ValueError, "rounds to 1.0 in float32"),
        ("0.5", TypeError, "backoff_factor.*'0.5'"),
        (True, TypeError, "backoff_factor.*True"),
    ],
)
def test_rule_rejects_backoff_factor(value: object, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        dynamic_rule(backoff_factor=value)


def test_rule_names_arguments_by_the_front_ends_names() -> None:
    names = {"multiplier": "growth_factor", "increment_period": "growth_interval"}
    with pytest.raises(ValueError, match=r"growth_factor must be finite and > 1, got 0\.5"):
        dynamic_rule(multiplier=0.5, names=names)
    with pytest.raises(TypeError, match="growth_interval must be an integer"):
        dynamic_rule(increment_period=2.0, names=names)
    with pytest.raises(ValueError, match="factor_down must be > 0"):
        dynamic_rule(backoff_factor=2.0, names={"backoff_factor": "factor_down"})


def test_backoff_factor_multiplies_instead_of_dividing() -> None:
    # TF divides by the multiplier; with backoff_factor the scale is multiplied by it
    third = F32(80) / F32(3)
    assert scales([False, False], 80.0, multiplier=3) == [float(third), float(third / F32(3))]
    assert scales([False, False], 80.0, multiplier=3, backoff_factor=0.25) == [20.0, 5.0]
    # growth still multiplies by the multiplier; the floor and hysteresis still apply
    assert scales([True, True, False], 8.0, increment_period=1, backoff_factor=0.125) == [
        16.0,
        32.0,
        4.0,
    ]
    assert scales([False, False], 8.0, backoff_factor=0.125, hysteresis=2) == [8.0, 1.0]


def test_backoff_factor_half_equals_tensorflow_division() -> None:
    rng = np.random.default_rng(0)
    steps = [bool(b) for b in rng.random(400) < 0.8]
    tf_form = run(steps, 2.0**16, increment_period=3, min_loss_scale=2.0**-100)
    torch_form = run(
        steps, 2.0**16, increment_period=3, min_loss_scale=2.0**-100, backoff_factor=0.5
    )
    assert tf_form == torch_form


@pytest.mark.parametrize(
    ("growth", "backoff"), [(2.0, 0.5), (1.5, 0.75), (4.0, 0.125), (3.0, 0.25)]
)
def test_backoff_factor_matches_torch_amp_update_scale(growth: float, backoff: float) -> None:
    # torch.amp.GradScaler's own kernel, with min_loss_scale far below any scale reached
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(int(growth * 100 + backoff * 1000))
    steps = [bool(b) for b in rng.random(600) < 0.85]
    rule = dynamic_rule(3, growth, min_loss_scale=2.0**-120, backoff_factor=backoff)
    state = dynamic_state(2.0**16, rule)
    scale, tracker = torch.tensor([2.0**16]), torch.zeros((), dtype=torch.int32)
    for finite in steps:
        state = dynamic_update(state, np.asarray(finite), rule)
        torch._amp_update_scale_(
            scale, tracker, torch.tensor([0.0 if finite else 1.0]), growth, backoff, 3
        )
        assert float(state.loss_scale) == scale.item()
        assert int(state.good_steps) == tracker.item()
