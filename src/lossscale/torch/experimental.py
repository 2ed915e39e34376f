"""TensorFlow 2.3's experimental ``LossScaleOptimizer(optimizer, loss_scale)`` for torch."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lossscale.core._settings import (
    EXTENSION_DEFAULTS,
    loss_scale_settings,
)
from lossscale.core._stall import DEFAULT_STALL_STEPS
from lossscale.torch._optimizer import LossScaleOptimizer as _LossScaleOptimizer
from lossscale.torch._persistence import optimizer_from_config as _split_config

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
    * a serialized dict (``{'class_name': ..., 'config': ...}``) → read as that loss scale.

    A subclass of either class (a user's, with a logging hook, say) counts as that class, as
    TensorFlow checks with ``isinstance``; its base class's config is read. An instance of
    another ``LossScale`` subclass raises ``TypeError`` (TensorFlow: custom LossScale
    subclasses are no longer supported); anything else raises ``ValueError``. The
    conversion is :func:`lossscale.core.loss_scale_settings`, shared by every front end.
    The configs equal the non-experimental ones::

        LossScaleOptimizer(SGD, 'dynamic')               ≡ lossscale.torch.LossScaleOptimizer(SGD)
        LossScaleOptimizer(SGD, 123)                     ≡ (SGD, dynamic=False, initial_scale=123)
        LossScaleOptimizer(SGD, DynamicLossScale(2048, 500))
                                 ≡ (SGD, initial_scale=2048, dynamic_growth_steps=500)

    ``stall_steps``, ``on_stall``, ``process_group``, ``enabled`` and ``device_side_skip``
    (keyword-only) are the non-experimental class's.

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
        self,
        optimizer: torch.optim.Optimizer,
        loss_scale: Any,
        *,
        stall_steps: Any = DEFAULT_STALL_STEPS,
        on_stall: Any = "warn",
        process_group: Any = None,
        enabled: bool = True,
        device_side_skip: bool = False,
    ) -> None:
        settings = loss_scale_settings(loss_scale)
        alarm = {
            "stall_steps": stall_steps,
            "on_stall": on_stall,
            "enabled": enabled,
            "device_side_skip": device_side_skip,
        }
        if settings.rule is None:
            super().__init__(
                optimizer,
                dynamic=False,
                initial_scale=settings.initial_scale,
                **alarm,
                process_group=process_group,
            )
            return
        rule = settings.rule
        super().__init__(
            optimizer,
            initial_scale=settings.initial_scale,
            dynamic_growth_steps=rule.increment_period,
            **{key: getattr(rule, key) for key in EXTENSION_DEFAULTS},
            **alarm,
            process_group=process_group,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any], params: Iterable[Any]) -> LossScaleOptimizer:
        """Build from :meth:`get_config`'s dict over ``params``, as TensorFlow's
        ``LossScaleOptimizerV1.from_config``: the keys become a ``loss_scale``,
        ``DynamicLossScale(initial_scale, dynamic_growth_steps, 2)`` (with any extension keys)
        or ``FixedLossScale(initial_scale)``. A config without ``'dynamic'`` is a ``KeyError``
        (as TensorFlow). A TensorFlow ≤ 2.3 config (``{'optimizer': ..., 'loss_scale': ...}``)
        is converted first, as in :meth:`lossscale.torch.LossScaleOptimizer.from_config`.
        """
        inner, config = _split_config(config, params)  # TF <= 2.3's form too
        dynamic = config.pop("dynamic")  # KeyError when missing, as TensorFlow
        alarm = {
            key: config.pop(key)
            for key in ("stall_steps", "on_stall", "enabled", "device_side_skip")
            if key in config
        }
        if not dynamic:
            if config.get("dynamic_growth_steps") is not None:
                raise ValueError(
                    '"dynamic_growth_steps" must be None if "dynamic" is False, but got: '
                    f"{config['dynamic_growth_steps']!r}"
                )
            return cls(inner, config["initial_scale"], **alarm)
        loss_scale = {
            "class_name": "DynamicLossScale",
            "config": {
                "initial_loss_scale": config.pop("initial_scale", None) or 2.0**15,
                "increment_period": config.pop("dynamic_growth_steps", None) or 2000,
                **config,
            },
        }
        return cls(inner, loss_scale, **alarm)
