"""Tests of the optimizer-argument checks shared by every front end (``core/_settings.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import lossscale
from lossscale.core import ScaleSettings, dynamic_rule, loss_scale_settings, scale_settings


def test_experimental_loss_scale_forms() -> None:
    assert loss_scale_settings(128) == ScaleSettings(False, 128.0, None)
    assert loss_scale_settings(np.float32(4)) == ScaleSettings(False, 4.0, None)
    assert loss_scale_settings("dynamic") == scale_settings(True)
    fixed = {"class_name": "FixedLossScale", "config": {"loss_scale_value": 8}}
    assert loss_scale_settings(fixed) == ScaleSettings(False, 8.0, None)
    assert loss_scale_settings(lossscale.FixedLossScale(8)) == ScaleSettings(False, 8.0, None)
    ls = lossscale.DynamicLossScale(256, 7, min_loss_scale=0.5, hysteresis=2)
    expected = ScaleSettings(True, 256.0, dynamic_rule(7, min_loss_scale=0.5, hysteresis=2))
    assert loss_scale_settings(ls) == expected
    assert loss_scale_settings(lossscale.serialize(ls)) == expected
    # tf_keras' extra keys beside class_name and config are ignored, as by deserialize
    tf_written = {
        **lossscale.serialize(ls),
        "module": "keras.mixed_precision",
        "registered_name": None,
    }
    assert loss_scale_settings(tf_written) == expected


class Custom(lossscale.LossScale):
    def __call__(self) -> Any:
        return 1.0

    def update(self, grads: Any) -> tuple[None, Any]:
        return None, True

    def get_config(self) -> dict[str, Any]:
        return {}


class DynamicLossScale(lossscale.DynamicLossScale):  # a subclass under TensorFlow's name
    pass


class Logged(lossscale.DynamicLossScale):
    """A user's subclass with a hook and a config key of its own."""

    def __init__(self, *args: Any, every: int = 10, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.every = every

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "every": self.every}


class Fixed(lossscale.FixedLossScale):
    pass


def test_custom_subclasses_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="custom LossScale subclasses are no longer supported") as e:
        loss_scale_settings(Custom())
    assert str(e.value).startswith(
        "Passing a LossScale that is not a FixedLossScale or a DynamicLossScale is no longer "
        "supported. Got: "
    )


def test_subclasses_of_the_supported_classes_are_accepted_as_by_tensorflow() -> None:
    """TensorFlow's experimental optimizer checks with isinstance; the base class's config is
    read (the subclass's own keys are not the optimizer's)."""
    expected = scale_settings(True, 256, 7, min_loss_scale=0.5)
    assert loss_scale_settings(Logged(256, 7, min_loss_scale=0.5, every=3)) == expected
    assert loss_scale_settings(DynamicLossScale(256, 7, min_loss_scale=0.5)) == expected
    assert loss_scale_settings(Fixed(8)) == ScaleSettings(False, 8.0, None)
    with pytest.raises(ValueError, match=r"multiplier must be 2\. Got: DynamicLossScale\("):
        loss_scale_settings(DynamicLossScale(multiplier=4))


@pytest.mark.parametrize("dynamic", ["dynamic", 1, None, np.True_])
def test_a_non_bool_dynamic_starts_with_tensorflows_message(dynamic: Any) -> None:
    with pytest.raises(TypeError, match="dynamic must be a bool, got") as e:
        scale_settings(dynamic)
    assert str(e.value).startswith(
        f'"dynamic" argument to LossScaleOptimizer.__init__ must be a bool, but got: {dynamic!r}. '
    )


def test_tensorflows_v1_loss_scales_convert_as_in_tensorflow() -> None:
    tf = pytest.importorskip("tensorflow", reason="needs TensorFlow's v1 loss-scale classes")
    v1 = tf.compat.v1.mixed_precision
    assert loss_scale_settings(v1.FixedLossScale(8)) == ScaleSettings(False, 8.0, None)
    dynamic = v1.DynamicLossScale(2048, 500)
    dynamic.update([tf.constant([np.inf])])  # its current scale is not carried over (TF 2.4+)
    assert loss_scale_settings(dynamic) == scale_settings(True, 2048, 500)
    assert loss_scale_settings(v1.DynamicLossScale()) == scale_settings(True)
    with pytest.raises(ValueError, match="multiplier must be 2"):
        loss_scale_settings(v1.DynamicLossScale(multiplier=3))
    with pytest.raises(ValueError, match="loss_scale_value must be finite and at least 1"):
        loss_scale_settings(v1.FixedLossScale(float("inf")))


def test_a_subclass_of_tensorflows_v1_class_is_accepted() -> None:
    tf = pytest.importorskip("tensorflow", reason="needs TensorFlow's v1 loss-scale classes")

    class Mine(tf.compat.v1.mixed_precision.DynamicLossScale):  # type: ignore[misc,name-defined]
        pass

    assert loss_scale_settings(Mine(64, 3)) == scale_settings(True, 64, 3)

    class Other(tf.compat.v1.mixed_precision.LossScale):  # type: ignore[misc,name-defined]
        def __call__(self) -> Any:
            return 1.0

        def update(self, grads: Any) -> tuple[None, bool]:
            return None, True

        def get_config(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match="custom LossScale subclasses are no longer supported"):
        loss_scale_settings(Other())


@pytest.mark.parametrize(
    ("value", "error", "pattern"),
    [
        (lossscale.DynamicLossScale(multiplier=3), ValueError, "multiplier must be 2"),
        (
            {"class_name": "DynamicLossScale", "config": {"multiplier": 4.0}},
            ValueError,
            "multiplier must be 2",
        ),
        ({"class_name": "Other", "config": {}}, ValueError, "unknown loss scale 'Other'"),
        ({"config": {}}, ValueError, "a serialized loss scale is"),
        ({"class_name": "FixedLossScale", "config": {}}, TypeError, "exactly 'loss_scale_value'"),
        (
            {"class_name": "DynamicLossScale", "config": {"period": 3}},
            TypeError,
            "unexpected DynamicLossScale config key 'period'",
        ),
        (0.5, ValueError, "at least 1"),
        (True, ValueError, "Invalid value passed to loss_scale"),
        ("Dynamic", ValueError, "Invalid value passed to loss_scale"),
        (None, ValueError, "Invalid value passed to loss_scale"),
    ],
    ids=repr,
)
def test_experimental_loss_scale_errors(value: Any, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        loss_scale_settings(value)


# -- TensorFlow <= 2.3 optimizer configs (issue 18 item 1) ----------------------------------------

SGD = {"class_name": "SGD", "config": {"lr": 0.1}}


def test_tf23_dynamic_and_fixed_configs_convert_as_tf24_does() -> None:
    from lossscale.core import upgrade_optimizer_config

    dynamic = {
        "optimizer": SGD,
        "loss_scale": {
            "class_name": "DynamicLossScale",
            "config": {"initial_loss_scale": 256.0, "increment_period": 7, "multiplier": 2.0},
        },
    }
    assert upgrade_optimizer_config(dynamic) == {
        "inner_optimizer": SGD,
        "dynamic": True,
        "initial_scale": 256.0,
        "dynamic_growth_steps": 7,
    }
    fixed = {
        "optimizer": SGD,
        "loss_scale": {"class_name": "FixedLossScale", "config": {"loss_scale_value": 8.0}},
    }
    assert upgrade_optimizer_config(fixed) == {
        "inner_optimizer": SGD,
        "dynamic": False,
        "initial_scale": 8.0,
    }
    new = {"inner_optimizer": SGD, "dynamic": True}
    assert upgrade_optimizer_config(new) == new


def test_tf23_configs_with_other_multipliers_or_classes_are_clear_errors() -> None:
    from lossscale.core import upgrade_optimizer_config

    three = {
        "optimizer": SGD,
        "loss_scale": {"class_name": "DynamicLossScale", "config": {"multiplier": 3.0}},
    }
    with pytest.raises(ValueError, match=r"multiplier is not 2 \(only 2 is supported\)") as e:
        upgrade_optimizer_config(three)
    # TensorFlow's message first (its tests match it), then lossscale's explanation
    assert str(e.value).startswith(
        "Cannot deserialize LossScaleOptimizer with a DynamicLossScale whose multiplier is not 2. "
        "Got DynamicLossScale: DynamicLossScale(multiplier=3.0)"
    )
    other = {"optimizer": SGD, "loss_scale": {"class_name": "MyScale", "config": {}}}
    with pytest.raises(ValueError, match="only FixedLossScale and DynamicLossScale"):
        upgrade_optimizer_config(other)
