"""TensorFlow 2.3's experimental ``LossScaleOptimizer(optimizer, loss_scale)`` for Keras 3."""

from __future__ import annotations

from typing import Any

import keras

from lossscale.core._settings import loss_scale_settings
from lossscale.core._stall import DEFAULT_STALL_STEPS
from lossscale.keras._optimizer import LossScaleOptimizer as _LossScaleOptimizer

__all__ = ["LossScaleOptimizer"]


@keras.saving.register_keras_serializable(package="lossscale.experimental")
class LossScaleOptimizer(_LossScaleOptimizer):
    """The experimental form: ``loss_scale`` is ``"dynamic"``, a number (a fixed scale), a
    lossscale ``FixedLossScale`` / ``DynamicLossScale`` (multiplier 2; subclasses included, as
    TensorFlow's ``isinstance``) or a serialized one, converted by
    :func:`lossscale.core.loss_scale_settings` (TensorFlow's rules; another ``LossScale``
    subclass is a ``TypeError``). Its config is the non-experimental one.

    Example:
      >>> import keras
      >>> from lossscale.keras import experimental
      >>> opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), 128)
      >>> opt.dynamic, opt.initial_scale
      (False, 128.0)
    """

    def __init__(
        self,
        optimizer: Any,
        loss_scale: Any,
        *,
        stall_steps: Any = DEFAULT_STALL_STEPS,
        on_stall: Any = "warn",
        name: str | None = None,
    ) -> None:
        settings = loss_scale_settings(loss_scale)
        self._setup(optimizer, settings, stall_steps, on_stall, name, {})

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """A config of this form loads as the non-experimental class (as TensorFlow)."""
        return _LossScaleOptimizer.from_config(config, custom_objects)
