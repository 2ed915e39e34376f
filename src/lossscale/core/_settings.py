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
from typing import Any, NamedTuple, cast

from lossscale.core import _validation as v
from lossscale.core._rule import DynamicRule, dynamic_rule

#: TensorFlow's ``LossScaleOptimizer`` defaults for a dynamic scale.
DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
#: The keyword-only extensions of a dynamic scale and their defaults (TensorFlow's behaviour).
EXTENSION_DEFAULTS: dict[str, float | int | str] = {
    "min_loss_scale": 1.0,
    "max_loss_scale": v.FLOAT32_MAX,
    "hysteresis": 1,
    "hysteresis_refill": "on_backoff",
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
    hysteresis_refill: Any = "on_backoff",
    multiplier: Any = 2.0,
    backoff_factor: Any = None,
    names: Mapping[str, str] | None = None,
) -> ScaleSettings:
    """Check TensorFlow's ``LossScaleOptimizer`` arguments (plus the extensions): the one
    settings entry of every dynamic front end.

    ``dynamic=True``: ``initial_scale`` (default 2**15) and ``dynamic_growth_steps`` (default
    2000) build a :class:`DynamicRule` with multiplier 2. ``dynamic=False``: ``initial_scale``
    is required and is the fixed scale; ``dynamic_growth_steps`` must be None and the
    extensions at their defaults (in TensorFlow's order of checks).

    Args:
      multiplier, backoff_factor: the growth factor and the back-off (None: divide by
        ``multiplier``, TensorFlow's; a number in (0, 1): multiply by it, torch's), as for
        :func:`lossscale.core.dynamic_rule`; a dynamic scale only.
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
      TypeError: "dynamic" argument to LossScaleOptimizer.__init__ must be a bool, but got: ...
      >>> scale_settings(True, dynamic_growth_steps=3.0)
      Traceback (most recent call last):
      ...
      TypeError: dynamic_growth_steps must be an integer >= 1, got 3.0 of type float
    """
    name = dict(names or {}).get
    dynamic_name = name("dynamic", "dynamic")
    if not isinstance(dynamic, bool):
        # TensorFlow's message first (its tests match it), then lossscale's explanation
        tf_start = (
            f'"{dynamic_name}" argument to LossScaleOptimizer.__init__ must be a bool, but got: '
            f"{dynamic!r}. "
        )
        if isinstance(dynamic, str):
            raise TypeError(
                f"{tf_start}{dynamic_name} must be a bool, got the string {dynamic!r}. "
                f"{dynamic_name}=True (the default) gives a dynamic loss scale; the string "
                '"dynamic" is the experimental form\'s loss_scale argument '
                "(experimental.LossScaleOptimizer(optimizer, loss_scale='dynamic'))"
            )
        raise TypeError(
            f"{tf_start}{dynamic_name} must be a bool, got {dynamic!r} of type "
            f"{type(dynamic).__name__}: True for a dynamic loss scale, False for a fixed one"
        )
    scale_name = name("initial_scale", "initial_scale")
    steps_name = name("dynamic_growth_steps", "dynamic_growth_steps")
    if dynamic:
        scale = DEFAULT_INITIAL_SCALE if initial_scale is None else initial_scale
        steps = DEFAULT_GROWTH_STEPS if dynamic_growth_steps is None else dynamic_growth_steps
        v.real(scale_name, scale)  # types first, then ranges
        v.integer(steps_name, steps, 1)
        rule = dynamic_rule(
            steps,
            multiplier,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            backoff_factor=backoff_factor,
            hysteresis_refill=hysteresis_refill,
            names=names,
        )
        max_name = name("max_loss_scale", "max_loss_scale")
        value = v.scale_at_most(scale_name, scale, rule.max_loss_scale, max_name)
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
        "hysteresis_refill": hysteresis_refill,
        "multiplier": multiplier,
        "backoff_factor": backoff_factor,
    }
    for key, default in {**EXTENSION_DEFAULTS, "multiplier": 2.0, "backoff_factor": None}.items():
        if given[key] != default:
            raise ValueError(
                f'"{name(key, key)}" applies to a dynamic scale only (leave it at its default '
                f'when "{dynamic_name}" is False), got {given[key]!r}'
            )
    return ScaleSettings(False, fixed_value(scale_name, initial_scale), None)


#: The loss-scale classes the experimental optimizer accepts, by their TensorFlow names.
_SUPPORTED = "FixedLossScale", "DynamicLossScale"
#: TensorFlow's v1 classes (``tf.compat.v1.mixed_precision``), which TensorFlow 2.4+'s
#: experimental optimizer converted: recognised by their module, since core never imports
#: TensorFlow.
_TF_MODULE = "tensorflow.python.training.experimental.loss_scale"
#: lossscale's own FixedLossScale and DynamicLossScale (:func:`register_loss_scale_classes`).
_OWN_CLASSES: set[type] = set()


def register_loss_scale_classes(*classes: type) -> None:
    """Accept instances of ``classes`` and of their subclasses as ``loss_scale`` arguments
    (:func:`loss_scale_settings`): the stateful front end registers its ``FixedLossScale`` and
    ``DynamicLossScale`` here, so that core names no front end."""
    _OWN_CLASSES.update(classes)


def _supported_base(value: Any) -> type | None:
    """The ``FixedLossScale`` / ``DynamicLossScale`` class (lossscale's or TensorFlow's v1)
    that ``value`` is an instance of, subclasses included (TensorFlow's ``isinstance``); None
    for anything else."""
    for cls in type(value).__mro__:
        if cls in _OWN_CLASSES or (cls.__module__ == _TF_MODULE and cls.__name__ in _SUPPORTED):
            return cls
    return None


def _is_loss_scale_object(value: Any) -> bool:
    """Whether ``value`` is an instance of a class deriving from a ``LossScale`` base (lossscale's
    stateful classes, or TF's), recognised by name so that core imports no front end."""
    return any(cls.__name__ == "LossScale" for cls in type(value).__mro__[1:])


def loss_scale_settings(loss_scale: Any, *, name: str = "loss_scale") -> ScaleSettings:
    """The experimental optimizer's ``loss_scale`` argument as :class:`ScaleSettings`.

    TensorFlow 2.3's ``LossScaleOptimizer(optimizer, loss_scale)`` rules, for every front end:

    * a number (not a bool) → a fixed scale of that value;
    * ``"dynamic"`` → TensorFlow's dynamic defaults (2**15, 2000 steps, multiplier 2);
    * an instance of lossscale's ``FixedLossScale`` / ``DynamicLossScale`` or of TensorFlow's
      v1 one (``tf.compat.v1.mixed_precision``), subclasses included (TensorFlow checks with
      ``isinstance``: a subclass that adds, say, a logging hook is accepted), or the serialized
      dict of one (``{'class_name': ..., 'config': {...}}``, as ``serialize`` or TensorFlow
      write it) → the same scale: its initial scale and period, not its current state, as
      TensorFlow 2.4+, read through the base class's ``get_config`` (a subclass's own config
      keys are not the optimizer's); a dynamic one must have multiplier 2 (``ValueError``, as
      TensorFlow), and its extensions carry over;
    * an instance of any other ``LossScale`` subclass → ``TypeError``, as TensorFlow's
      "custom LossScale subclasses are no longer supported";
    * anything else → ``ValueError`` naming what is supported.

    Example:
      >>> from lossscale.core import loss_scale_settings
      >>> loss_scale_settings(128)
      ScaleSettings(dynamic=False, initial_scale=128.0, rule=None)
      >>> s = loss_scale_settings({"class_name": "DynamicLossScale",
      ...                          "config": {"initial_loss_scale": 256, "increment_period": 7}})
      >>> s.initial_scale, s.rule.increment_period
      (256.0, 7)
    """
    if v.is_real_number(loss_scale):
        return ScaleSettings(False, fixed_value(name, loss_scale), None)
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return scale_settings(True)
    if isinstance(loss_scale, Mapping):
        class_name, config = _split_serialized(loss_scale, name)
        described = f"{class_name}({', '.join(f'{k}={x!r}' for k, x in config.items())})"
    elif _is_loss_scale_object(loss_scale):
        base = _supported_base(loss_scale)
        if base is None:
            raise TypeError(
                "Passing a LossScale that is not a FixedLossScale or a DynamicLossScale is no "
                f"longer supported. Got: {loss_scale!r}. {name}: custom LossScale subclasses are "
                f"no longer supported by the optimizer (type {type(loss_scale).__name__}). Pass "
                '"dynamic", a number (a fixed scale), or a FixedLossScale / DynamicLossScale (or '
                "a subclass of one) of lossscale or of tf.compat.v1.mixed_precision"
            )
        class_name = base.__name__
        config = dict(cast(Any, base).get_config(loss_scale))  # the base's, not an override
        described = repr(loss_scale)
    else:
        raise ValueError(
            f'Invalid value passed to {name}. {name} must be the string "dynamic" '
            "(recommended), an int, a float, a FixedLossScale, a DynamicLossScale or a "
            f"serialized loss scale dict. Got value: {loss_scale!r}"
        )
    if class_name == "FixedLossScale":
        keys = set(config) - {"loss_scale_value"}
        if keys or "loss_scale_value" not in config:
            raise TypeError(
                f"{name}: a FixedLossScale config takes exactly 'loss_scale_value', got "
                f"{sorted(config)}"
            )
        return ScaleSettings(
            False, fixed_value("loss_scale_value", config["loss_scale_value"]), None
        )
    return _dynamic_from_config(config, name, described)


def _split_serialized(config: Mapping[str, Any], name: str) -> tuple[str, dict[str, Any]]:
    if "class_name" not in config or "config" not in config:
        raise ValueError(
            f"{name}: a serialized loss scale is {{'class_name': ..., 'config': {{...}}}}, "
            f"got {dict(config)!r}"
        )
    class_name, inner = config["class_name"], config["config"]
    if class_name not in _SUPPORTED:
        raise ValueError(f"{name}: unknown loss scale {class_name!r}; known: {list(_SUPPORTED)}")
    if not isinstance(inner, Mapping):
        raise TypeError(f"{name}['config'] must be a dict, got {inner!r}")
    return class_name, dict(inner)


_DYNAMIC_KEYS = ("initial_loss_scale", "increment_period", "multiplier", *EXTENSION_DEFAULTS)


def _dynamic_from_config(config: Mapping[str, Any], name: str, described: str) -> ScaleSettings:
    unknown = sorted(set(config) - set(_DYNAMIC_KEYS))
    if unknown:
        raise TypeError(f"{name}: unexpected DynamicLossScale config key {unknown[0]!r}")
    multiplier = config.get("multiplier", 2.0)
    v.real("multiplier", multiplier)
    if multiplier != 2:
        raise ValueError(
            f'When passing a DynamicLossScale to "{name}", DynamicLossScale.multiplier must be '
            f"2. Got: {described}"
        )
    extensions = {key: config.get(key, default) for key, default in EXTENSION_DEFAULTS.items()}
    return scale_settings(
        True, config.get("initial_loss_scale"), config.get("increment_period"), **extensions
    )


def upgrade_optimizer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``LossScaleOptimizer`` config in TensorFlow 2.4+'s form, from either form.

    TensorFlow ≤ 2.3 wrote ``{'optimizer': {...}, 'loss_scale': {'class_name', 'config'}}``;
    TensorFlow 2.4+ reads it by converting, and so does every lossscale front end: a
    ``FixedLossScale`` becomes ``dynamic=False, initial_scale=value``; a ``DynamicLossScale``
    becomes ``dynamic=True`` with its ``initial_loss_scale`` and ``increment_period`` (and any
    lossscale extension keys); ``optimizer`` is renamed ``inner_optimizer``. A config already in
    the 2.4+ form comes back as a copy.

    Raises:
      ValueError: a ``DynamicLossScale`` whose multiplier is not 2 (only 2 is supported, as in
        TensorFlow), or a loss scale of another class.

    Example:
      >>> from lossscale.core import upgrade_optimizer_config
      >>> old = {"optimizer": {"class_name": "SGD", "config": {"lr": 0.1}},
      ...        "loss_scale": {"class_name": "DynamicLossScale",
      ...                       "config": {"initial_loss_scale": 8.0, "increment_period": 3,
      ...                                  "multiplier": 2.0}}}
      >>> new = upgrade_optimizer_config(old)
      >>> new["inner_optimizer"]["class_name"], new["dynamic"], new["initial_scale"]
      ('SGD', True, 8.0)
      >>> new["dynamic_growth_steps"]
      3
    """
    config = dict(config)
    if "loss_scale" not in config:
        return config
    loss_scale = config.pop("loss_scale")
    if "optimizer" in config:
        config["inner_optimizer"] = config.pop("optimizer")
    if not isinstance(loss_scale, Mapping) or "class_name" not in loss_scale:
        raise ValueError(
            "Cannot deserialize LossScaleOptimizer: its 'loss_scale' must be a serialized "
            f"FixedLossScale or DynamicLossScale, got {loss_scale!r}"
        )
    class_name, inner = loss_scale["class_name"], dict(loss_scale.get("config", {}))
    if class_name == "FixedLossScale":
        config.update(dynamic=False, initial_scale=inner.get("loss_scale_value"))
        return config
    if class_name != "DynamicLossScale":
        raise ValueError(
            "Cannot deserialize LossScaleOptimizer with a loss scale of class "
            f"{class_name!r}: only FixedLossScale and DynamicLossScale are supported"
        )
    if inner.get("multiplier", 2.0) != 2:
        described = ", ".join(f"{key}={value!r}" for key, value in inner.items())
        raise ValueError(
            "Cannot deserialize LossScaleOptimizer with a DynamicLossScale whose multiplier is "
            f"not 2. Got DynamicLossScale: DynamicLossScale({described}). Its multiplier is not 2 "
            "(only 2 is supported): LossScaleOptimizer's dynamic scale doubles and halves"
        )
    config.update(
        dynamic=True,
        initial_scale=inner.get("initial_loss_scale", DEFAULT_INITIAL_SCALE),
        dynamic_growth_steps=inner.get("increment_period", DEFAULT_GROWTH_STEPS),
    )
    for key in EXTENSION_DEFAULTS:
        if key in inner:
            config[key] = inner[key]
    return config


def extension_config(rule: DynamicRule | None, alarm: Any = None) -> dict[str, Any]:
    """The config keys of the extensions and of the stall alarm that differ from their
    defaults (TensorFlow's config dicts stay unchanged at the defaults): for every front end's
    ``get_config``. ``alarm`` is a :class:`lossscale.core.StallAlarm` or None.

    Example:
      >>> from lossscale.core import dynamic_rule, stall_alarm
      >>> from lossscale.core._settings import extension_config
      >>> extension_config(dynamic_rule(hysteresis=2), stall_alarm(None))
      {'hysteresis': 2, 'stall_steps': None}
    """
    from lossscale.core._stall import DEFAULT_STALL_STEPS

    config: dict[str, Any] = {}
    if rule is None:
        return config
    for key, default in EXTENSION_DEFAULTS.items():
        if getattr(rule, key) != default:
            config[key] = getattr(rule, key)
    if alarm is not None:
        if alarm.steps != DEFAULT_STALL_STEPS:
            config["stall_steps"] = alarm.steps
        if alarm.action != "warn":
            config["on_stall"] = alarm.action
    return config
