"""Checkpoints and configs of :class:`~lossscale.torch.LossScaleOptimizer`.

torch's ``state_dict`` / ``load_state_dict`` (the inner optimizer's state plus the loss
scale's, or a ``torch.amp.GradScaler`` state) and TensorFlow's ``get_config`` /
``from_config``, over the engine's :class:`~lossscale.torch._engine.ScaleState` and the core's
checkpoint and settings helpers. Everything is validated before anything is loaded.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import torch

from lossscale.core._checkpoint import scale_state_dict
from lossscale.core._settings import ScaleSettings, extension_config, upgrade_optimizer_config
from lossscale.core._stall import StallAlarm
from lossscale.torch import _engine as engine


def state_dict(inner: torch.optim.Optimizer, ls: engine.ScaleState | None) -> dict[str, Any]:
    """``inner``'s state dict plus ``'loss_scale'`` and ``'skipped_steps'`` (one read of the
    loss-scale state, free in its host home); ``inner``'s alone when disabled (``ls`` None)."""
    sd = inner.state_dict()
    if ls is None:
        return sd  # disabled: a plain torch.optim state (an enabled one keeps its scale)
    if ls.dynamic:
        values = ls.read(stacklevel=3)  # here, LossScaleOptimizer.state_dict, the user
        sd["loss_scale"] = ls.state_dict(values)
        sd["skipped_steps"] = values[3]
    else:
        sd["loss_scale"] = ls.state_dict()
        sd["skipped_steps"] = 0
    return sd


class Checked(NamedTuple):
    """A validated optimizer state dict: ``inner`` for the inner optimizer, then
    ``load_scale()`` to set the loss-scale part (after the inner one loaded)."""

    inner: dict[str, Any]
    load_scale: Callable[[], None]


def load_state_dict(ls: engine.ScaleState | None, state_dict: Any) -> Checked | None:
    """Validate ``state_dict`` and split it (see :meth:`LossScaleOptimizer.load_state_dict`).

    A ``torch.amp.GradScaler`` state is loaded into ``ls`` here and None is returned; otherwise
    nothing has changed yet when this returns.

    Raises:
      TypeError: ``state_dict`` is not a dict.
      ValueError: a malformed loss-scale part, naming the key.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {state_dict!r}")
    if engine.is_grad_scaler_state(state_dict):
        if ls is not None:
            _load_grad_scaler(ls, engine.read_grad_scaler_state(state_dict))
        return None
    rest = dict(state_dict)
    ls_state = rest.pop("loss_scale", None)
    skipped = rest.pop("skipped_steps", None)
    if ls is None:
        ls_state = skipped = None
    loaded = None
    if ls_state is not None:
        loaded = cast(engine.ScaleState, ls).check_state_dict(ls_state)  # on the host
    if skipped is not None and (
        isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0
    ):
        raise ValueError(f"state_dict['skipped_steps'] must be an int >= 0, got {skipped!r}")

    def load_scale() -> None:
        if loaded is not None:
            cast(engine.ScaleState, ls).load(*loaded)
        if skipped is not None:
            cast(engine.ScaleState, ls).set_skipped(skipped)

    return Checked(rest, load_scale)


def _load_grad_scaler(ls: engine.ScaleState, sd: engine.GradScalerState) -> None:
    """A GradScaler checkpoint's scale and growth tracker; its factors and interval are not
    this optimizer's (warned when they differ)."""
    rule = ls.rule
    if rule is None:
        raise ValueError("a GradScaler state can only be loaded into a dynamic LossScaleOptimizer")
    scale, good, bad = ls.check_state_dict(
        scale_state_dict(sd.scale, (min(sd.growth_tracker, rule.increment_period - 1), 0))
    ) or (sd.scale, 0, 0)
    if sd.growth_factor != 2.0 or sd.backoff_factor != 0.5:
        warnings.warn(
            f"GradScaler state has growth_factor={sd.growth_factor!r} and "
            f"backoff_factor={sd.backoff_factor!r}; this optimizer keeps its multiplier "
            f"2.0 (TensorFlow's)",
            UserWarning,
            stacklevel=4,
        )
    if sd.growth_interval != rule.increment_period:
        warnings.warn(
            f"GradScaler state has growth_interval={sd.growth_interval!r}; this "
            f"optimizer keeps dynamic_growth_steps={rule.increment_period}",
            UserWarning,
            stacklevel=4,
        )
    ls.load(scale, good, bad)


def config(
    inner: torch.optim.Optimizer,
    settings: ScaleSettings,
    alarm: StallAlarm,
    enabled: bool,
) -> dict[str, Any]:
    """TensorFlow's config keys, then the non-default extensions (see ``get_config``)."""
    rule = settings.rule
    out: dict[str, Any] = {
        "inner_optimizer": {"class_name": type(inner).__name__, "config": dict(inner.defaults)},
        "dynamic": settings.dynamic,
        "initial_scale": settings.initial_scale,
        "dynamic_growth_steps": None if rule is None else rule.increment_period,
    }
    out.update(extension_config(rule, alarm))
    if not enabled:
        out["enabled"] = False
    return out


def from_config(
    config: dict[str, Any], params: Iterable[Any]
) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    """The inner optimizer over ``params`` and the constructor's other arguments, from a
    ``get_config`` dict (or TensorFlow <= 2.3's form, upgraded as TensorFlow 2.4+ does)."""
    config = upgrade_optimizer_config(config)
    inner_cfg = config.pop("inner_optimizer")
    inner_cls = getattr(torch.optim, inner_cfg["class_name"], None)
    if not (isinstance(inner_cls, type) and issubclass(inner_cls, torch.optim.Optimizer)):
        raise ValueError(f"unknown torch.optim optimizer {inner_cfg['class_name']!r}")
    return inner_cls(params, **inner_cfg["config"]), config
