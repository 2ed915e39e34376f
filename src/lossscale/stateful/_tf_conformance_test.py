"""Conformance of the stateful classes against TensorFlow 2.21, used as an oracle.

Every test here runs the same inputs through ``lossscale`` and through
``tf.compat.v1.mixed_precision.{DynamicLossScale,FixedLossScale}`` (eager) and compares the
results: the scale bit for bit (float32 bit patterns), the good-steps counter and
``should_apply`` after every step, and the config dicts. The spec is
``shared/reference/tf_semantics.md`` §2-3.

TensorFlow is an optional test dependency: CI installs ``tensorflow-cpu``; without it the whole
module is skipped with a reason saying so.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lossscale

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ start-up chatter
tf = pytest.importorskip(
    "tensorflow",
    reason=(
        "TensorFlow is the oracle of these conformance tests: install tensorflow-cpu "
        "(pip install tensorflow-cpu; CI does) to run them"
    ),
)
ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 gradients need ml_dtypes")

pytestmark = pytest.mark.tf

TFDynamic = tf.compat.v1.mixed_precision.DynamicLossScale
TFFixed = tf.compat.v1.mixed_precision.FixedLossScale

F32_MAX = float(np.finfo(np.float32).max)
F32_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)  # 2**-126
NONFINITE = (math.nan, math.inf, -math.inf)

tf.get_logger().setLevel("ERROR")  # the deprecation notices of the v1 loss-scale classes


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def bits(x: Any) -> int:
    """The float32 bit pattern of a 0-d float32 value (asserting it *is* float32)."""
    arr = np.asarray(x)
    assert arr.dtype == np.float32, f"expected a float32 scale, got {arr.dtype}"
    assert arr.shape == (), f"expected a 0-d scale, got shape {arr.shape}"
    return int(arr.view(np.uint32))


def f32(x: float) -> np.float32:
    with np.errstate(over="ignore"):
        return np.float32(x)


def tf_counter(tf_ls: Any) -> int:
    # ``_num_good_steps`` is the int64 variable checkpointed as ``good_steps``
    # (tensorflow/python/training/experimental/loss_scale.py).
    return int(tf_ls._num_good_steps.numpy())


def to_tf(grads: Any) -> Any:
    """The same gradient structure with every NumPy leaf replaced by a TF tensor of its dtype."""
    if grads is None or type(grads) is float:  # Python floats: TF converts them to float32
        return grads
    if isinstance(grads, dict):
        return {k: to_tf(g) for k, g in grads.items()}
    if isinstance(grads, list):
        return [to_tf(g) for g in grads]
    if isinstance(grads, tuple):
        return tuple(to_tf(g) for g in grads)
    arr = np.asarray(grads)
    out = tf.constant(arr)
    assert out.dtype.as_numpy_dtype == arr.dtype, (out.dtype, arr.dtype)
    return out


def assert_same_state(ls: lossscale.DynamicLossScale, tf_ls: Any, context: str) -> None:
    ours, theirs = ls(), tf_ls().numpy()
    assert bits(ours) == bits(theirs), (
        f"{context}: scale {float(ours)!r} (bits {bits(ours):#010x}) != TF "
        f"{float(theirs)!r} (bits {bits(theirs):#010x})"
    )
    assert ls.num_good_steps == tf_counter(tf_ls), (
        f"{context}: num_good_steps {ls.num_good_steps} != TF {tf_counter(tf_ls)}"
    )


def step_both(ls: lossscale.DynamicLossScale, tf_ls: Any, grads: Any, context: str) -> bool:
    """One update on both; compare the return values and the new state. Returns should_apply."""
    op, should_apply = ls.update(grads)
    _, tf_should_apply = tf_ls.update(to_tf(grads))
    assert op is None, f"{context}: update_op is {op!r}, expected None"
    assert isinstance(should_apply, np.ndarray), type(should_apply)
    assert should_apply.shape == () and should_apply.dtype == np.bool_, should_apply
    assert bool(should_apply) == bool(tf_should_apply), (
        f"{context}: should_apply {bool(should_apply)} != TF {bool(tf_should_apply)}"
    )
    assert_same_state(ls, tf_ls, context)
    return bool(should_apply)


def run_both(
    ls: lossscale.DynamicLossScale, tf_ls: Any, steps: list[Any], label: str = ""
) -> list[bool]:
    assert_same_state(ls, tf_ls, f"{label} initial state")
    return [
        step_both(ls, tf_ls, grads, f"{label} step {i} grads={grads!r}")
        for i, grads in enumerate(steps)
    ]


def keras_serialize(tf_loss_scale: Any) -> dict[str, Any]:
    """TF's own dict format: the (legacy) Keras ``serialize``, or the same dict built by hand."""
    try:
        from tensorflow.python.keras.mixed_precision import loss_scale as keras_loss_scale
    except ImportError:  # pragma: no cover - the legacy Keras module is in TF 2.21
        return {"class_name": type(tf_loss_scale).__name__, "config": tf_loss_scale.get_config()}
    return dict(keras_loss_scale.serialize(tf_loss_scale))


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------
INITIAL_SCALES = [
    1.0,
    2.0,
    0.5,
    10.0,
    0.1,
    1e-3,
    1.5,
    7.0,
    2.0**15,
    1e-30,
    3e38,
    2.0**127,
    F32_MAX / 4,
    F32_MAX,
]
MULTIPLIERS = [2.0, 3.0, 1.5, 10 / 3, 1.0001, 1.1, 4.0, 2, 3, 1e3, 2.0**64, 1e30]

# Every float32 scale TF can produce from these is a normal number: TF flushes subnormals to 0
# (see test_subnormal_initial_scale_is_rejected_or_matches_tf), a separate known divergence.
initial_scales = st.one_of(
    st.sampled_from(INITIAL_SCALES),
    st.floats(min_value=F32_SMALLEST_NORMAL, max_value=F32_MAX),
)
multipliers = st.one_of(st.sampled_from(MULTIPLIERS), st.floats(min_value=1.0001, max_value=1e6))
periods = st.integers(min_value=1, max_value=5)

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
# Finite in every gradient dtype (3e-8 and 1e-30 underflow in float16, still finite).
SAFE_EDGES = [0.0, -0.0, 1.0, -2.5, 3e-8, 1e-30, 65504.0, -65504.0, 6e4]
# Finite in some dtypes only: judged in the gradient's own dtype (65520 rounds to float16 inf).
DTYPE_EDGES = [65520.0, 7e4, -7e4, 3.4e38, 3.5e38, 1e39, 1e300, -1e300]
EMPTY_STRUCTURES = [None, [], (), {}, [None], (None, None), {"a": None}, [[], {}], ([None], {})]


def make_array(values: list[float], dtype: Any, zero_d: bool) -> np.ndarray:
    with np.errstate(over="ignore"):
        arr = np.asarray(values, dtype=np.float64).astype(dtype)
    return arr.reshape(()) if zero_d else arr


@st.composite
def leaves(draw: st.DrawFn) -> list[Any]:
    """1-4 gradient leaves: NumPy arrays (0-d to 5 elements) of any float dtype, Python floats."""
    out: list[Any] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["array", "array", "array", "0-d", "scalar", "pyfloat"]))
        if kind == "pyfloat":
            out.append(draw(st.sampled_from([0.0, 1.5, -3.0, 1e30])))
            continue
        dtype = draw(st.sampled_from(DTYPES))
        size = 1 if kind in ("0-d", "scalar") else draw(st.integers(0, 5))
        small = st.floats(min_value=-1e3, max_value=1e3)
        values = draw(st.lists(small | st.sampled_from(SAFE_EDGES), min_size=size, max_size=size))
        arr = make_array(values, dtype, zero_d=kind != "array")
        # "scalar": a NumPy scalar (np.float64 is also a Python float, judged as float64)
        out.append(arr[()] if kind == "scalar" else arr)
    return out


def set_element(leaf: Any, position: int, value: float) -> Any:
    if type(leaf) is float:
        return value
    arr = np.array(leaf, copy=True)
    with np.errstate(over="ignore"):
        arr.reshape(-1)[position % arr.size] = value
    return arr[()] if isinstance(leaf, np.generic) else arr


@st.composite
def structure(draw: st.DrawFn, items: list[Any]) -> Any:
    """Arrange gradient leaves in a random list/tuple/dict nesting with None entries."""
    layout = draw(st.sampled_from(["list", "tuple", "dict", "nested", "single"]))
    if layout == "single" and len(items) == 1:
        return items[0]
    with_none = draw(st.permutations(items + [None] * draw(st.integers(0, 2))))
    if layout == "tuple":
        return tuple(with_none)
    if layout == "dict":
        return {f"var_{i}": g for i, g in enumerate(with_none)}
    if layout == "nested":
        half = len(with_none) // 2
        return {"dense": [*with_none[:half], None], "head": ({"kernel": tuple(with_none[half:])},)}
    return list(with_none)


@st.composite
def steps(draw: st.DrawFn) -> Any:
    """One step's gradients: mostly finite; NaN/+inf/-inf at a random place; dtype edges; empty."""
    mode = draw(st.sampled_from(["finite"] * 5 + ["nonfinite"] * 2 + ["dtype_edge", "empty"]))
    if mode == "empty":
        empty = [np.zeros([0], draw(st.sampled_from(DTYPES)))]
        return draw(st.sampled_from(EMPTY_STRUCTURES) | structure(empty))
    items = draw(leaves())
    if mode == "nonfinite":
        targets = [i for i, g in enumerate(items) if isinstance(g, float) or g.size]
        if not targets:
            items.append(0.0)
            targets = [len(items) - 1]
        i = draw(st.sampled_from(targets))
        position = draw(st.integers(0, 4))
        items[i] = set_element(items[i], position, draw(st.sampled_from(NONFINITE)))
    elif mode == "dtype_edge":
        targets = [i for i, g in enumerate(items) if not isinstance(g, float) and g.size]
        if targets:  # Python floats beyond float32 make TF raise, so arrays only
            i = draw(st.sampled_from(targets))
            position = draw(st.integers(0, 4))
            items[i] = set_element(items[i], position, draw(st.sampled_from(DTYPE_EDGES)))
    return draw(structure(items))


def sequences(element: st.SearchStrategy[Any], max_size: int = 60) -> st.SearchStrategy[list[Any]]:
    """Lists of any length up to ``max_size``, uniformly (``st.lists`` favours short ones)."""
    return st.integers(0, max_size).flatmap(lambda n: st.lists(element, min_size=n, max_size=n))


TF_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------------------------
# random trajectories
# --------------------------------------------------------------------------------------------
@TF_SETTINGS
@given(
    initial=initial_scales,
    period=periods,
    multiplier=multipliers,
    sequence=sequences(steps()),
)
def test_random_trajectories_match_tf(
    initial: float, period: int, multiplier: float, sequence: list[Any]
) -> None:
    ls = lossscale.DynamicLossScale(initial, period, multiplier)
    tf_ls = TFDynamic(initial, period, multiplier)
    run_both(ls, tf_ls, sequence, f"DynamicLossScale({initial!r}, {period}, {multiplier!r})")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial=initial_scales,
    period=periods,
    multiplier=multipliers,
    finite=sequences(st.booleans()),
)
def test_boolean_trajectories_match_tf(
    initial: float, period: int, multiplier: float, finite: list[bool]
) -> None:
    """Long runs of finite/non-finite steps (cheap grads), so growth and the limits are hit."""
    sequence = [[np.float32(1.0 if ok else math.nan)] for ok in finite]
    ls = lossscale.DynamicLossScale(initial, period, multiplier)
    tf_ls = TFDynamic(initial, period, multiplier)
    applied = run_both(ls, tf_ls, sequence, f"DynamicLossScale({initial!r}, {period}, ...)")
    assert applied == finite


def test_default_config_long_run_matches_tf() -> None:
    """The defaults (2**15, 2000, 2.0): grows on the 2000th finite step, backs off on NaN.

    TF eager updates take milliseconds, so TF runs the first and the last steps and its counter
    variable is fast-forwarded in between to the value lossscale reached on its own.
    """
    ls, tf_ls = lossscale.DynamicLossScale(), TFDynamic()
    ok = [np.ones(2, np.float32)]
    run_both(ls, tf_ls, [ok] * 10, "defaults")
    for _ in range(1989):
        ls.update(ok)
    assert float(ls()) == 2.0**15 and ls.num_good_steps == 1999
    tf_ls._num_good_steps.assign(1999)
    step_both(ls, tf_ls, ok, "2000th finite step")
    assert float(ls()) == 2.0**16 and ls.num_good_steps == 0
    step_both(ls, tf_ls, {"w": np.array([1.0, np.inf], np.float32)}, "overflow")
    assert float(ls()) == 2.0**15


# --------------------------------------------------------------------------------------------
# explicit cases of tf_semantics.md §3.3
# --------------------------------------------------------------------------------------------
OK = [np.float32(1.0)]
NAN = [np.float32(math.nan)]


@pytest.mark.parametrize(
    ("initial", "period", "multiplier", "sequence", "expected"),
    [
        # float32 arithmetic: 10 -> /3 -> 3.3333333 -> x3 -> 10.0
        (10.0, 1, 3.0, [NAN, OK], [3.3333332538604736, 10.0]),
        # 10/3/3 = 1.111111 -> x3 -> 3.333333 (not 3.3333333)
        (
            10.0,
            2,
            3.0,
            [NAN, NAN, OK, OK],
            [3.3333332538604736, 1.111111044883728, 1.111111044883728, 3.3333330154418945],
        ),
        # 0.1 -> x3 -> 0.3 -> x3 -> 0.90000004 (the float32 0.1 is 0.10000000149011612)
        (0.1, 1, 3.0, [OK, OK], [float(f32(0.1) * f32(3)), float(f32(0.1) * f32(3) * f32(3))]),
        # the floor of 1: 16 -> 8 -> 4 -> 2 -> 1 -> 1 -> 1
        (16.0, 1, 2.0, [NAN] * 6, [8.0, 4.0, 2.0, 1.0, 1.0, 1.0]),
        # 1.5 -> 1.0; 4/3 -> next shrink 1.0
        (1.5, 1, 2.0, [NAN], [1.0]),
        (4.0, 1, 3.0, [NAN, NAN], [1.3333333730697632, 1.0]),
        # C3: an initial scale below the floor is lifted to 1 by the first non-finite step ...
        (0.5, 1, 2.0, [NAN], [1.0]),
        (1e-3, 5, 2.0, [NAN, NAN], [1.0, 1.0]),
        # ... while finite steps have no floor: 0.5 grows to 1.0
        (0.5, 1, 2.0, [OK, OK], [1.0, 2.0]),
        # growth refused near the float32 maximum: 2**127 stays (counter reset)
        (2.0**127, 1, 2.0, [OK, OK], [2.0**127, 2.0**127]),
        # f32max/4 -> x2 -> x2 == exactly f32max -> stays
        (F32_MAX / 4, 1, 2.0, [OK, OK, OK], [F32_MAX / 2, F32_MAX, F32_MAX]),
        (3e38, 2, 2.0, [OK, OK, NAN], [float(f32(3e38)), float(f32(3e38)), float(f32(3e38) / 2)]),
    ],
)
def test_explicit_trajectories(
    initial: float, period: int, multiplier: float, sequence: list[Any], expected: list[float]
) -> None:
    ls, tf_ls = (
        lossscale.DynamicLossScale(initial, period, multiplier),
        TFDynamic(initial, period, multiplier),
    )
    for i, (grads, want) in enumerate(zip(sequence, expected, strict=True)):
        step_both(ls, tf_ls, grads, f"step {i}")
        assert bits(ls()) == bits(f32(want)), (i, float(ls()), want)


def test_growth_refused_resets_counter_like_tf() -> None:
    ls, tf_ls = lossscale.DynamicLossScale(2.0**127, 3, 2.0), TFDynamic(2.0**127, 3, 2.0)
    counters = []
    for i in range(7):
        step_both(ls, tf_ls, OK, f"step {i}")
        counters.append(ls.num_good_steps)
    assert counters == [1, 2, 0, 1, 2, 0, 1]
    assert float(ls()) == 2.0**127


@pytest.mark.parametrize(
    ("grads", "finite"),
    [
        ([np.array([65504.0, -65504.0], np.float16)], True),
        ([make_array([70000.0], np.float16, zero_d=False)], False),
        ([make_array([65520.0], np.float16, zero_d=True)], False),
        ([np.array([1.0, math.nan], ml_dtypes.bfloat16)], False),
        ([np.array([3.0e38, 1.0], ml_dtypes.bfloat16)], True),
        ([np.array([-math.inf], ml_dtypes.bfloat16)], False),
        ([np.array([1e300], np.float64)], True),
        ([np.float64(1e300)], True),  # a NumPy scalar (and a Python float subclass): float64
        ([np.float64(math.inf)], False),
        ([np.float32(1e38), np.float16(6e4)], True),
        ([make_array([1e300], np.float32, zero_d=False)], False),
        ([np.zeros([0], np.float16), np.zeros([0, 3], np.float64)], True),
        ({"a": [None, np.float16(1.0)], "b": (np.array([math.nan], np.float64),)}, False),
        ([1.0, None, 2.5], True),
        ([1.0, math.inf], False),
    ],
)
def test_finiteness_per_dtype_matches_tf(grads: Any, finite: bool) -> None:
    ls, tf_ls = lossscale.DynamicLossScale(8.0, 1, 2.0), TFDynamic(8.0, 1, 2.0)
    applied = step_both(ls, tf_ls, grads, "step")
    assert applied is finite
    assert float(ls()) == (16.0 if finite else 4.0)


@pytest.mark.parametrize("grads", EMPTY_STRUCTURES)
def test_empty_structures_are_finite_steps_like_tf(grads: Any) -> None:
    ls, tf_ls = lossscale.DynamicLossScale(8.0, 2, 2.0), TFDynamic(8.0, 2, 2.0)
    assert run_both(ls, tf_ls, [grads, grads]) == [True, True]
    assert float(ls()) == 16.0


@pytest.mark.parametrize("initial", [1e-40, 1.4e-45, 5e-39])
def test_subnormal_initial_scale_is_rejected_or_matches_tf(initial: float) -> None:
    """A float32-subnormal initial scale: TF flushes subnormals to zero when it multiplies.

    TF 2.21: ``DynamicLossScale(1e-40, 1, 3.0)`` then one finite step gives 0.0 (the CPU kernels
    run with flush-to-zero), where NumPy float32 gives 2.99998e-40. Either lossscale rejects
    such an initial scale with ValueError (it cannot be TF-exact and never 0 at once) or it
    must match TF.
    """
    try:
        ls = lossscale.DynamicLossScale(initial, 1, 3.0)
    except ValueError:
        return
    tf_ls = TFDynamic(initial, 1, 3.0)
    run_both(ls, tf_ls, [OK, OK, NAN], f"DynamicLossScale({initial!r}, 1, 3.0)")


# --------------------------------------------------------------------------------------------
# configs and serialization
# --------------------------------------------------------------------------------------------
CONFIG_ARGS = [
    (),
    (1, 2, 3),
    (10.0, 3, 10 / 3),
    (0.1, 5, 1.0001),
    (2**127, 1, 2.0),
    (3e38, 4, 1.5),
    (0.5, 2000, 2),
    (np.float64(8.0), np.int64(7), np.float64(4.0)),
]


@pytest.mark.parametrize("args", CONFIG_ARGS)
def test_dynamic_get_config_equals_tf(args: tuple[Any, ...]) -> None:
    ours = lossscale.DynamicLossScale(*args).get_config()
    theirs = TFDynamic(*args).get_config()
    assert ours == theirs
    assert list(ours) == list(theirs)
    assert {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in theirs.items()}


@settings(max_examples=40, deadline=None)
@given(initial=initial_scales, period=st.integers(1, 10**6), multiplier=multipliers)
def test_dynamic_get_config_and_serialize_equal_tf(
    initial: float, period: int, multiplier: float
) -> None:
    ours = lossscale.DynamicLossScale(initial, period, multiplier)
    theirs = TFDynamic(initial, period, multiplier)
    assert ours.get_config() == theirs.get_config()
    assert lossscale.serialize(ours) == keras_serialize(theirs)
    assert (ours.initial_loss_scale, ours.increment_period, ours.multiplier) == (
        theirs.initial_loss_scale,
        theirs.increment_period,
        theirs.multiplier,
    )


@pytest.mark.parametrize(
    "value", [1, 1.0, 1000, 2.5, 2.0**15, 2.0**127, 3.4e38, np.float64(4.0), 10 / 3]
)
def test_fixed_get_config_serialize_and_value_equal_tf(value: Any) -> None:
    ours, theirs = lossscale.FixedLossScale(value), TFFixed(value)
    assert ours.get_config() == theirs.get_config()
    assert type(ours.get_config()["loss_scale_value"]) is float
    assert lossscale.serialize(ours) == keras_serialize(theirs)
    assert bits(ours()) == bits(theirs().numpy())
    assert (
        ours.update([np.float32(math.nan)])
        == theirs.update([np.float32(math.nan)])
        == (
            None,
            True,
        )
    )


def _tf_written(tf_loss_scale: Any, via_json: bool) -> dict[str, Any]:
    config = keras_serialize(tf_loss_scale)
    return json.loads(json.dumps(config)) if via_json else config


@pytest.mark.parametrize("via_json", [False, True], ids=["dict", "json"])
@pytest.mark.parametrize("loader", ["deserialize", "get"])
@pytest.mark.parametrize("args", CONFIG_ARGS[:7])
def test_tf_written_dynamic_config_loads_unchanged(
    args: tuple[Any, ...], loader: str, via_json: bool
) -> None:
    tf_ls = TFDynamic(*args)
    config = _tf_written(tf_ls, via_json)
    original = json.dumps(config, sort_keys=True)
    loaded = getattr(lossscale, loader)(config)
    assert json.dumps(config, sort_keys=True) == original, "the config dict was modified"
    assert type(loaded) is lossscale.DynamicLossScale
    assert loaded.get_config() == tf_ls.get_config()
    assert lossscale.serialize(loaded) == keras_serialize(tf_ls)
    # The loaded object follows TF's trajectory from the same config.
    sequence = [OK, OK, NAN, OK, [], OK, OK, OK, NAN, NAN, OK]
    run_both(loaded, TFDynamic.from_config(config["config"]), sequence, f"{config}")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial=initial_scales,
    period=periods,
    multiplier=multipliers,
    finite=sequences(st.booleans(), max_size=30),
)
def test_tf_written_config_gives_tf_trajectory(
    initial: float, period: int, multiplier: float, finite: list[bool]
) -> None:
    config = _tf_written(TFDynamic(initial, period, multiplier), via_json=True)
    loaded = lossscale.get(config)
    assert isinstance(loaded, lossscale.DynamicLossScale)
    sequence = [[np.float32(1.0 if ok else math.inf)] for ok in finite]
    applied = run_both(loaded, TFDynamic.from_config(config["config"]), sequence, f"{config}")
    assert applied == finite


@pytest.mark.parametrize("via_json", [False, True], ids=["dict", "json"])
@pytest.mark.parametrize("loader", ["deserialize", "get"])
@pytest.mark.parametrize("value", [1, 123, 2.5, 2.0**127])
def test_tf_written_fixed_config_loads_unchanged(value: Any, loader: str, via_json: bool) -> None:
    tf_fixed = TFFixed(value)
    config = _tf_written(tf_fixed, via_json)
    loaded = getattr(lossscale, loader)(config)
    assert type(loaded) is lossscale.FixedLossScale
    assert loaded.get_config() == tf_fixed.get_config()
    assert lossscale.serialize(loaded) == keras_serialize(tf_fixed)
    assert bits(loaded()) == bits(tf_fixed().numpy())


def test_lossscale_written_config_loads_in_tf() -> None:
    """The other direction: lossscale.serialize output is TF-loadable and equivalent."""
    from tensorflow.python.keras.mixed_precision import loss_scale as keras_loss_scale

    for ours in (lossscale.DynamicLossScale(10.0, 3, 10 / 3), lossscale.FixedLossScale(77)):
        theirs = keras_loss_scale.deserialize(json.loads(json.dumps(lossscale.serialize(ours))))
        assert type(theirs).__name__ == type(ours).__name__
        assert theirs.get_config() == ours.get_config()
        assert bits(theirs().numpy()) == bits(ours())


@pytest.mark.parametrize(
    ("args", "sequence"),
    [((10.0, 1, 3.0), [NAN]), ((2.0**15, 2000, 2.0), [OK, OK]), ((0.1, 1, 3.0), [OK, OK])],
)
def test_repr_matches_tf(args: tuple[Any, ...], sequence: list[Any]) -> None:
    """The docstring promises TF's eager repr; TF prints the float32 scale with NumPy's str."""
    ls, tf_ls = lossscale.DynamicLossScale(*args), TFDynamic(*args)
    run_both(ls, tf_ls, sequence)
    assert repr(ls) == repr(tf_ls)
