"""TensorFlow ≤ 2.3 ``LossScaleOptimizer`` configs, converted once for every front end.

TensorFlow 2.3 wrote ``{'optimizer': <inner>, 'loss_scale': <serialized LossScale>}``; TF 2.4+
writes ``{'inner_optimizer': <inner>, 'dynamic', 'initial_scale', 'dynamic_growth_steps'}`` and
still loads the old form by converting it. :func:`optimizer_config` is that conversion; each
front end's ``from_config`` calls it first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lossscale.core._settings import EXTENSION_DEFAULTS, loss_scale_settings

__all__ = ["optimizer_config"]


def optimizer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``LossScaleOptimizer`` config in TensorFlow 2.4+'s keys (a new dict).

    A TF ≤ 2.3 config (it has ``'loss_scale'``) is converted as TensorFlow 2.4+ does:
    ``'optimizer'`` becomes ``'inner_optimizer'``; a ``FixedLossScale`` becomes
    ``dynamic=False, initial_scale=<its value>``; a ``DynamicLossScale`` becomes
    ``dynamic=True`` with its initial scale and ``dynamic_growth_steps=<increment_period>``
    (lossscale's extension keys, when present and not at their defaults, carry over). Any
    other config is returned as a copy, unchanged. Pure host code.

    Raises:
      ValueError: a ``DynamicLossScale`` whose multiplier is not 2 (only 2 is supported, as
        TensorFlow), a loss scale that is neither fixed nor dynamic, or a config with both
        ``'optimizer'`` and ``'inner_optimizer'`` (or neither).
      TypeError: a loss-scale config with a wrong key or value type.

    Example:
      >>> from lossscale.core._legacy_config import optimizer_config
      >>> old = {"optimizer": {"class_name": "SGD", "config": {"lr": 0.1}},
      ...        "loss_scale": {"class_name": "DynamicLossScale",
      ...                       "config": {"initial_loss_scale": 1024.0,
      ...                                  "increment_period": 500, "multiplier": 2.0}}}
      >>> new = optimizer_config(old)
      >>> new["dynamic"], new["initial_scale"], new["dynamic_growth_steps"]
      (True, 1024.0, 500)
      >>> new["inner_optimizer"]["class_name"]
      'SGD'
    """
    config = dict(config)
    if "loss_scale" not in config:
        return config
    if ("optimizer" in config) == ("inner_optimizer" in config):
        raise ValueError(
            "a TensorFlow 2.3 LossScaleOptimizer config (it has 'loss_scale') names its inner "
            f"optimizer 'optimizer' (and not 'inner_optimizer'); got keys {sorted(config)}"
        )
    serialized = config.pop("loss_scale")
    inner = serialized.get("config") if isinstance(serialized, Mapping) else None
    if (
        isinstance(serialized, Mapping)
        and serialized.get("class_name") == "DynamicLossScale"
        and isinstance(inner, Mapping)
        and inner.get("multiplier", 2.0) != 2
    ):
        raise ValueError(
            "Cannot deserialize LossScaleOptimizer with a DynamicLossScale whose multiplier is "
            f"not 2 (only 2 is supported). Got DynamicLossScale: {dict(inner)!r}"
        )
    settings = loss_scale_settings(serialized, name="loss_scale")
    config["inner_optimizer"] = config.pop("optimizer")
    config["dynamic"] = settings.dynamic
    config["initial_scale"] = settings.initial_scale
    rule = settings.rule
    config["dynamic_growth_steps"] = None if rule is None else rule.increment_period
    if rule is not None:
        for key, default in EXTENSION_DEFAULTS.items():
            if getattr(rule, key) != default:
                config[key] = getattr(rule, key)
    return config
