"""``get``, ``serialize`` and ``deserialize``: TensorFlow's (Keras) rules and dict format."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from lossscale.core._validation import is_real_number
from lossscale.stateful._loss_scale import DynamicLossScale, FixedLossScale, LossScale

_BUILTIN: dict[str, type[LossScale]] = {
    "FixedLossScale": FixedLossScale,
    "DynamicLossScale": DynamicLossScale,
}
#: Top-level keys that tf_keras / Keras 3 serialization adds beside class_name and config.
_IGNORED_KEYS = frozenset({"module", "registered_name"})


def serialize(loss_scale: LossScale) -> dict[str, Any]:
    """``{'class_name': ..., 'config': loss_scale.get_config()}`` (TensorFlow's format).

    Example:
      >>> import lossscale
      >>> config = lossscale.serialize(lossscale.DynamicLossScale(1, 2, 3))
      >>> config["class_name"], config["config"]["increment_period"]
      ('DynamicLossScale', 2)
    """
    if not isinstance(loss_scale, LossScale):
        raise TypeError(f"loss_scale must be a lossscale.LossScale, got {loss_scale!r}")
    return {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}


def deserialize(
    config: Any, custom_objects: Mapping[str, type[LossScale]] | None = None
) -> LossScale:
    """A new loss scale from ``serialize``'s dict; a config written by TensorFlow loads unchanged.

    Args:
      config: ``{'class_name': 'FixedLossScale' | 'DynamicLossScale', 'config': {...}}``
        (tf_keras' extra ``'module'``/``'registered_name'`` keys are ignored), or a bare class
        name string, which constructs that class with its defaults.
      custom_objects: extra ``{class_name: LossScale subclass}`` to recognise.

    Raises:
      ValueError: an unknown class name, a dict without ``'config'``, or (from the
        constructor) a value out of range.
      TypeError: ``config`` is neither a dict nor a string, or a constructor argument is of the
        wrong type or unknown.

    Example:
      >>> import lossscale
      >>> lossscale.deserialize({"class_name": "FixedLossScale", "config": {"loss_scale_value": 8}})
      FixedLossScale(8.0)
    """
    classes = dict(_BUILTIN)
    if custom_objects:
        classes.update(custom_objects)
    if isinstance(config, str):
        cls = _lookup(config, classes)
        return cls()
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict or a class name string, got {config!r}")
    if "class_name" not in config or "config" not in config:
        raise ValueError(
            f"Improper config format: expected {{'class_name': ..., 'config': {{...}}}}, "
            f"got {dict(config)!r}"
        )
    extra = sorted(set(config) - {"class_name", "config"} - _IGNORED_KEYS)
    if extra:
        raise ValueError(f"Improper config format: unexpected key {extra[0]!r} in {dict(config)!r}")
    inner = config["config"]
    if not isinstance(inner, Mapping):
        raise TypeError(f"config['config'] must be a dict, got {inner!r}")
    cls = _lookup(config["class_name"], classes)
    return cls.from_config(dict(inner))


def _lookup(name: Any, classes: dict[str, type[LossScale]]) -> type[LossScale]:
    cls = classes.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"Unknown loss scale: {name!r}. Known: {sorted(classes)}; pass other LossScale "
            f"subclasses in custom_objects"
        )
    return cls


def get(identifier: Any) -> LossScale | None:
    """A loss scale from an identifier, by TensorFlow's rules, checked in this order.

    * a number (Python int/float or NumPy real scalar) → ``FixedLossScale(number)`` (a bool
      raises its ``TypeError``);
    * the string ``'dynamic'`` (case-sensitive) → ``DynamicLossScale()`` with defaults;
    * a :class:`LossScale` → itself;
    * a dict → :func:`deserialize` (TensorFlow's Keras variant);
    * ``None`` → ``None``.

    Anything else raises ``ValueError('Could not interpret loss scale identifier: ...')``,
    TensorFlow's message, followed by the forms above.

    Example:
      >>> import lossscale
      >>> lossscale.get(128), lossscale.get("dynamic").increment_period
      (FixedLossScale(128.0), 2000)
    """
    if is_real_number(identifier) or isinstance(identifier, bool | np.bool_):
        return FixedLossScale(identifier)  # a bool is a TypeError there (TF took True as 1.0)
    if isinstance(identifier, str) and identifier == "dynamic":
        return DynamicLossScale()
    if isinstance(identifier, LossScale):
        return identifier
    if isinstance(identifier, Mapping):
        return deserialize(identifier)
    if identifier is None:
        return None
    hint = ""
    if isinstance(identifier, str):
        try:
            float(identifier)
            hint = f" (a fixed scale is a number: {identifier} rather than {identifier!r})"
        except ValueError:
            if identifier.lower() == "dynamic":
                hint = " ('dynamic' is lower-case)"
    raise ValueError(
        f"Could not interpret loss scale identifier: {identifier!r}. get() accepts a number "
        "(a fixed scale), the string 'dynamic', a LossScale, a serialized loss scale dict "
        f"({{'class_name': ..., 'config': {{...}}}}) or None{hint}"
    )
