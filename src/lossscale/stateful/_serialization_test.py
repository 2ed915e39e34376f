"""Tests of ``get``, ``serialize`` and ``deserialize`` (spec §3.7, §3.8)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

import lossscale
from lossscale import DynamicLossScale, FixedLossScale, LossScale, deserialize, get, serialize
from lossscale._testing import Constant

TF_DEFAULT_CONFIG = {"initial_loss_scale": 32768.0, "increment_period": 2000, "multiplier": 2.0}


class Custom(Constant):
    """The minimal LossScale subclass under the class name these tests serialize."""


# -- serialize ------------------------------------------------------------------------------


def test_serialize_fixed_is_tensorflows_dict() -> None:
    assert serialize(FixedLossScale(123)) == {
        "class_name": "FixedLossScale",
        "config": {"loss_scale_value": 123.0},
    }


def test_serialize_dynamic_is_tensorflows_dict() -> None:
    assert serialize(DynamicLossScale(1, 2, 3)) == {
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 1.0, "increment_period": 2, "multiplier": 3.0},
    }
    assert serialize(DynamicLossScale()) == {
        "class_name": "DynamicLossScale",
        "config": TF_DEFAULT_CONFIG,
    }


def test_serialize_custom_subclass_uses_its_name() -> None:
    assert serialize(Custom(4.0)) == {"class_name": "Custom", "config": {"value": 4.0}}


@pytest.mark.parametrize("obj", [None, 8, "dynamic", {"class_name": "FixedLossScale"}])
def test_serialize_rejects_non_loss_scales(obj: Any) -> None:
    with pytest.raises(TypeError, match=r"loss_scale must be a lossscale.LossScale"):
        serialize(obj)


# -- deserialize ----------------------------------------------------------------------------


def test_tensorflow_configs_load_unchanged() -> None:
    fixed = deserialize({"class_name": "FixedLossScale", "config": {"loss_scale_value": 123.0}})
    assert isinstance(fixed, FixedLossScale)
    assert fixed.get_config() == {"loss_scale_value": 123.0}
    dynamic = deserialize({"class_name": "DynamicLossScale", "config": dict(TF_DEFAULT_CONFIG)})
    assert isinstance(dynamic, DynamicLossScale)
    assert dynamic.get_config() == TF_DEFAULT_CONFIG
    assert dynamic.num_good_steps == 0


def test_tf_keras_extra_keys_are_ignored() -> None:
    config = {
        "module": "keras.mixed_precision",
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 8.0, "increment_period": 3, "multiplier": 2.0},
        "registered_name": None,
    }
    ls = deserialize(config)
    assert isinstance(ls, DynamicLossScale)
    assert (ls.initial_loss_scale, ls.increment_period) == (8.0, 3)


@pytest.mark.parametrize(
    "ls",
    [
        FixedLossScale(7),
        DynamicLossScale(),
        DynamicLossScale(4, 5, 3),
        DynamicLossScale(2, 10, min_loss_scale=0.5, max_loss_scale=2**20, hysteresis=3),
    ],
    ids=repr,
)
def test_round_trip(ls: LossScale) -> None:
    config = serialize(ls)
    clone = deserialize(config)
    assert type(clone) is type(ls)
    assert clone is not ls
    assert clone.get_config() == ls.get_config()
    assert serialize(clone) == config


def test_round_trip_resets_the_state() -> None:
    ls = DynamicLossScale(8, 1)
    ls.update([np.array([np.nan])])
    clone = deserialize(serialize(ls))
    assert float(ls()) == 4.0
    assert float(clone()) == 8.0  # as TensorFlow: the config holds the initial values


def test_deserialize_does_not_modify_its_input() -> None:
    config = {"class_name": "DynamicLossScale", "config": {"increment_period": 5}}
    before = copy.deepcopy(config)
    deserialize(config)
    assert config == before


def test_deserialize_partial_config_uses_defaults() -> None:
    ls = deserialize({"class_name": "DynamicLossScale", "config": {"increment_period": 7}})
    assert ls.get_config() == {**TF_DEFAULT_CONFIG, "increment_period": 7}


def test_deserialize_unknown_class() -> None:
    with pytest.raises(ValueError, match=r"Unknown loss scale: 'Foo'.*custom_objects"):
        deserialize({"class_name": "Foo", "config": {}})
    with pytest.raises(ValueError, match=r"Unknown loss scale: 'Custom'"):
        deserialize({"class_name": "Custom", "config": {}})
    # lookups are by exact name
    with pytest.raises(ValueError, match=r"Unknown loss scale: 'dynamiclossscale'"):
        deserialize({"class_name": "dynamiclossscale", "config": {}})


@pytest.mark.parametrize(
    "config",
    [
        {"class_name": "DynamicLossScale"},
        {"config": {"loss_scale_value": 2.0}},
        {},
    ],
)
def test_deserialize_improper_format(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"Improper config format"):
        deserialize(config)


def test_deserialize_unexpected_top_level_key() -> None:
    config = {"class_name": "FixedLossScale", "config": {"loss_scale_value": 2}, "extra": 1}
    with pytest.raises(ValueError, match=r"Improper config format: unexpected key 'extra'"):
        deserialize(config)


def test_deserialize_bare_class_name_string() -> None:
    ls = deserialize("DynamicLossScale")
    assert isinstance(ls, DynamicLossScale)
    assert ls.get_config() == TF_DEFAULT_CONFIG
    with pytest.raises(TypeError, match=r"loss_scale_value"):  # TF: missing argument
        deserialize("FixedLossScale")
    with pytest.raises(ValueError, match=r"Unknown loss scale: 'Foo'"):
        deserialize("Foo")


def test_deserialize_validates_through_the_constructor() -> None:
    with pytest.raises(ValueError, match=r"loss_scale_value.*0.5"):
        deserialize({"class_name": "FixedLossScale", "config": {"loss_scale_value": 0.5}})
    with pytest.raises(TypeError, match=r"increment_period.*2.7"):
        deserialize({"class_name": "DynamicLossScale", "config": {"increment_period": 2.7}})
    with pytest.raises(TypeError, match=r"bogus"):
        deserialize({"class_name": "DynamicLossScale", "config": {"bogus": 1}})


@pytest.mark.parametrize("config", [5, None, ["DynamicLossScale"], 2.0])
def test_deserialize_rejects_other_types(config: Any) -> None:
    with pytest.raises(TypeError, match=r"config must be a dict or a class name string"):
        deserialize(config)


def test_deserialize_inner_config_must_be_a_dict() -> None:
    with pytest.raises(TypeError, match=r"config\['config'\] must be a dict"):
        deserialize({"class_name": "FixedLossScale", "config": [("loss_scale_value", 2)]})


def test_deserialize_custom_objects() -> None:
    ls = deserialize(
        {"class_name": "Custom", "config": {"value": 3.0}}, custom_objects={"Custom": Custom}
    )
    assert isinstance(ls, Custom)
    assert ls.value == 3.0
    assert isinstance(deserialize("Custom", custom_objects={"Custom": Custom}), Custom)
    # built-ins are still known with custom_objects
    fixed = deserialize(serialize(FixedLossScale(2)), custom_objects={"Custom": Custom})
    assert isinstance(fixed, FixedLossScale)
    # custom_objects is not remembered
    with pytest.raises(ValueError, match=r"Unknown loss scale"):
        deserialize({"class_name": "Custom", "config": {}})


def test_deserialize_custom_objects_override_builtins() -> None:
    ls = deserialize(
        {"class_name": "FixedLossScale", "config": {"value": 9.0}},
        custom_objects={"FixedLossScale": Custom},
    )
    assert isinstance(ls, Custom)
    assert ls.value == 9.0


# -- get ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("identifier", "value"),
    [(8, 8.0), (8.0, 8.0), (np.float64(4), 4.0), (np.float32(4), 4.0), (np.int64(16), 16.0)],
)
def test_get_number_is_fixed(identifier: Any, value: float) -> None:
    ls = get(identifier)
    assert isinstance(ls, FixedLossScale)
    assert ls.get_config() == {"loss_scale_value": value}


@pytest.mark.parametrize(
    ("identifier", "error", "pattern"),
    [
        (0, ValueError, "loss_scale_value.*0"),
        (0.5, ValueError, "loss_scale_value.*0.5"),
        (float("nan"), ValueError, "loss_scale_value.*nan"),
        (float("inf"), ValueError, "loss_scale_value.*inf"),
        (True, TypeError, "loss_scale_value.*True"),
        (False, TypeError, "loss_scale_value.*False"),
        (np.bool_(True), TypeError, "loss_scale_value.*True"),
    ],
)
def test_get_number_goes_through_fixed_validation(
    identifier: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        get(identifier)


def test_get_dynamic() -> None:
    a = get("dynamic")
    b = get("dynamic")
    assert isinstance(a, DynamicLossScale)
    assert a.get_config() == TF_DEFAULT_CONFIG
    assert a is not b  # a new instance each call


def test_get_loss_scale_is_returned_as_is() -> None:
    for ls in (FixedLossScale(2), DynamicLossScale(), Custom()):
        assert get(ls) is ls


def test_get_none_is_none() -> None:
    assert get(None) is None


def test_get_dict_is_deserialized() -> None:
    ls = get({"class_name": "DynamicLossScale", "config": {"initial_loss_scale": 4.0}})
    assert isinstance(ls, DynamicLossScale)
    assert ls.initial_loss_scale == 4.0
    with pytest.raises(ValueError, match=r"Improper config format"):
        get({"class_name": "DynamicLossScale"})
    with pytest.raises(ValueError, match=r"Unknown loss scale"):
        get({"class_name": "Foo", "config": {}})


@pytest.mark.parametrize(
    "identifier",
    ["Dynamic", "DYNAMIC", "dynamic ", "fixed", "8", "", [], (), [8], b"dynamic", object(), 1j],
)
def test_get_uninterpretable(identifier: Any) -> None:
    with pytest.raises(ValueError, match=r"Could not interpret loss scale identifier"):
        get(identifier)


def test_get_error_shows_the_identifier() -> None:
    with pytest.raises(ValueError, match=r"Could not interpret loss scale identifier: 'Dynamic'"):
        get("Dynamic")


@pytest.mark.parametrize("identifier", ["128", "Dynamic", [], None.__class__])
def test_get_error_lists_the_accepted_forms(identifier: Any) -> None:
    with pytest.raises(ValueError) as e:
        get(identifier)
    for form in ("a number", "'dynamic'", "a LossScale", "serialized loss scale dict", "None"):
        assert form in str(e.value)


def test_get_error_hints_at_a_number_in_a_string_and_the_case_of_dynamic() -> None:
    with pytest.raises(ValueError, match=r"a number: 128 rather than '128'"):
        get("128")
    with pytest.raises(ValueError, match=r"'dynamic' is lower-case"):
        get("DYNAMIC")


def test_public_names() -> None:
    assert lossscale.get is get
    assert lossscale.serialize is serialize
    assert lossscale.deserialize is deserialize
    assert set(lossscale.__all__) >= {
        "LossScale",
        "FixedLossScale",
        "DynamicLossScale",
        "get",
        "serialize",
        "deserialize",
    }
