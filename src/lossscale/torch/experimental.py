"""TensorFlow 2.3's experimental ``LossScaleOptimizer(optimizer, loss_scale)`` for torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lossscale.core._validation import is_real_number
from lossscale.stateful._loss_scale import DynamicLossScale, FixedLossScale, optimizer_loss_scale
from lossscale.stateful._serialization import deserialize
from lossscale.torch._optimizer import LossScaleOptimizer as _LossScaleOptimizer
from lossscale.torch._optimizer import _inner_from_config

__all__ = ["LossScaleOptimizer"]


class LossScaleOptimizer(_LossScaleOptimizer):
    """The experimental form: the loss scale given as one ``loss_scale`` argument.

    A subclass of :class:`lossscale.torch.LossScaleOptimizer` (not the reverse), converting
    ``loss_scale`` as TensorFlow's ``LossScaleOptimizerV1`` does:

    * an int/float, or a :class:`lossscale.FixedLossScale` → ``dynamic=False,
      initial_scale=value``;
    * ``'dynamic'`` → the defaults (dynamic, 2**15, 2000);
    * a :class:`lossscale.DynamicLossScale` → ``initial_scale`` and ``dynamic_growth_steps``
      from its ``initial_loss_scale`` and ``increment_period`` (its extensions carried over);
      its multiplier must be 2 (``ValueError`` otherwise);
    * a serialized dict (``{'class_name': ..., 'config': ...}``) → deserialized first.

    Anything else raises ``ValueError``. The configs equal the non-experimental ones::

        LossScaleOptimizer(SGD, 'dynamic')               ≡ lossscale.torch.LossScaleOptimizer(SGD)
        LossScaleOptimizer(SGD, 123)                     ≡ (SGD, dynamic=False, initial_scale=123)
        LossScaleOptimizer(SGD, DynamicLossScale(2048, 500))
                                 ≡ (SGD, initial_scale=2048, dynamic_growth_steps=500)

    ``process_group`` (keyword-only) is the non-experimental class's.

    >>> import torch
    >>> import lossscale
    >>> from lossscale.torch import experimental
    >>> params = [torch.nn.Parameter(torch.ones(2))]
    >>> opt = experimental.LossScaleOptimizer(
    ...     torch.optim.SGD(params, lr=0.1), lossscale.DynamicLossScale(2048, 500))
    >>> opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps
    (True, 2048.0, 500)
    >>> fixed = experimental.LossScaleOptimizer(torch.optim.SGD(params, lr=0.1), 123)
    >>> fixed.dynamic, fixed.initial_scale, fixed.dynamic_growth_steps
    (False, 123.0, None)
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, loss_scale: Any, *, process_group: Any = None
    ) -> None:
        if isinstance(loss_scale, Mapping):
            loss_scale = deserialize(loss_scale)
        if is_real_number(loss_scale):
            super().__init__(
                optimizer,
                dynamic=False,
                initial_scale=float(loss_scale),
                process_group=process_group,
            )
        elif isinstance(loss_scale, FixedLossScale):
            value = loss_scale.get_config()["loss_scale_value"]
            super().__init__(
                optimizer, dynamic=False, initial_scale=value, process_group=process_group
            )
        elif isinstance(loss_scale, str) and loss_scale == "dynamic":
            super().__init__(optimizer, process_group=process_group)
        elif isinstance(loss_scale, DynamicLossScale):
            if loss_scale.multiplier != 2:
                raise ValueError(
                    'When passing a DynamicLossScale to "loss_scale", DynamicLossScale.multiplier '
                    f"must be 2. Got: {loss_scale!r}"
                )
            super().__init__(
                optimizer,
                initial_scale=loss_scale.initial_loss_scale,
                dynamic_growth_steps=loss_scale.increment_period,
                min_loss_scale=loss_scale.min_loss_scale,
                max_loss_scale=loss_scale.max_loss_scale,
                hysteresis=loss_scale.hysteresis,
                process_group=process_group,
            )
        else:
            raise ValueError(
                'Invalid value passed to loss_scale. loss_scale must be the string "dynamic" '
                "(recommended), an int, a float, a FixedLossScale, a DynamicLossScale or a "
                f"serialized loss scale dict. Got value: {loss_scale!r}"
            )

    @classmethod
    def from_config(cls, config: dict[str, Any], params: Iterable[Any]) -> LossScaleOptimizer:
        """Build from :meth:`get_config`'s dict over ``params``, as TensorFlow's
        ``LossScaleOptimizerV1.from_config``: the keys become a ``loss_scale``,
        ``DynamicLossScale(initial_scale, dynamic_growth_steps, 2)`` (with any extension keys)
        or ``FixedLossScale(initial_scale)``. A config without ``'dynamic'`` is a ``KeyError``
        (as TensorFlow).
        """
        config = dict(config)
        inner = _inner_from_config(config.pop("inner_optimizer"), params)
        dynamic = config.pop("dynamic")  # KeyError when missing, as TensorFlow
        loss_scale = optimizer_loss_scale(dynamic, **config)
        return cls(inner, loss_scale)
