"""Tests of ``LossScale``, ``FixedLossScale`` and ``DynamicLossScale`` (spec §1-3, §8; C1-C6)."""

from __future__ import annotations

import re
from collections import namedtuple
from typing import Any

import numpy as np
import pytest

from lossscale import DynamicLossScale, FixedLossScale, LossScale
from lossscale._testing import Constant
from lossscale.core import FLOAT32_MAX, DynamicState
from lossscale.stateful import STATE_VERSION

NAN = float("nan")
INF = float("inf")
F32 = np.float32


def ok() -> list[Any]:
    return [np.ones(2, np.float32)]


def bad() -> list[Any]:
    return [np.array([1.0, NAN], np.float32)]


def step(ls: LossScale, finite: bool) -> bool:
    _, should_apply = ls.update(ok() if finite else bad())
    return bool(should_apply)


def snapshot(ls: DynamicLossScale) -> tuple[float, int]:
    return float(ls()), ls.num_good_steps


# == LossScale ==================================================================================


def test_loss_scale_is_abstract() -> None:
    with pytest.raises(TypeError, match=r"abstract"):
        LossScale()  # type: ignore[abstract]


def test_subclass_missing_a_method_is_abstract() -> None:
    class NoUpdate(LossScale):
        def __call__(self) -> Any:
            return 1.0

        def get_config(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match=r"update"):
        NoUpdate()  # type: ignore[abstract]


def test_minimal_subclass_works() -> None:
    ls = Constant(3.0)
    assert float(ls()) == 3.0
    assert ls.update([np.ones(1)]) == (None, True)
    assert ls.get_config() == {"value": 3.0}


def test_from_config_is_cls_of_config() -> None:
    ls = Constant.from_config({"value": 5.0})
    assert isinstance(ls, Constant)
    assert ls.value == 5.0
    assert Constant.from_config({}).value == 2.0  # missing keys take the defaults


def test_from_config_unknown_key_is_type_error() -> None:
    with pytest.raises(TypeError, match=r"bogus"):
        Constant.from_config({"value": 1.0, "bogus": 1})


def test_subclass_without_state_dict() -> None:
    with pytest.raises(NotImplementedError, match=r"Constant"):
        Constant().state_dict()
    with pytest.raises(NotImplementedError, match=r"Constant"):
        Constant().load_state_dict({})


# == FixedLossScale =============================================================================


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1.0),
        (1000, 1000.0),
        (2.5, 2.5),
        (np.float32(4.5), 4.5),
        (np.float64(8), 8.0),
        (np.int64(16), 16.0),
        (np.int32(3), 3.0),
        (FLOAT32_MAX, FLOAT32_MAX),
    ],
)
def test_fixed_accepts_numbers(value: Any, expected: float) -> None:
    ls = FixedLossScale(value)
    assert ls.get_config() == {"loss_scale_value": expected}
    assert type(ls.get_config()["loss_scale_value"]) is float


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (True, TypeError, "loss_scale_value.*True"),
        (False, TypeError, "loss_scale_value.*False"),
        (np.bool_(True), TypeError, "loss_scale_value.*True"),
        ("2", TypeError, "loss_scale_value.*'2'"),
        (None, TypeError, "loss_scale_value.*None"),
        (np.array([2.0]), TypeError, "loss_scale_value"),
        (2 + 0j, TypeError, "loss_scale_value.*2\\+0j"),
        (0.999, ValueError, "loss_scale_value.*0.999"),
        (0.5, ValueError, "loss_scale_value.*0.5"),
        (0, ValueError, "loss_scale_value.*0"),
        (-1, ValueError, "loss_scale_value.*-1"),
        (NAN, ValueError, "loss_scale_value.*nan"),
        (INF, ValueError, "loss_scale_value.*inf"),
        (-INF, ValueError, "loss_scale_value.*-inf"),
        (1e39, ValueError, "loss_scale_value=1e\\+39 overflows float32"),
        (3.5e38, ValueError, "loss_scale_value=3.5e\\+38 overflows float32"),
        (2**1024, ValueError, "loss_scale_value=1797693.* too large"),
    ],
)
def test_fixed_rejects(value: Any, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        FixedLossScale(value)


def test_fixed_call_is_a_float32_0d_numpy_array() -> None:
    ls = FixedLossScale(1000)
    out = ls()
    assert isinstance(out, np.ndarray)
    assert out.shape == ()
    assert out.dtype == np.float32
    assert float(out) == 1000.0
    out[...] = 1  # each call is a new array: mutating one does not change the scale
    assert float(ls()) == 1000.0
    assert float(FixedLossScale(1.1)()) == float(F32(1.1))


@pytest.mark.parametrize(
    "grads",
    [
        [np.array([NAN])],
        [np.array([INF, -INF])],
        [1, 2],
        ["string"],
        [np.ones(2, np.int32)],
        None,
        [],
        object(),
    ],
)
def test_fixed_update_is_none_true_whatever_the_grads(grads: Any) -> None:
    ls = FixedLossScale(8)
    result = ls.update(grads)
    assert result == (None, True)
    assert result[0] is None
    assert result[1] is True  # a Python bool, as TensorFlow
    assert float(ls()) == 8.0


def test_fixed_get_config_repr_and_from_config() -> None:
    ls = FixedLossScale(1000)
    assert ls.get_config() == {"loss_scale_value": 1000.0}
    assert repr(ls) == "FixedLossScale(1000.0)"
    clone = FixedLossScale.from_config(ls.get_config())
    assert isinstance(clone, FixedLossScale)
    assert repr(clone) == "FixedLossScale(1000.0)"


def test_fixed_from_dynamic_config_is_type_error() -> None:
    with pytest.raises(TypeError, match=r"initial_loss_scale"):
        FixedLossScale.from_config(DynamicLossScale().get_config())


def test_fixed_state_dict_round_trip() -> None:
    ls = FixedLossScale(8)
    state = ls.state_dict()
    assert state == {
        "version": STATE_VERSION,
        "class_name": "FixedLossScale",
        "current_loss_scale": 8.0,
    }
    assert STATE_VERSION == 1
    FixedLossScale(8).load_state_dict(state)  # a matching state loads (nothing to restore)
    assert float(ls()) == 8.0


@pytest.mark.parametrize(
    ("state", "pattern"),
    [
        (
            {"version": 1, "class_name": "FixedLossScale", "current_loss_scale": 16.0},
            "current_loss_scale.*16.0",
        ),
        (
            {"version": 1, "class_name": "FixedLossScale", "current_loss_scale": NAN},
            "current_loss_scale",
        ),
        (
            {"version": 1, "class_name": "FixedLossScale", "current_loss_scale": "8"},
            "current_loss_scale",
        ),
        ({"version": 1, "class_name": "FixedLossScale"}, "missing key 'current_loss_scale'"),
        ({"version": 2, "class_name": "FixedLossScale", "current_loss_scale": 8.0}, "version"),
        ({"version": 1, "class_name": "FixedLossScale", "current_loss_scale": 8.0, "x": 1}, "'x'"),
        (DynamicLossScale(8).state_dict(), "class_name.*DynamicLossScale"),
        ([("current_loss_scale", 8.0)], "must be a dict"),
    ],
)
def test_fixed_load_state_dict_rejects(state: Any, pattern: str) -> None:
    ls = FixedLossScale(8)
    with pytest.raises(ValueError, match=pattern):
        ls.load_state_dict(state)
    assert ls.state_dict()["current_loss_scale"] == 8.0
    assert ls.get_config() == {"loss_scale_value": 8.0}


# == DynamicLossScale: constructor ==============================================================

TF_DEFAULT_CONFIG = {"initial_loss_scale": 32768.0, "increment_period": 2000, "multiplier": 2.0}


def test_dynamic_defaults() -> None:
    ls = DynamicLossScale()
    config = ls.get_config()
    assert config == TF_DEFAULT_CONFIG
    assert list(config) == ["initial_loss_scale", "increment_period", "multiplier"]
    assert [type(config[k]) for k in config] == [float, int, float]
    assert float(ls()) == 32768.0
    assert ls.num_good_steps == 0
    assert ls.initial_loss_scale == 32768.0
    assert ls.increment_period == 2000
    assert ls.multiplier == 2.0
    assert ls.min_loss_scale == 1.0
    assert ls.max_loss_scale == FLOAT32_MAX
    assert ls.hysteresis == 1


def test_dynamic_positional_order_is_tensorflows() -> None:
    ls = DynamicLossScale(2, 3, 4)
    assert ls.get_config() == {"initial_loss_scale": 2.0, "increment_period": 3, "multiplier": 4.0}
    assert type(ls.initial_loss_scale) is float
    assert type(ls.increment_period) is int
    assert type(ls.multiplier) is float


def test_dynamic_extensions_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        DynamicLossScale(2, 3, 4, 1.0)  # type: ignore[misc]


def test_dynamic_config_has_tf_keys_at_default_extensions() -> None:
    # defaults given explicitly (even as other number types) are still the defaults
    ls = DynamicLossScale(
        8, 5, 3, min_loss_scale=1, max_loss_scale=np.float32(FLOAT32_MAX), hysteresis=1
    )
    assert set(ls.get_config()) == {"initial_loss_scale", "increment_period", "multiplier"}


@pytest.mark.parametrize(
    "extension",
    [
        {"min_loss_scale": 0.5},
        {"max_loss_scale": 1024.0},
        {"hysteresis": 3},
        {"min_loss_scale": 2.0, "max_loss_scale": 4096.0, "hysteresis": 2},
    ],
)
def test_dynamic_extension_keys_only_when_not_default(extension: dict[str, Any]) -> None:
    ls = DynamicLossScale(16, 7, 3.0, **extension)
    config = ls.get_config()
    assert config == {
        "initial_loss_scale": 16.0,
        "increment_period": 7,
        "multiplier": 3.0,
        **extension,
    }
    clone = DynamicLossScale.from_config(config)
    assert clone.get_config() == config
    for key, value in extension.items():
        assert getattr(clone, key) == value
    assert repr(clone) == repr(ls)


def test_dynamic_from_config() -> None:
    config = {"initial_loss_scale": 4.0, "increment_period": 3, "multiplier": 2.0}
    ls = DynamicLossScale.from_config(config)
    assert isinstance(ls, DynamicLossScale)
    assert ls.get_config() == config
    partial = DynamicLossScale.from_config({"increment_period": 7})
    assert partial.get_config() == {**TF_DEFAULT_CONFIG, "increment_period": 7}
    with pytest.raises(TypeError, match=r"loss_scale_value"):
        DynamicLossScale.from_config({"loss_scale_value": 2.0})


def test_dynamic_from_config_resets_state() -> None:
    ls = DynamicLossScale(8, 1)
    step(ls, False)
    assert float(ls()) == 4.0
    assert float(DynamicLossScale.from_config(ls.get_config())()) == 8.0


def test_dynamic_initial_loss_scale_property_is_the_constructor_value() -> None:
    ls = DynamicLossScale(0.1, 1)
    assert ls.initial_loss_scale == 0.1  # the Python float given
    assert float(ls()) == 0.10000000149011612  # the float32 state
    step(ls, True)
    assert ls.initial_loss_scale == 0.1
    assert ls.get_config()["initial_loss_scale"] == 0.1


def test_dynamic_repr_is_tensorflows_eager_repr() -> None:
    ls = DynamicLossScale()
    assert repr(ls) == (
        "DynamicLossScale(current_loss_scale=32768.0, num_good_steps=0, "
        "initial_loss_scale=32768.0, increment_period=2000, multiplier=2.0)"
    )
    step(ls, True)
    assert "current_loss_scale=32768.0, num_good_steps=1," in repr(ls)
    assert repr(DynamicLossScale(hysteresis=2)).endswith("multiplier=2.0, hysteresis=2)")


def test_dynamic_repr_shows_the_float32_scale_as_tensorflow() -> None:
    # TF formats the scale's float32 value with %s: the shortest float32 text
    ls = DynamicLossScale(10, 1, 3)
    step(ls, False)
    assert repr(ls).startswith("DynamicLossScale(current_loss_scale=3.3333333, num_good_steps=0,")
    ls = DynamicLossScale(0.1, 1, 3)
    step(ls, True)
    step(ls, True)
    assert repr(ls) == (
        "DynamicLossScale(current_loss_scale=0.90000004, num_good_steps=0, "
        "initial_loss_scale=0.1, increment_period=1, multiplier=3.0)"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"initial_loss_scale": NAN}, ValueError, "initial_loss_scale.*nan"),
        ({"initial_loss_scale": INF}, ValueError, "initial_loss_scale.*inf"),
        ({"initial_loss_scale": -INF}, ValueError, "initial_loss_scale.*-inf"),
        ({"initial_loss_scale": 0}, ValueError, "initial_loss_scale.*0"),
        ({"initial_loss_scale": -4}, ValueError, "initial_loss_scale.*-4"),
        ({"initial_loss_scale": 1e39}, ValueError, "initial_loss_scale=1e\\+39"),
        ({"initial_loss_scale": 2**200}, ValueError, "initial_loss_scale=1606938"),
        ({"initial_loss_scale": 2**1024}, ValueError, "initial_loss_scale=1797693"),
        ({"initial_loss_scale": 1e-40}, ValueError, "initial_loss_scale=1e-40 is subnormal"),
        ({"initial_loss_scale": "5"}, TypeError, "initial_loss_scale.*'5'"),
        ({"initial_loss_scale": None}, TypeError, "initial_loss_scale.*None"),
        ({"initial_loss_scale": True}, TypeError, "initial_loss_scale.*True"),
        ({"increment_period": 2.7}, TypeError, "increment_period.*2.7"),
        ({"increment_period": 3.0}, TypeError, "increment_period.*3.0"),
        ({"increment_period": True}, TypeError, "increment_period.*True"),
        ({"increment_period": "3"}, TypeError, "increment_period.*'3'"),
        ({"increment_period": 0}, ValueError, "increment_period.*0"),
        ({"increment_period": -5}, ValueError, "increment_period.*-5"),
        ({"multiplier": 1}, ValueError, "multiplier.*1"),
        ({"multiplier": 1.0}, ValueError, "multiplier.*1.0"),
        ({"multiplier": 0.5}, ValueError, "multiplier.*0.5"),
        ({"multiplier": 0}, ValueError, "multiplier.*0"),
        ({"multiplier": -2}, ValueError, "multiplier.*-2"),
        ({"multiplier": NAN}, ValueError, "multiplier.*nan"),
        ({"multiplier": INF}, ValueError, "multiplier.*inf"),
        ({"multiplier": "2"}, TypeError, "multiplier.*'2'"),
        ({"min_loss_scale": 0}, ValueError, "min_loss_scale.*0"),
        ({"min_loss_scale": -1}, ValueError, "min_loss_scale.*-1"),
        ({"min_loss_scale": NAN}, ValueError, "min_loss_scale.*nan"),
        (
            {"min_loss_scale": 100, "max_loss_scale": 10, "initial_loss_scale": 5},
            ValueError,
            "min_loss_scale=100 must not exceed max_loss_scale=10",
        ),
        ({"max_loss_scale": INF}, ValueError, "max_loss_scale.*inf"),
        ({"max_loss_scale": -1}, ValueError, "max_loss_scale.*-1"),
        ({"hysteresis": 0}, ValueError, "hysteresis.*0"),
        ({"hysteresis": -1}, ValueError, "hysteresis.*-1"),
        ({"hysteresis": 2.0}, TypeError, "hysteresis.*2.0"),
        (
            {"initial_loss_scale": 1000, "max_loss_scale": 100},
            ValueError,
            "initial_loss_scale=1000 exceeds max_loss_scale=100",
        ),
    ],
)
def test_dynamic_rejects(kwargs: dict[str, Any], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        DynamicLossScale(**kwargs)


def test_dynamic_initial_below_min_is_allowed() -> None:
    # C3: TF starts at 0.5 with floor 1 and lifts it to 1 on the first non-finite step
    ls = DynamicLossScale(0.5, 10)
    assert float(ls()) == 0.5
    step(ls, False)
    assert float(ls()) == 1.0
    ls = DynamicLossScale(1, 10, min_loss_scale=4)
    step(ls, False)
    assert float(ls()) == 4.0


def test_dynamic_min_below_one_is_the_floor() -> None:
    ls = DynamicLossScale(2, 10, min_loss_scale=0.125)
    seen = []
    for _ in range(6):
        step(ls, False)
        seen.append(float(ls()))
    assert seen == [1.0, 0.5, 0.25, 0.125, 0.125, 0.125]


def test_dynamic_accepts_numpy_numbers() -> None:
    ls = DynamicLossScale(np.float32(8), np.int64(3), np.float64(2))
    assert ls.get_config() == {"initial_loss_scale": 8.0, "increment_period": 3, "multiplier": 2.0}
    assert type(ls.increment_period) is int


# == DynamicLossScale: update semantics ========================================================


def trajectory(ls: DynamicLossScale, steps: list[bool]) -> list[tuple[bool, float, int]]:
    out = []
    for finite in steps:
        applied = step(ls, finite)
        out.append((applied, float(ls()), ls.num_good_steps))
    return out


def test_update_float32_arithmetic() -> None:
    ls = DynamicLossScale(10, 1, 3)
    step(ls, False)
    assert float(ls()) == 3.3333332538604736  # 10 / 3 in float32
    assert ls().dtype == np.float32
    step(ls, True)
    assert float(ls()) == 10.0  # 3.3333333 * 3 in float32 is exactly 10
    ls = DynamicLossScale(10, 1, 3)
    step(ls, False)
    step(ls, False)
    step(ls, True)
    assert float(ls()) == 3.3333330154418945


def test_update_growth_at_counter_plus_one_ge_period() -> None:
    ls = DynamicLossScale(8, 3)
    assert trajectory(ls, [True] * 7) == [
        (True, 8.0, 1),
        (True, 8.0, 2),
        (True, 16.0, 0),
        (True, 16.0, 1),
        (True, 16.0, 2),
        (True, 32.0, 0),
        (True, 32.0, 1),
    ]


def test_update_non_finite_halves_and_resets() -> None:
    ls = DynamicLossScale(16, 3)
    assert trajectory(ls, [True, True, False, False, False, False, False, False]) == [
        (True, 16.0, 1),
        (True, 16.0, 2),
        (False, 8.0, 0),
        (False, 4.0, 0),
        (False, 2.0, 0),
        (False, 1.0, 0),
        (False, 1.0, 0),
        (False, 1.0, 0),
    ]


def test_update_growth_refused_at_inf() -> None:
    ls = DynamicLossScale(2.0**127, 1)
    assert trajectory(ls, [True, True]) == [(True, 2.0**127, 0), (True, 2.0**127, 0)]
    ls = DynamicLossScale(FLOAT32_MAX / 2, 2)
    assert trajectory(ls, [True, True, True, True]) == [
        (True, FLOAT32_MAX / 2, 1),
        (True, FLOAT32_MAX, 0),
        (True, FLOAT32_MAX, 1),
        (True, FLOAT32_MAX, 0),  # refused: not clamped, not inf; counter reset
    ]


def test_update_growth_refused_above_max_loss_scale() -> None:
    ls = DynamicLossScale(300, 1, max_loss_scale=1000)
    assert trajectory(ls, [True, True, True, False, True]) == [
        (True, 600.0, 0),
        (True, 600.0, 0),
        (True, 600.0, 0),
        (False, 300.0, 0),
        (True, 600.0, 0),
    ]


def test_update_shrink_floor_at_min() -> None:
    ls = DynamicLossScale(12, 5, min_loss_scale=5)
    assert [t[1] for t in trajectory(ls, [False, False, False])] == [6.0, 5.0, 5.0]


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_update_nan_and_infinities_alike(value: float) -> None:
    ls = DynamicLossScale(8, 2)
    step(ls, True)
    _, should_apply = ls.update([np.array([1.0, value, 2.0], np.float32)])
    assert not bool(should_apply)
    assert snapshot(ls) == (4.0, 0)


@pytest.mark.parametrize(
    "grads",
    [
        [np.ones(3), np.ones((2, 2)), np.array([[1.0, 1.0], [1.0, NAN]])],
        {"z": np.array([INF]), "a": np.ones(3)},
        ({"a": [None, (np.ones(1), np.array([-INF]))]},),
        [np.ones(1000, np.float32).tolist()[:3], [1.0, NAN]],
        np.array([NAN]),
        NAN,
    ],
)
def test_update_one_bad_element_anywhere(grads: Any) -> None:
    ls = DynamicLossScale(8, 2)
    _, should_apply = ls.update(grads)
    assert bool(should_apply) is False
    assert snapshot(ls) == (4.0, 0)


Grads = namedtuple("Grads", ["w", "b"])


@pytest.mark.parametrize(
    "grads",
    [
        [np.ones(2), None],
        (np.ones(2), None),
        {"w": np.ones(2), "b": None},
        Grads(w=np.ones(2), b=None),
        [Grads(w={"x": [np.ones(1), None]}, b=(None,)), {"y": 1.0}],
        np.ones(3, np.float16),
        1.0,
        [1.0, 2.0],
    ],
)
def test_update_finite_nestings(grads: Any) -> None:
    ls = DynamicLossScale(8, 2)
    _, should_apply = ls.update(grads)
    assert bool(should_apply) is True
    assert snapshot(ls) == (8.0, 1)
    ls.update(grads)
    assert snapshot(ls) == (16.0, 0)


@pytest.mark.parametrize("grads", [[], (), {}, None, [None], [None, [None]], {"a": None}])
def test_update_empty_structure_is_a_finite_step(grads: Any) -> None:
    ls = DynamicLossScale(8, 1)
    update_op, should_apply = ls.update(grads)
    assert update_op is None
    assert isinstance(should_apply, np.ndarray)
    assert should_apply.dtype == np.bool_
    assert bool(should_apply) is True
    assert float(ls()) == 16.0


with np.errstate(over="ignore"):
    F16_FROM_70000 = np.array([70000.0]).astype(np.float16)


@pytest.mark.parametrize(
    ("grad", "finite"),
    [
        (np.array([65504.0], np.float16), True),
        (F16_FROM_70000, False),
        (np.array([np.inf], np.float16), False),
        (np.array([1e300]), True),
        (np.float64(1e300), True),
        (np.array([3.4e38], np.float32), True),
        (np.zeros(0, np.float16), True),
        (1e39, False),  # a Python float is float32 (TensorFlow converts it so)
    ],
    ids=["f16-65504", "f16-70000", "f16-inf", "f64-1e300", "np.float64", "f32-max", "empty", "py"],
)
def test_update_finiteness_in_the_grads_own_dtype(grad: Any, finite: bool) -> None:
    ls = DynamicLossScale(8, 1)
    _, should_apply = ls.update([grad])
    assert bool(should_apply) is finite
    assert float(ls()) == (16.0 if finite else 4.0)


def test_update_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    ls = DynamicLossScale(8, 1)
    assert bool(ls.update([np.array([3e38, 1.0], bf16)])[1])
    assert float(ls()) == 16.0
    assert not bool(ls.update([np.array([1.0, np.nan], bf16)])[1])
    assert float(ls()) == 8.0


@pytest.mark.parametrize(
    ("grads", "path"),
    [
        ([np.ones(2), 1], "grads[1]"),
        ([np.ones(2), {"w": np.ones(2, np.int32)}], "grads[1]['w']"),
        ([np.ones(2), {"w": np.ones(2, np.int64)}], "grads[1]['w']"),
        ({"a": [True]}, "grads['a'][0]"),
        ([np.array([True, False])], "grads[0]"),
        ([np.ones(2, np.complex64)], "grads[0]"),
        ([1j], "grads[0]"),
        (["0.5"], "grads[0]"),
        ([np.array(["0.5"])], "grads[0]"),
        (Grads(w=None, b=np.ones(1, np.int8)), "grads[1]"),
        ([np.ones(2), [object()]], "grads[1][0]"),
    ],
)
def test_update_non_float_grads_raise_and_leave_state(grads: Any, path: str) -> None:
    ls = DynamicLossScale(8, 3, hysteresis=2)
    step(ls, True)
    step(ls, False)
    before = ls.state_dict()
    with pytest.raises(TypeError, match=re.escape(path)):
        ls.update(grads)
    assert ls.state_dict() == before
    # and the object still works afterwards
    step(ls, True)
    assert ls.num_good_steps == 1


def test_update_non_finite_and_int_in_one_structure_raises_before_anything() -> None:
    ls = DynamicLossScale(8, 1)
    with pytest.raises(TypeError, match=re.escape("grads[1]")):
        ls.update([np.array([NAN]), np.ones(1, np.int32)])
    assert snapshot(ls) == (8.0, 0)


def test_update_return_value() -> None:
    ls = DynamicLossScale(8, 3)
    for grads, expected in ((ok(), True), (bad(), False)):
        result = ls.update(grads)
        assert isinstance(result, tuple)
        assert len(result) == 2
        update_op, should_apply = result
        assert update_op is None  # C2: also on a finite step without growth
        assert isinstance(should_apply, np.ndarray)
        assert should_apply.shape == ()
        assert should_apply.dtype == np.bool_
        assert bool(should_apply) is expected


def test_call_is_a_float32_0d_numpy_snapshot() -> None:
    ls = DynamicLossScale(8, 1)
    before = ls()
    assert isinstance(before, np.ndarray)
    assert before.shape == ()
    assert before.dtype == np.float32
    step(ls, True)
    assert float(before) == 8.0  # an earlier value does not change after update
    assert float(ls()) == 16.0
    after = ls()
    after[...] = 1.0  # mutating a returned value does not change the state
    assert float(ls()) == 16.0


def test_num_good_steps_is_a_python_int() -> None:
    ls = DynamicLossScale(8, 5)
    step(ls, True)
    assert type(ls.num_good_steps) is int
    assert ls.num_good_steps == 1


def test_state_property() -> None:
    ls = DynamicLossScale(8, 5)
    step(ls, True)
    state = ls.state
    assert isinstance(state, DynamicState)
    assert (float(state.loss_scale), int(state.good_steps), int(state.nonfinite_steps)) == (8, 1, 0)


# -- hysteresis (C1) --------------------------------------------------------------------------


def test_hysteresis_default_backs_off_at_once() -> None:
    ls = DynamicLossScale(64, 10)
    assert [t[:2] for t in trajectory(ls, [False, False])] == [(False, 32.0), (False, 16.0)]


def test_hysteresis_backs_off_on_the_nth_non_finite_step_every_one_skipped() -> None:
    ls = DynamicLossScale(64, 10, hysteresis=3)
    assert [t[:2] for t in trajectory(ls, [False] * 7)] == [
        (False, 64.0),
        (False, 64.0),
        (False, 32.0),
        (False, 32.0),
        (False, 32.0),
        (False, 16.0),
        (False, 16.0),
    ]


def test_hysteresis_counts_across_finite_steps_until_growth() -> None:
    ls = DynamicLossScale(64, 3, hysteresis=2)
    # bad, good, good (no growth yet: allowance not refilled), bad -> back off
    assert [t[:2] for t in trajectory(ls, [False, True, True, False])] == [
        (False, 64.0),
        (True, 64.0),
        (True, 64.0),
        (False, 32.0),
    ]
    # bad, then 3 good -> growth refills the allowance; the next bad is tolerated
    ls = DynamicLossScale(64, 3, hysteresis=2)
    assert [t[1] for t in trajectory(ls, [False, True, True, True, False])] == [
        64.0,
        64.0,
        64.0,
        128.0,
        128.0,
    ]
    assert ls.state_dict()["num_nonfinite_steps"] == 1


# == state_dict / load_state_dict (C6) ========================================================


def test_state_dict_keys_and_values() -> None:
    ls = DynamicLossScale(10, 3, 3, hysteresis=2)
    step(ls, False)
    step(ls, False)  # back off: 10/3
    step(ls, True)
    step(ls, False)
    state = ls.state_dict()
    assert state == {
        "version": STATE_VERSION,
        "class_name": "DynamicLossScale",
        "current_loss_scale": 3.3333332538604736,
        "num_good_steps": 0,
        "num_nonfinite_steps": 1,
    }
    assert type(state["current_loss_scale"]) is float
    assert type(state["num_good_steps"]) is int
    assert type(state["num_nonfinite_steps"]) is int


def test_state_dict_round_trip_into_a_fresh_object_continues_identically() -> None:
    steps = [True, False, True, True, False, True, True, True, False, False, True]
    a = DynamicLossScale(10, 3, 3, hysteresis=2)
    trajectory(a, [False, False, True])
    b = DynamicLossScale(10, 3, 3, hysteresis=2)
    b.load_state_dict(a.state_dict())  # before any update of b
    assert b.state_dict() == a.state_dict()
    assert b().tobytes() == a().tobytes()  # lossless: bit-exact float32
    assert trajectory(a, steps) == trajectory(b, steps)


def test_load_state_dict_keeps_the_config() -> None:
    a = DynamicLossScale(4, 3)
    step(a, True)
    b = DynamicLossScale(100, 3)  # TF: checkpoints restore state, the config stays
    b.load_state_dict(a.state_dict())
    assert snapshot(b) == (4.0, 1)
    assert b.get_config()["initial_loss_scale"] == 100.0
    assert b.initial_loss_scale == 100.0


def test_load_state_dict_accepts_a_scale_below_min() -> None:
    ls = DynamicLossScale(8, 3)
    state = {**ls.state_dict(), "current_loss_scale": 0.5}
    ls.load_state_dict(state)
    assert float(ls()) == 0.5


def _valid_state() -> dict[str, Any]:
    return {
        "version": 1,
        "class_name": "DynamicLossScale",
        "current_loss_scale": 16.0,
        "num_good_steps": 1,
        "num_nonfinite_steps": 1,
    }


def _without(key: str) -> dict[str, Any]:
    state = _valid_state()
    del state[key]
    return state


def _with(**changes: Any) -> dict[str, Any]:
    return {**_valid_state(), **changes}


BAD_STATES: list[tuple[str, Any, str]] = [
    ("not-a-dict-none", None, "must be a dict"),
    ("not-a-dict-list", [("version", 1)], "must be a dict"),
    ("not-a-dict-str", "state", "must be a dict"),
    ("missing-version", _without("version"), "missing key 'version'"),
    ("missing-class", _without("class_name"), "missing key 'class_name'"),
    ("missing-scale", _without("current_loss_scale"), "missing key 'current_loss_scale'"),
    ("missing-good", _without("num_good_steps"), "missing key 'num_good_steps'"),
    ("missing-bad", _without("num_nonfinite_steps"), "missing key 'num_nonfinite_steps'"),
    ("extra-key", _with(extra=1), "unexpected key 'extra'"),
    ("version-2", _with(version=2), "version"),
    ("version-0", _with(version=0), "version"),
    ("version-str", _with(version="1"), "version"),
    ("version-bool", _with(version=True), "version"),
    ("version-none", _with(version=None), "version"),
    ("class-fixed", _with(class_name="FixedLossScale"), "class_name.*FixedLossScale"),
    ("class-other", _with(class_name="Foo"), "class_name.*Foo"),
    ("class-none", _with(class_name=None), "class_name"),
    ("fixed-state", FixedLossScale(16).state_dict(), "class_name.*FixedLossScale"),
    ("scale-nan", _with(current_loss_scale=NAN), "current_loss_scale.*nan"),
    ("scale-inf", _with(current_loss_scale=INF), "current_loss_scale.*inf"),
    ("scale-zero", _with(current_loss_scale=0.0), "current_loss_scale.*0.0"),
    ("scale-negative", _with(current_loss_scale=-2.0), "current_loss_scale.*-2.0"),
    ("scale-f32-overflow", _with(current_loss_scale=1e39), "current_loss_scale"),
    ("scale-f32-underflow", _with(current_loss_scale=1e-50), "current_loss_scale"),
    ("scale-f32-subnormal", _with(current_loss_scale=1e-40), "current_loss_scale.*1e-40"),
    (
        "scale-above-max",
        _with(current_loss_scale=2048.0),
        r"current_loss_scale'\]=2048.0 exceeds.*max_loss_scale=1024",
    ),
    ("scale-str", _with(current_loss_scale="16"), "current_loss_scale"),
    ("scale-bool", _with(current_loss_scale=True), "current_loss_scale"),
    ("scale-none", _with(current_loss_scale=None), "current_loss_scale"),
    ("good-eq-period", _with(num_good_steps=3), "num_good_steps.*increment_period=3"),
    ("good-above-period", _with(num_good_steps=7), "num_good_steps.*7"),
    ("good-negative", _with(num_good_steps=-1), "num_good_steps.*-1"),
    ("good-float", _with(num_good_steps=1.0), "num_good_steps.*1.0"),
    ("good-bool", _with(num_good_steps=True), "num_good_steps.*True"),
    ("good-str", _with(num_good_steps="1"), "num_good_steps"),
    ("bad-eq-hysteresis", _with(num_nonfinite_steps=2), "num_nonfinite_steps.*hysteresis=2"),
    ("bad-negative", _with(num_nonfinite_steps=-1), "num_nonfinite_steps.*-1"),
    ("bad-bool", _with(num_nonfinite_steps=False), "num_nonfinite_steps.*False"),
    ("bad-float", _with(num_nonfinite_steps=0.0), "num_nonfinite_steps"),
]


@pytest.mark.parametrize(
    ("state", "pattern"), [(s, p) for _, s, p in BAD_STATES], ids=[i for i, _, _ in BAD_STATES]
)
def test_load_state_dict_rejects_and_leaves_the_object_unchanged(state: Any, pattern: str) -> None:
    ls = DynamicLossScale(32, 3, hysteresis=2, max_loss_scale=1024)
    step(ls, True)
    step(ls, False)
    before = ls.state_dict()
    config = ls.get_config()
    with pytest.raises(ValueError, match=pattern):
        ls.load_state_dict(state)
    assert ls.state_dict() == before
    assert ls.get_config() == config
    assert isinstance(ls(), np.ndarray)


def test_load_state_dict_nonfinite_counter_with_default_hysteresis() -> None:
    ls = DynamicLossScale(8, 3)
    with pytest.raises(ValueError, match=r"num_nonfinite_steps.*hysteresis=1"):
        ls.load_state_dict({**ls.state_dict(), "num_nonfinite_steps": 1})
    assert ls.state_dict()["num_nonfinite_steps"] == 0


def test_load_state_dict_does_not_keep_a_reference() -> None:
    ls = DynamicLossScale(8, 3)
    state = ls.state_dict()
    ls.load_state_dict(state)
    state["current_loss_scale"] = 1024.0
    assert float(ls()) == 8.0


# == torch ======================================================================================


def test_torch_update_moves_the_state_to_torch() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 2)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        update_op, should_apply = ls.update([torch.ones(3, dtype=dtype), None])
        assert update_op is None
        assert isinstance(should_apply, torch.Tensor)
        assert should_apply.dtype == torch.bool
        assert should_apply.shape == ()
        assert bool(should_apply)
        scale = ls()
        assert isinstance(scale, torch.Tensor)
        assert scale.dtype == torch.float32
        assert scale.shape == ()
        assert scale.device == torch.ones(1).device
        for array in ls.state:
            assert isinstance(array, torch.Tensor)
    assert snapshot(ls) == (16.0, 1)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "float64"])
def test_torch_trajectory_equals_numpy(dtype_name: str) -> None:
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    steps = [True, False, True, True, True, False, False, True, True, True]
    a = DynamicLossScale(10, 2, 3, hysteresis=2)
    b = DynamicLossScale(10, 2, 3, hysteresis=2)
    for finite in steps:
        value = 1.0 if finite else float("inf")
        ta = a.update({"w": torch.tensor([0.5, value], dtype=dtype)})[1]
        nb = b.update({"w": np.array([0.5, value], np.float32)})[1]
        assert bool(ta) == bool(nb)
        assert a().item() == float(b())
        assert a.state_dict() == b.state_dict()


def test_torch_finiteness_in_own_dtype() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 1)
    assert bool(ls.update([torch.tensor([65504.0], dtype=torch.float16)])[1])
    assert not bool(ls.update([torch.tensor([70000.0]).to(torch.float16)])[1])
    assert bool(ls.update([torch.tensor([1e300], dtype=torch.float64)])[1])
    assert not bool(ls.update([torch.tensor([float("nan")], dtype=torch.bfloat16)])[1])


def test_torch_snapshot_semantics() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 1)
    ls.update([torch.ones(1)])
    before = ls()
    ls.update([torch.ones(1)])
    assert before.item() == 16.0
    assert ls().item() == 32.0
    ls().fill_(0)
    assert ls().item() == 32.0


def test_torch_mixed_with_numpy_is_type_error() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 1)
    with pytest.raises(TypeError, match=re.escape("grads[1]")):
        ls.update([torch.ones(2), np.ones(2, np.float32)])
    with pytest.raises(TypeError, match=re.escape("grads['b']")):
        ls.update({"a": np.ones(2), "b": torch.ones(2)})
    assert snapshot(ls) == (8.0, 0)
    assert isinstance(ls(), np.ndarray)


def test_torch_integer_grad_is_type_error() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 1)
    ls.update([torch.ones(1)])
    before = ls.state_dict()
    with pytest.raises(TypeError, match=re.escape("grads[0]['w']")):
        ls.update([{"w": torch.ones(2, dtype=torch.int64)}])
    assert ls.state_dict() == before


def test_torch_state_stays_with_python_float_or_empty_grads() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 1)
    ls.update([torch.ones(1)])
    _, should_apply = ls.update([1.0, None])
    assert isinstance(should_apply, torch.Tensor)
    assert bool(should_apply)
    _, should_apply = ls.update([float("nan")])
    assert not bool(should_apply)
    _, should_apply = ls.update([])
    assert isinstance(should_apply, torch.Tensor)
    assert isinstance(ls(), torch.Tensor)
    assert snapshot(ls) == (32.0, 0)  # 8 -> 16 (torch) -> 32 ([1.0]) -> 16 ([nan]) -> 32 ([])


def test_torch_then_numpy_continues_the_state() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 3)
    ls.update([torch.ones(1)])
    ls.update([torch.ones(1)])
    ls.update([np.ones(1)])  # back to NumPy: the counter carries over and the scale grows
    assert isinstance(ls(), np.ndarray)
    assert snapshot(ls) == (16.0, 0)


def test_torch_state_dict_and_load() -> None:
    torch = pytest.importorskip("torch")
    ls = DynamicLossScale(8, 3)
    ls.update([torch.ones(1)])
    state = ls.state_dict()
    assert state["num_good_steps"] == 1
    assert type(state["current_loss_scale"]) is float
    ls.load_state_dict({**state, "current_loss_scale": 2.0, "num_good_steps": 2})
    assert isinstance(ls(), torch.Tensor)  # loaded where the state lives
    assert snapshot(ls) == (2.0, 2)


# == JAX =======================================================================================


def test_jax_eager_update_moves_the_state_to_jax() -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    ls = DynamicLossScale(8, 2)
    update_op, should_apply = ls.update({"w": jnp.ones(3, jnp.bfloat16), "b": None})
    assert update_op is None
    assert isinstance(should_apply, jax.Array)
    assert should_apply.dtype == jnp.bool_
    assert bool(should_apply)
    assert isinstance(ls(), jax.Array)
    assert ls().dtype == jnp.float32
    assert ls().shape == ()
    for array in ls.state:
        assert isinstance(array, jax.Array)
    _, should_apply = ls.update([jnp.array([1.0, jnp.nan], jnp.float16)])
    assert not bool(should_apply)
    assert snapshot(ls) == (4.0, 0)


def test_jax_trajectory_equals_numpy() -> None:
    jnp = pytest.importorskip("jax.numpy")
    steps = [True, False, True, True, True, False, False, True, True, True]
    a = DynamicLossScale(10, 2, 3, hysteresis=2)
    b = DynamicLossScale(10, 2, 3, hysteresis=2)
    for finite in steps:
        value = 1.0 if finite else float("-inf")
        ja = a.update([jnp.array([0.5, value], jnp.float32)])[1]
        nb = b.update([np.array([0.5, value], np.float32)])[1]
        assert bool(ja) == bool(nb)
        assert float(a()) == float(b())
        assert a.state_dict() == b.state_dict()


def test_jax_update_inside_jit_is_type_error_pointing_to_dynamic_update() -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    ls = DynamicLossScale(8, 1)
    before = ls.state_dict()

    @jax.jit
    def f(g: Any) -> Any:
        return ls.update([1.0, g])[1]

    with pytest.raises(TypeError, match=re.escape("lossscale.core.dynamic_update")):
        f(jnp.ones(2))
    assert ls.state_dict() == before
    assert isinstance(ls(), np.ndarray)


def test_load_state_dict_accepts_numpy_integer_counters() -> None:
    ls = DynamicLossScale(initial_loss_scale=8, increment_period=5, hysteresis=3)
    state = {
        "version": 1,
        "class_name": "DynamicLossScale",
        "current_loss_scale": np.float32(4.0),
        "num_good_steps": np.int64(3),
        "num_nonfinite_steps": np.int32(2),
    }
    ls.load_state_dict(state)
    restored = ls.state_dict()
    assert restored["num_good_steps"] == 3 and type(restored["num_good_steps"]) is int
    assert restored["num_nonfinite_steps"] == 2
    with pytest.raises(ValueError, match="num_good_steps"):
        ls.load_state_dict({**state, "num_good_steps": np.bool_(True)})


@pytest.mark.parametrize("cls", [DynamicLossScale, FixedLossScale])
def test_load_state_dict_of_an_empty_or_foreign_dict_names_what_to_load(cls: Any) -> None:
    ls = cls() if cls is DynamicLossScale else cls(8)
    before = ls.state_dict()
    with pytest.raises(ValueError, match="missing key 'version'") as e:
        ls.load_state_dict({})
    expected = sorted(before)
    assert "the state is empty" in str(e.value) and str(expected) in str(e.value)
    assert f"{cls.__name__}.state_dict()" in str(e.value)
    with pytest.raises(ValueError, match=r"it has keys \['growth_tracker', 'scale'\]"):
        ls.load_state_dict({"scale": 8.0, "growth_tracker": 0})
    assert ls.state_dict() == before
