"""Property tests of the dynamic loss scale (no TensorFlow needed).

* the scale never becomes 0, NaN or inf, even after 10**4 consecutive overflows or growths;
* it stays within ``[min(initial, min_loss_scale), max_loss_scale]``;
* a ``state_dict()`` round trip mid-run (also through pickle and JSON) continues identically;
* hysteresis follows clarification C1, checked against an independent reference model;
* NumPy, torch and JAX gradients give the same trajectory, and the state then lives in the
  gradients' library (clarification C5).
"""

from __future__ import annotations

import json
import math
import pickle
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lossscale
from lossscale.core import DynamicState, dynamic_rule, dynamic_state, dynamic_update

F32_MAX = float(np.finfo(np.float32).max)
F32_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)  # 2**-126
F32_SMALLEST_SUBNORMAL = float(np.finfo(np.float32).smallest_subnormal)  # 2**-149
LONG = 10**4


def f32(x: float) -> np.float32:
    with np.errstate(over="ignore"):
        return np.float32(x)


def bits(x: Any) -> int:
    """float32 bit pattern of a 0-d float32 array or scalar (asserting the dtype)."""
    arr = np.asarray(x)
    assert arr.dtype == np.float32, arr.dtype
    assert arr.shape == (), arr.shape
    return int(arr.view(np.uint32))


# --------------------------------------------------------------------------------------------
# configurations
# --------------------------------------------------------------------------------------------
class Config(NamedTuple):
    initial_loss_scale: float
    increment_period: int
    multiplier: float
    min_loss_scale: float
    max_loss_scale: float
    hysteresis: int

    def make(self) -> lossscale.DynamicLossScale:
        return lossscale.DynamicLossScale(
            self.initial_loss_scale,
            self.increment_period,
            self.multiplier,
            min_loss_scale=self.min_loss_scale,
            max_loss_scale=self.max_loss_scale,
            hysteresis=self.hysteresis,
        )

    def rule(self) -> Any:
        return dynamic_rule(
            self.increment_period,
            self.multiplier,
            min_loss_scale=self.min_loss_scale,
            max_loss_scale=self.max_loss_scale,
            hysteresis=self.hysteresis,
        )

    def bounds(self) -> tuple[np.float32, np.float32]:
        """Where the scale must stay: [min(initial, min_loss_scale), max_loss_scale] in float32."""
        low = min(f32(self.initial_loss_scale), f32(self.min_loss_scale))
        return low, f32(self.max_loss_scale)


MULTIPLIERS = [2.0, 3.0, 1.5, 10 / 3, 1.0001, 1.1, 4.0, 2, 1e3, 2.0**64]
MIN_SCALES = [1.0, 0.5, 1e-3, 2.0**-20, 1e-30, 4.0, 1e3]
MAX_SCALES = [F32_MAX, 2.0**24, 2.0**40, 1e30, 3e38]
INITIAL_SCALES = [2.0**15, 10.0, 0.1, 1e-3, 0.5, 1.0, 3e38, 2.0**127, F32_MAX]


@st.composite
def configs(
    draw: st.DrawFn,
    periods: st.SearchStrategy[int] | None = None,
    hystereses: st.SearchStrategy[int] | None = None,
) -> Config:
    """Valid configurations, min_loss_scale < 1 and custom max_loss_scale included.

    Every scale is a normal float32 (at least 2**-126): subnormal ones are rejected, since
    TensorFlow and XLA flush them to zero (test_subnormal_config_is_rejected_or_same_on_jax).
    """
    tiny = F32_SMALLEST_NORMAL
    low = draw(st.sampled_from(MIN_SCALES) | st.floats(min_value=tiny, max_value=1e6))
    high = draw(
        st.sampled_from([h for h in MAX_SCALES if h >= low] + [low])
        | st.floats(min_value=low, max_value=F32_MAX)
    )
    initial = draw(
        st.sampled_from([x for x in INITIAL_SCALES if x <= high] + [low, high])
        | st.floats(min_value=tiny, max_value=high)
    )
    return Config(
        initial_loss_scale=initial,
        increment_period=draw(st.integers(1, 5) if periods is None else periods),
        multiplier=draw(st.sampled_from(MULTIPLIERS) | st.floats(min_value=1.0001, max_value=1e6)),
        min_loss_scale=low,
        max_loss_scale=high,
        hysteresis=draw(st.integers(1, 5) if hystereses is None else hystereses),
    )


def sequences(element: st.SearchStrategy[Any], max_size: int = 60) -> st.SearchStrategy[list[Any]]:
    """Lists of any length up to ``max_size``, uniformly (``st.lists`` favours short ones)."""
    return st.integers(0, max_size).flatmap(lambda n: st.lists(element, min_size=n, max_size=n))


# Mostly finite, so that growth (increment_period consecutive finite steps) happens.
finiteness = st.sampled_from([True, True, True, False])


def grads_for(finite: bool) -> list[Any]:
    return [np.array([1.0, 2.0 if finite else math.nan], np.float32), None]


# --------------------------------------------------------------------------------------------
# an independent reference model of the rule, written from the spec (tf_semantics §3.3 + C1)
# --------------------------------------------------------------------------------------------
class Reference:
    """The dynamic loss scale, in plain Python with NumPy float32 scalars.

    * A finite step extends the run of consecutive finite steps; when the run reaches
      ``increment_period`` the scale is multiplied (kept if the product is inf or above
      ``max_loss_scale``), the run restarts, and the hysteresis allowance refills.
    * A non-finite step ends the run; it is the k-th non-finite step since the last back-off
      or growth; on the ``hysteresis``-th the scale becomes max(scale / multiplier,
      min_loss_scale) and the count restarts.
    * ``should_apply`` is the step's finiteness.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.scale = f32(config.initial_loss_scale)
        self.run = 0  # consecutive finite steps (TF's good_steps)
        self.strikes = 0  # non-finite steps since the last back-off or growth

    def step(self, finite: bool) -> bool:
        c = self.config
        if finite:
            self.run += 1
            if self.run == c.increment_period:
                with np.errstate(over="ignore"):
                    bigger = self.scale * f32(c.multiplier)
                if math.isfinite(bigger) and bigger <= f32(c.max_loss_scale):
                    self.scale = bigger
                self.run = 0
                self.strikes = 0
        else:
            self.run = 0
            self.strikes += 1
            if self.strikes == c.hysteresis:
                smaller = np.float32(self.scale / f32(c.multiplier))
                self.scale = max(smaller, f32(c.min_loss_scale))
                self.strikes = 0
        assert type(self.scale) is np.float32
        return finite

    def snapshot(self) -> tuple[int, int, int]:
        return bits(self.scale), self.run, self.strikes


def snapshot(ls: lossscale.DynamicLossScale) -> tuple[int, int, int]:
    state = ls.state_dict()
    return (
        bits(np.float32(state["current_loss_scale"])),
        state["num_good_steps"],
        state["num_nonfinite_steps"],
    )


def pure_snapshot(state: DynamicState) -> tuple[int, int, int]:
    return bits(state.loss_scale), int(state.good_steps), int(state.nonfinite_steps)


# --------------------------------------------------------------------------------------------
# 10**4 overflows / growths: never 0, NaN or inf
# --------------------------------------------------------------------------------------------
def long_reference(config: Config, finite: bool) -> np.ndarray:
    ref = Reference(config)
    out = np.empty(LONG, np.float32)
    for i in range(LONG):
        ref.step(finite)
        out[i] = ref.scale
    return out


def assert_healthy(trajectory: np.ndarray, config: Config, finite: bool) -> None:
    assert trajectory.dtype == np.float32
    assert np.all(np.isfinite(trajectory)), (
        f"non-finite scale {trajectory[~np.isfinite(trajectory)][:3]}"
    )
    assert np.all(trajectory > 0), f"scale reached {trajectory.min()!r} with {config}"
    low, high = config.bounds()
    assert np.all(trajectory >= low) and np.all(trajectory <= high), (
        trajectory.min(),
        trajectory.max(),
        config,
    )
    start = f32(config.initial_loss_scale)
    steps = np.diff(np.concatenate([[start], trajectory]))
    if finite:  # growths only: never down
        assert np.all(steps >= 0)
    elif start >= f32(config.min_loss_scale):  # back-offs only: never up
        assert np.all(steps <= 0)
    expected = long_reference(config, finite)
    mismatch = np.flatnonzero(trajectory.view(np.uint32) != expected.view(np.uint32))
    assert mismatch.size == 0, (
        f"step {mismatch[0]}: {trajectory[mismatch[0]]!r} != reference "
        f"{expected[mismatch[0]]!r} ({config})"
    )


LONG_CONFIG_EXAMPLES = [
    Config(2.0**15, 1, 2.0, 1.0, F32_MAX, 1),  # TensorFlow's rule
    Config(3e38, 1, 1.0001, 0.25, F32_MAX, 3),
    Config(1e-3, 1, 10 / 3, 1e-3, 2.0**24, 2),
    Config(F32_SMALLEST_NORMAL, 1, 3.0, F32_SMALLEST_NORMAL, 1e30, 5),
]


@pytest.mark.parametrize("finite", [False, True], ids=["overflows", "growths"])
# 10**4 NumPy steps take about a second: one explicit extreme config and one random one.
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(config=LONG_CONFIG_EXAMPLES[3])
@given(config=configs(periods=st.just(1)))
def test_pure_rule_never_degenerate_after_1e4_steps(config: Config, finite: bool) -> None:
    rule = config.rule()
    state = dynamic_state(config.initial_loss_scale, rule)
    flag = np.asarray(finite)
    trajectory = np.empty(LONG, np.float32)
    for i in range(LONG):
        state = dynamic_update(state, flag, rule)
        trajectory[i] = state.loss_scale
    assert int(state.good_steps) == 0
    assert 0 <= int(state.nonfinite_steps) < config.hysteresis
    assert_healthy(trajectory, config, finite)


@pytest.mark.parametrize(
    ("config", "finite"),
    [(LONG_CONFIG_EXAMPLES[1], False), (LONG_CONFIG_EXAMPLES[2], True)],
    ids=["overflows-hysteresis3-min0.25", "growths-custom-max"],
)
def test_stateful_never_degenerate_after_1e4_steps(config: Config, finite: bool) -> None:
    ls = config.make()
    grads = grads_for(finite)
    trajectory = np.empty(LONG, np.float32)
    for i in range(LONG):
        _, should_apply = ls.update(grads)
        trajectory[i] = ls()
    assert bool(should_apply) is finite
    assert ls.num_good_steps == 0
    assert_healthy(trajectory, config, finite)


# --------------------------------------------------------------------------------------------
# bounds and the reference model on random sequences
# --------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(config=configs(), finite=sequences(finiteness, 80))
def test_scale_within_bounds(config: Config, finite: list[bool]) -> None:
    ls = config.make()
    low, high = config.bounds()
    for i, ok in enumerate(finite):
        _, should_apply = ls.update(grads_for(ok))
        scale = ls()
        assert low <= scale <= high, (i, float(scale), float(low), float(high), config)
        assert math.isfinite(scale) and scale > 0
        assert bool(should_apply) is ok


@settings(max_examples=80, deadline=None)
@given(
    config=configs(periods=st.integers(1, 6), hystereses=st.integers(1, 6)),
    finite=sequences(st.sampled_from([True, False]), 80),
)
def test_stateful_and_pure_rule_match_reference_model(config: Config, finite: list[bool]) -> None:
    ls, ref = config.make(), Reference(config)
    rule = config.rule()
    state = dynamic_state(config.initial_loss_scale, rule)
    assert snapshot(ls) == ref.snapshot() == pure_snapshot(state)
    for i, ok in enumerate(finite):
        _, should_apply = ls.update(grads_for(ok))
        state = dynamic_update(state, np.asarray(ok), rule)
        expected_apply = ref.step(ok)
        assert bool(should_apply) is expected_apply, (i, ok)
        assert snapshot(ls) == ref.snapshot(), (i, finite[: i + 1], ls, float(ref.scale))
        assert pure_snapshot(state) == ref.snapshot(), (i, finite[: i + 1])
        assert ls.num_good_steps == ref.run


# --------------------------------------------------------------------------------------------
# hysteresis (clarification C1)
# --------------------------------------------------------------------------------------------
def run(ls: lossscale.DynamicLossScale, pattern: str) -> list[tuple[bool, float]]:
    """Feed 'T'/'F' steps; return (should_apply, scale) after each."""
    out = []
    for c in pattern:
        _, should_apply = ls.update(grads_for(c == "T"))
        out.append((bool(should_apply), float(ls())))
    return out


def test_hysteresis_backs_off_on_the_nth_nonfinite_step() -> None:
    ls = lossscale.DynamicLossScale(64.0, 100, 2.0, hysteresis=3)
    assert run(ls, "FFF") == [(False, 64.0), (False, 64.0), (False, 32.0)]
    # the count restarts after a back-off
    assert run(ls, "FFF") == [(False, 32.0), (False, 32.0), (False, 16.0)]


def test_hysteresis_one_is_tensorflow() -> None:
    ls = lossscale.DynamicLossScale(64.0, 100, 2.0)
    assert run(ls, "FF") == [(False, 32.0), (False, 16.0)]


def test_hysteresis_finite_steps_short_of_a_period_do_not_refill() -> None:
    ls = lossscale.DynamicLossScale(64.0, 4, 2.0, hysteresis=3)
    assert run(ls, "FTTFTTTF") == [
        (False, 64.0),
        (True, 64.0),
        (True, 64.0),
        (False, 64.0),
        (True, 64.0),
        (True, 64.0),
        (True, 64.0),
        (False, 32.0),  # the 3rd non-finite step since the start, finite steps in between
    ]


def test_hysteresis_refills_when_a_period_completes() -> None:
    ls = lossscale.DynamicLossScale(64.0, 2, 2.0, hysteresis=3)
    assert run(ls, "FFTT") == [(False, 64.0), (False, 64.0), (True, 64.0), (True, 128.0)]
    assert ls.state_dict()["num_nonfinite_steps"] == 0
    assert run(ls, "FFF") == [(False, 128.0), (False, 128.0), (False, 64.0)]


def test_hysteresis_refills_when_growth_is_refused_at_the_maximum() -> None:
    ls = lossscale.DynamicLossScale(64.0, 1, 2.0, max_loss_scale=64.0, hysteresis=2)
    assert run(ls, "FTF") == [(False, 64.0), (True, 64.0), (False, 64.0)]
    assert run(ls, "F") == [(False, 32.0)]


@settings(max_examples=60, deadline=None)
@given(
    hysteresis=st.integers(1, 8),
    period=st.integers(1, 8),
    finite=sequences(st.sampled_from([True, False, False]), 80),
)
def test_hysteresis_backs_off_exactly_on_the_nth_strike(
    hysteresis: int, period: int, finite: list[bool]
) -> None:
    """Scale changes are explained only by the C1 counting, in words rather than a model."""
    ls = lossscale.DynamicLossScale(
        2.0**20, period, 2.0, min_loss_scale=1e-30, hysteresis=hysteresis
    )
    strikes, run_length, scale = 0, 0, 2.0**20
    for i, ok in enumerate(finite):
        _, should_apply = ls.update(grads_for(ok))
        new = float(ls())
        assert bool(should_apply) is ok, "every non-finite step is skipped"
        if ok:
            run_length += 1
            if run_length == period:
                assert new == scale * 2, (i, "growth on the period-th finite step")
                run_length, strikes = 0, 0
            else:
                assert new == scale, (i, "no change on a finite step short of a period")
        else:
            run_length = 0
            strikes += 1
            if strikes == hysteresis:
                assert new == scale / 2, (i, f"back-off on non-finite step no. {hysteresis}")
                strikes = 0
            else:
                assert new == scale, (i, f"no back-off on non-finite step no. {strikes}")
        scale = new


# --------------------------------------------------------------------------------------------
# state_dict round trip
# --------------------------------------------------------------------------------------------
def through_pickle(state: dict[str, Any]) -> dict[str, Any]:
    return pickle.loads(pickle.dumps(state))


def through_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


@settings(max_examples=60, deadline=None)
@given(config=configs(), finite=sequences(finiteness, 60), data=st.data())
def test_state_dict_round_trip_mid_run_continues_identically(
    config: Config, finite: list[bool], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(finite)), label="cut")
    original = config.make()
    for ok in finite[:cut]:
        original.update(grads_for(ok))
    saved = original.state_dict()
    assert type(saved["current_loss_scale"]) is float
    assert type(saved["num_good_steps"]) is int and type(saved["num_nonfinite_steps"]) is int
    assert type(saved["version"]) is int and type(saved["class_name"]) is str
    copies = {}
    for name, transport in [("dict", dict), ("pickle", through_pickle), ("json", through_json)]:
        fresh = config.make()  # a fresh object: no update before the load
        fresh.load_state_dict(transport(saved))
        assert fresh.state_dict() == saved, name
        assert bits(fresh()) == bits(original()), name
        assert fresh.num_good_steps == original.num_good_steps, name
        copies[name] = fresh
    for i, ok in enumerate(finite[cut:], start=cut):
        _, should_apply = original.update(grads_for(ok))
        for name, fresh in copies.items():
            _, fresh_apply = fresh.update(grads_for(ok))
            assert bool(fresh_apply) is bool(should_apply), (name, i)
            assert snapshot(fresh) == snapshot(original), (name, i, fresh, original)
            assert bits(fresh()) == bits(original()), (name, i)
            assert fresh.num_good_steps == original.num_good_steps, (name, i)


def test_state_dict_round_trip_preserves_hysteresis_count() -> None:
    """A state saved between two non-finite steps keeps the pending strike."""
    config = Config(64.0, 3, 2.0, 1.0, F32_MAX, 2)
    original = config.make()
    run(original, "TTF")
    fresh = config.make()
    fresh.load_state_dict(through_json(original.state_dict()))
    assert run(fresh, "F") == run(original, "F") == [(False, 32.0)]


# --------------------------------------------------------------------------------------------
# NumPy, torch and JAX give the same trajectory; the state moves to the gradients' library
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="torch is an optional extra")


@pytest.fixture(scope="module")
def jax() -> Any:
    return pytest.importorskip("jax", reason="jax is an optional extra")


ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 gradients need ml_dtypes")
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
NONFINITE = [math.nan, math.inf, -math.inf]


@st.composite
def mixed_steps(draw: st.DrawFn) -> Any:
    """One step: nested list/tuple/dict of float arrays (float16 to float64), Python floats
    and None; NaN/+inf/-inf at a random place; or an empty structure."""
    mode = draw(st.sampled_from(["finite"] * 4 + ["nonfinite"] * 2 + ["empty"]))
    if mode == "empty":
        return draw(st.sampled_from([[], {}, (), None, [None], {"a": [None, ()]}]))
    items: list[Any] = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 4)) == 0:
            items.append(draw(st.sampled_from([0.5, -2.0])))
            continue
        dtype = draw(st.sampled_from(DTYPES))
        size = draw(st.integers(0, 4))
        # Values exactly representable in every dtype, so the conversions are exact.
        values = draw(
            st.lists(st.sampled_from([0.0, 1.0, -1.5, 0.25, 1024.0]), min_size=size, max_size=size)
        )
        items.append(np.asarray(values, np.float64).astype(dtype))
    if mode == "nonfinite":
        i = draw(st.integers(0, len(items) - 1))
        bad = draw(st.sampled_from(NONFINITE))
        if isinstance(items[i], float) or items[i].size == 0:
            items[i] = bad
        else:
            arr = items[i].copy()
            arr[draw(st.integers(0, arr.size - 1))] = bad
            items[i] = arr
    items = draw(st.permutations([*items, None]))
    layout = draw(st.sampled_from(["list", "tuple", "dict"]))
    if layout == "tuple":
        return tuple(items)
    if layout == "dict":
        return {"layer": {f"w{i}": g for i, g in enumerate(items)}}
    return items


def convert(grads: Any, leaf: Any) -> Any:
    if grads is None or isinstance(grads, float):
        return grads
    if isinstance(grads, dict):
        return {k: convert(g, leaf) for k, g in grads.items()}
    if isinstance(grads, list | tuple):
        return type(grads)(convert(g, leaf) for g in grads)
    return leaf(grads)


def has_array(grads: Any) -> bool:
    if isinstance(grads, dict):
        return any(has_array(g) for g in grads.values())
    if isinstance(grads, list | tuple):
        return any(has_array(g) for g in grads)
    return isinstance(grads, np.ndarray)


def torch_leaf(torch: Any) -> Any:
    def leaf(arr: np.ndarray) -> Any:
        if arr.dtype == ml_dtypes.bfloat16:  # torch cannot read ml_dtypes arrays: go via float32
            return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(arr.copy())

    return leaf


def jax_leaf(jax: Any) -> Any:
    def leaf(arr: np.ndarray) -> Any:
        if arr.dtype == np.float64 and not jax.config.jax_enable_x64:
            arr = arr.astype(np.float32)  # what JAX does anyway without x64 (same values here)
        out = jax.numpy.asarray(arr)
        assert out.dtype == arr.dtype
        return out

    return leaf


def assert_library(
    ls: lossscale.DynamicLossScale, should_apply: Any, library: str, torch: Any, jax: Any
) -> None:
    """Clarification C5: ls() and should_apply are 0-d arrays of the state's library."""
    scale = ls()
    if library == "numpy":
        assert isinstance(scale, np.ndarray) and isinstance(should_apply, np.ndarray)
        assert scale.dtype == np.float32 and should_apply.dtype == np.bool_
        assert scale.shape == () and should_apply.shape == ()
    elif library == "torch":
        assert isinstance(scale, torch.Tensor) and isinstance(should_apply, torch.Tensor)
        assert scale.dtype == torch.float32 and should_apply.dtype == torch.bool
        assert scale.dim() == 0 and should_apply.dim() == 0
        assert scale.device.type == "cpu" and should_apply.device.type == "cpu"
    else:
        assert isinstance(scale, jax.Array) and isinstance(should_apply, jax.Array)
        assert scale.dtype == np.float32 and should_apply.dtype == np.bool_
        assert scale.shape == () and should_apply.shape == ()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), steps=sequences(mixed_steps(), 25))
def test_numpy_torch_jax_same_trajectory(
    torch: Any, jax: Any, config: Config, steps: list[Any]
) -> None:
    leaves = {"numpy": lambda a: a, "torch": torch_leaf(torch), "jax": jax_leaf(jax)}
    objects = {name: config.make() for name in leaves}
    seen_array = False
    for i, grads in enumerate(steps):
        seen_array = seen_array or has_array(grads)
        results = {}
        for name, leaf in leaves.items():
            ls = objects[name]
            op, should_apply = ls.update(convert(grads, leaf))
            assert op is None
            results[name] = (
                bool(should_apply),
                snapshot(ls),
                bits(np.asarray(ls().tolist(), np.float32)),
                ls.num_good_steps,
            )
            if seen_array:
                assert_library(ls, should_apply, name, torch, jax)
        assert results["torch"] == results["numpy"], (i, grads, results)
        assert results["jax"] == results["numpy"], (i, grads, results)


def test_state_moves_to_torch_and_jax_on_first_update(torch: Any, jax: Any) -> None:
    for name, grads in [
        ("torch", [torch.tensor([1.0, float("nan")])]),
        ("jax", [jax.numpy.array([1.0, float("nan")])]),
    ]:
        ls = lossscale.DynamicLossScale(8.0, 2, 2.0)
        assert isinstance(ls(), np.ndarray)
        _, should_apply = ls.update(grads)
        assert_library(ls, should_apply, name, torch, jax)
        assert not bool(should_apply) and float(ls()) == 4.0
        _, should_apply = ls.update([])  # an empty step keeps the state where it lives
        assert_library(ls, should_apply, name, torch, jax)
        assert bool(should_apply) and ls.num_good_steps == 1


# --------------------------------------------------------------------------------------------
# JAX: the rule under jit, 10**4 steps; float32 subnormals (XLA flushes them to zero)
# --------------------------------------------------------------------------------------------
def jax_trajectory(jax: Any, config: Config, finite: bool, steps: int = LONG) -> np.ndarray:
    jnp = jax.numpy
    rule = config.rule()
    state = dynamic_state(config.initial_loss_scale, rule, like=jnp.zeros((), jnp.float32))

    def body(carry: DynamicState, ok: Any) -> tuple[DynamicState, Any]:
        new = dynamic_update(carry, ok, rule)
        return new, new.loss_scale

    _, scales = jax.jit(lambda s, xs: jax.lax.scan(body, s, xs))(
        state, jnp.full((steps,), finite, dtype=bool)
    )
    return np.asarray(scales)


@pytest.mark.parametrize("finite", [False, True], ids=["overflows", "growths"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(config=LONG_CONFIG_EXAMPLES[0])
@example(config=LONG_CONFIG_EXAMPLES[1])
@given(config=configs(periods=st.just(1)))
def test_jax_jit_never_degenerate_after_1e4_steps(jax: Any, config: Config, finite: bool) -> None:
    assert_healthy(jax_trajectory(jax, config, finite), config, finite)


@pytest.mark.parametrize(
    ("initial", "multiplier", "finite", "expected"),
    [
        (10.0, 3.0, [False, True], [3.3333332538604736, 10.0]),  # tf_semantics §3.3
        (7.0, 1.5, [False], [4.666666507720947]),
        (0.1, 3.0, [True, True], [0.30000001192092896, 0.9000000357627869]),
        (
            3e38,
            1.0001,
            [False] * 3,
            [2.9997000286597177e38, 2.9994000518216797e38, 2.9991000749836417e38],
        ),
    ],
)
def test_jax_jit_is_bit_exact(
    jax: Any, initial: float, multiplier: float, finite: list[bool], expected: list[float]
) -> None:
    """The pure rule under jax.jit gives NumPy's (and TF's) float32 results, bit for bit.

    XLA may rewrite a division by a constant into a multiplication by its reciprocal, which
    is not exact for multipliers that are not powers of two.
    """
    jnp = jax.numpy
    rule = dynamic_rule(1, multiplier)
    step = jax.jit(lambda state, ok: dynamic_update(state, ok, rule))
    jitted = dynamic_state(initial, rule, like=jnp.zeros((), jnp.float32))
    eager = jitted
    for i, (ok, want) in enumerate(zip(finite, expected, strict=True)):
        jitted = step(jitted, jnp.asarray(ok))
        eager = dynamic_update(eager, jnp.asarray(ok), rule)
        assert bits(np.asarray(eager.loss_scale)) == bits(f32(want)), (i, eager.loss_scale)
        assert bits(np.asarray(jitted.loss_scale)) == bits(f32(want)), (
            f"step {i}: jit gives {float(jitted.loss_scale)!r}, expected {want!r} "
            f"(eager {float(eager.loss_scale)!r})"
        )


@pytest.mark.parametrize(
    "config",
    [
        Config(1e-38, 1, 2.0, 1e-40, F32_MAX, 1),  # min_loss_scale subnormal
        Config(1e-40, 1, 3.0, 1.0, F32_MAX, 1),  # initial_loss_scale subnormal
        Config(F32_SMALLEST_SUBNORMAL, 1, 2.0, F32_SMALLEST_SUBNORMAL, F32_MAX, 1),
    ],
    ids=["min-subnormal", "initial-subnormal", "both-smallest"],
)
@pytest.mark.parametrize("finite", [False, True], ids=["overflows", "growths"])
def test_subnormal_config_is_rejected_or_same_on_jax(
    jax: Any, config: Config, finite: bool
) -> None:
    """Float32-subnormal scales: XLA on CPU flushes subnormals to zero (NumPy does not).

    Either such a config is rejected at construction (ValueError), or the JAX trajectory
    (eager and under jit) must equal NumPy's and never reach 0.
    """
    try:
        numpy_ls = config.make()
    except ValueError:
        return
    steps = 50
    numpy_scales = []
    jax_ls = config.make()
    jax_scales = []
    grads = grads_for(finite)
    jax_grads = [jax.numpy.asarray(grads[0]), None]
    for _ in range(steps):
        numpy_ls.update(grads)
        jax_ls.update(jax_grads)
        numpy_scales.append(np.asarray(numpy_ls()))
        jax_scales.append(np.asarray(jax_ls()))
    expected = np.array(numpy_scales, np.float32)
    assert np.all(expected > 0)
    eager = np.array(jax_scales, np.float32)
    assert np.all(eager > 0), f"eager JAX scale reached 0: {eager[:6]} (NumPy {expected[:6]})"
    np.testing.assert_array_equal(eager.view(np.uint32), expected.view(np.uint32))
    jitted = jax_trajectory(jax, config, finite, steps)
    np.testing.assert_array_equal(jitted.view(np.uint32), expected.view(np.uint32))
