"""The optimizer's loss-scale arguments, validated once for every front end.

TensorFlow's ``LossScaleOptimizer(inner_optimizer, dynamic=True, initial_scale=None,
dynamic_growth_steps=None)`` describes either a dynamic scale (multiplier 2, defaults 2**15 and
2000) or a fixed one. :func:`scale_settings` checks those arguments, with lossscale's
keyword-only extensions, and returns a :class:`ScaleSettings`; the stateful classes, the torch
optimizer and scaler, the optax transformation and the Keras optimizer all build their state
from it. Error messages name the argument by the front end's own name (``names``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from lossscale.core import _validation as v
from lossscale.core._rule import DynamicRule, dynamic_rule

#: TensorFlow's ``LossScaleOptimizer`` defaults for a dynamic scale.
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
#: The keyword-only extensions of a dynamic scale and their defaults (TensorFlow's behaviour).
EXTENSION_DEFAULTS: dict[str, float | int] = {
    "min_loss_scale": 1.0,
    "max_loss_scale": v.FLOAT32_MAX,
    "hysteresis": 1,
}


class ScaleSettings(NamedTuple):
    """A validated loss-scale configuration.

    Attributes:
      dynamic: whether the scale changes (``rule`` is then set).
      initial_scale: the starting (dynamic) or only (fixed) scale, a Python float.
      rule: the dynamic rule's hyperparameters; ``None`` for a fixed scale.

    Example:
      >>> from lossscale.core import scale_settings
      >>> s = scale_settings(True, 1024, 100)
      >>> s.dynamic, s.initial_scale, s.rule.increment_period, s.rule.multiplier
      (True, 1024.0, 100, 2.0)
      >>> scale_settings(False, 128)
      ScaleSettings(dynamic=False, initial_scale=128.0, rule=None)
    """

    dynamic: bool
    initial_scale: float
    rule: DynamicRule | None


def fixed_value(name: str, value: Any) -> float:
    """A fixed scale: a real number (TypeError otherwise), finite, ≥ 1 and finite in float32.

    TensorFlow accepts NaN and inf (``FixedLossScale``) and any number (``dynamic=False``);
    lossscale refuses what could only give a wrong run.

    Example:
      >>> from lossscale.core import fixed_value
      >>> fixed_value("loss_scale_value", 128)
      128.0
      >>> fixed_value("initial_scale", 0.5)
      Traceback (most recent call last):
      ...
      ValueError: initial_scale must be finite and at least 1, got 0.5
    """
    number = v.real(name, value)
    if not number >= 1 or math.isinf(number):
        raise ValueError(f"{name} must be finite and at least 1, got {number!r}")
    if math.isinf(v.as_float32(number)):
        raise ValueError(
            f"{name}={value!r} overflows float32 (largest {v.FLOAT32_MAX!r}); "
            "the scale lives in float32"
        )
    return number


def scale_settings(
    dynamic: Any = True,
    initial_scale: Any = None,
    dynamic_growth_steps: Any = None,
    *,
    min_loss_scale: Any = 1.0,
    max_loss_scale: Any = v.FLOAT32_MAX,
    hysteresis: Any = 1,
    names: Mapping[str, str] | None = None,
) -> ScaleSettings:
    """Check TensorFlow's ``LossScaleOptimizer`` arguments (plus the extensions).

    ``dynamic=True``: ``initial_scale`` (default 2**15) and ``dynamic_growth_steps`` (default
    2000) build a :class:`DynamicRule` with multiplier 2. ``dynamic=False``: ``initial_scale``
    is required and is the fixed scale; ``dynamic_growth_steps`` must be None and the
    extensions at their defaults (in TensorFlow's order of checks).

    Args:
      names: the front end's names for the arguments, e.g. ``{"dynamic_growth_steps":
        "growth_interval"}``, used in every message (default: TensorFlow's names).

    Raises:
      TypeError: ``dynamic`` not a bool (a string such as ``"dynamic"`` gets a message saying
        what to pass instead); a value of the wrong type.
      ValueError: a value out of range, or an argument that does not apply.

    Example:
      >>> from lossscale.core import scale_settings
      >>> scale_settings("dynamic")
      Traceback (most recent call last):
      ...
      TypeError: dynamic must be a bool, got the string 'dynamic'. ...
      >>> scale_settings(True, dynamic_growth_steps=3.0)
      Traceback (most recent call last):
      ...
      TypeError: dynamic_growth_steps must be an integer >= 1, got 3.0 of type float
    """
    name = dict(names or {}).get
    dynamic_name = name("dynamic", "dynamic")
    if isinstance(dynamic, str):
        raise TypeError(
            f"{dynamic_name} must be a bool, got the string {dynamic!r}. "
            f'{dynamic_name}=True (the default) gives a dynamic loss scale; the string "dynamic" '
            "is the experimental form's loss_scale argument "
            "(experimental.LossScaleOptimizer(optimizer, loss_scale='dynamic'))"
        )
    v.boolean(dynamic_name, dynamic)
    scale_name = name("initial_scale", "initial_scale")
    steps_name = name("dynamic_growth_steps", "dynamic_growth_steps")
    if dynamic:
        scale = DEFAULT_INITIAL_SCALE if initial_scale is None else initial_scale
        steps = DEFAULT_GROWTH_STEPS if dynamic_growth_steps is None else dynamic_growth_steps
        v.real(scale_name, scale)  # types first, then ranges
        v.integer(steps_name, steps, 1)
        rule = dynamic_rule(
            steps,
            2.0,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
        )
        value = v.positive_float32(scale_name, scale)
        if v.as_float32(value) > v.as_float32(rule.max_loss_scale):
            raise ValueError(
                f"{scale_name}={scale!r} exceeds {name('max_loss_scale', 'max_loss_scale')}="
                f"{rule.max_loss_scale!r}"
            )
        return ScaleSettings(True, float(value), rule)
    if initial_scale is None:
        raise ValueError(f'"{scale_name}" must be specified if "{dynamic_name}" is False')
    if dynamic_growth_steps is not None:
        raise ValueError(
            f'"{steps_name}" must be None if "{dynamic_name}" is False, but got: '
            f"{dynamic_growth_steps!r}"
        )
    given = {
        "min_loss_scale": min_loss_scale,
        "max_loss_scale": max_loss_scale,
        "hysteresis": hysteresis,
    }
    for key, default in EXTENSION_DEFAULTS.items():
        if given[key] != default:
            raise ValueError(
                f'"{name(key, key)}" applies only when "{dynamic_name}" is True, got {given[key]!r}'
            )
    return ScaleSettings(False, fixed_value(scale_name, initial_scale), None)
