"""Checkpoints and configs of the torch front ends, validated before anything is loaded.

``LossScaleOptimizer``: torch's ``state_dict`` / ``load_state_dict`` (the inner optimizer's
state plus the loss scale's) and TensorFlow's ``get_config`` / ``from_config``.
``GradScaler`` / ``ShardedGradScaler``: torch's keys, so that checkpoints load both ways with
torch's scalers. Either front end also reads the other's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from lossscale.core._checkpoint import read_dynamic_state, scale_state_dict
from lossscale.core._rule import DynamicRule, dynamic_rule
from lossscale.core._settings import ScaleSettings, extension_config, upgrade_optimizer_config
from lossscale.core._stall import StallAlarm
from lossscale.core._warnings import warn_user
from lossscale.torch._state import AnyScale, DisabledScale, DynamicScale, FixedScale

#: The keys of an enabled ``torch.amp.GradScaler``'s ``state_dict()``.
GRAD_SCALER_KEYS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
)
#: The extra key of lossscale's scaler state dicts (torch's GradScaler ignores it).
OWN_KEY = "lossscale"
#: GradScaler's names for the core rule's arguments.
SCALER_NAMES = {
    "increment_period": "growth_interval",
    "dynamic_growth_steps": "growth_interval",
    "multiplier": "growth_factor",
    "initial_scale": "init_scale",
}


class GradScalerState(NamedTuple):
    """A ``torch.amp.GradScaler`` checkpoint, checked (see :func:`read_grad_scaler_state`)."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    growth_tracker: int


def is_grad_scaler_state(state: Any) -> bool:
    """Whether ``state`` looks like a ``torch.amp.GradScaler`` state dict (its keys), including
    the empty dict a disabled GradScaler writes."""
    return isinstance(state, dict) and (state == {} or set(GRAD_SCALER_KEYS) <= set(state))


def read_grad_scaler_state(state: Any) -> GradScalerState:
    """Check a ``torch.amp.GradScaler`` state dict; nothing is loaded here.

    Raises:
      ValueError: the empty state of a disabled GradScaler (torch's own raises RuntimeError),
        a missing key, or a value torch could not have written, naming the key. A
        ``LossScaleOptimizer`` loss-scale state gets a message saying how to load it.
    """
    if state == {}:
        raise ValueError(
            "the GradScaler state is empty: it was saved from a disabled GradScaler "
            "(enabled=False), which has no loss-scale state to load; start from this object's "
            "own initial scale instead, or save the state from an enabled GradScaler"
        )
    if not isinstance(state, dict):
        raise ValueError(f"a GradScaler state must be a dict, got {state!r}")
    for key in GRAD_SCALER_KEYS:
        if key not in state:
            raise ValueError(f"GradScaler state is missing key {key!r}")

    def number(key: str) -> float:
        value = state[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"state[{key!r}] must be a number, got {value!r}")
        return float(value)

    scale = number("scale")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"state['scale'] must be finite and > 0, got {state['scale']!r}")
    growth, backoff = number("growth_factor"), number("backoff_factor")
    interval, tracker = number("growth_interval"), number("_growth_tracker")
    if interval != int(interval) or interval < 1:
        raise ValueError(f"state['growth_interval'] must be an int >= 1, got {interval!r}")
    if tracker != int(tracker) or tracker < 0:
        raise ValueError(f"state['_growth_tracker'] must be an int >= 0, got {tracker!r}")
    return GradScalerState(scale, growth, backoff, int(interval), int(tracker))


# -- GradScaler ---------------------------------------------------------------------------------
def scaler_state_dict(ls: DynamicScale) -> dict[str, Any]:
    """torch's keys plus ``'lossscale'`` (the hysteresis counter and skipped steps), from one
    read of the state (a host sync on a GPU after device-side steps)."""
    scale, good, nonfinite, skipped, _ = ls.read()
    rule = ls.rule
    return {
        "scale": scale,
        "growth_factor": rule.multiplier,
        "backoff_factor": rule.backoff_factor,
        "growth_interval": rule.increment_period,
        "_growth_tracker": good,
        OWN_KEY: {"version": 1, "nonfinite_steps": nonfinite, "skipped_steps": skipped},
    }


def _skipped(value: Any, key: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{key} must be an int >= 0, got {value!r}")
    return value


def load_scaler_state(ls: DynamicScale, state_dict: Any) -> None:
    """Load a scaler checkpoint into ``ls`` (see ``GradScaler.load_state_dict``): a
    ``torch.amp.GradScaler`` or lossscale scaler state (scale, growth counter, factors,
    interval), or a ``LossScaleOptimizer`` state or its ``'loss_scale'`` entry (scale and
    counters, and its skipped steps; this scaler's factors kept). Everything is checked before
    anything changes."""
    skipped = None
    if isinstance(state_dict, dict) and "loss_scale" in state_dict and "scale" not in state_dict:
        # a LossScaleOptimizer.state_dict(): its loss scale and skipped steps
        skipped = _skipped(state_dict.get("skipped_steps"), "state_dict['skipped_steps']")
        state_dict = state_dict["loss_scale"]
    if isinstance(state_dict, dict) and "current_loss_scale" in state_dict:
        scale, good, nonfinite = read_dynamic_state(state_dict, ls.rule)
        ls.load(scale, good, nonfinite)
        if skipped is not None:
            ls.set_skipped(skipped)
        return
    sd = read_grad_scaler_state(state_dict)
    base = ls.rule
    rule = dynamic_rule(
        sd.growth_interval,
        sd.growth_factor,
        min_loss_scale=base.min_loss_scale,
        max_loss_scale=base.max_loss_scale,
        hysteresis=base.hysteresis,
        backoff_factor=sd.backoff_factor,
        hysteresis_refill=base.hysteresis_refill,
        names={key: f"state_dict[{name!r}]" for key, name in SCALER_NAMES.items()},
    )
    own = state_dict.get(OWN_KEY, {})
    nonfinite = own.get("nonfinite_steps", 0)
    skipped = _skipped(own.get("skipped_steps"), "state_dict['lossscale']['skipped_steps']")
    good = min(sd.growth_tracker, rule.increment_period - 1)
    scale, good, nonfinite = read_dynamic_state(scale_state_dict(sd.scale, (good, nonfinite)), rule)
    ls.set_rule(rule)
    ls.load(scale, good, nonfinite)
    if skipped is not None:
        ls.set_skipped(skipped)


# -- LossScaleOptimizer -------------------------------------------------------------------------
def optimizer_state_dict(inner: torch.optim.Optimizer, ls: AnyScale) -> dict[str, Any]:
    """``inner``'s state dict plus ``'loss_scale'`` and ``'skipped_steps'`` (one read of the
    loss-scale state); ``inner``'s alone when disabled."""
    sd = inner.state_dict()
    if isinstance(ls, DynamicScale):
        values = ls.read()
        sd["loss_scale"] = ls.state_dict(values)
        sd["skipped_steps"] = values[3]
    elif isinstance(ls, FixedScale):
        sd["loss_scale"] = ls.state_dict()
        sd["skipped_steps"] = 0
    return sd


class Checked(NamedTuple):
    """A validated optimizer state dict: ``inner`` for the inner optimizer, then
    ``load_scale()`` to set the loss-scale part (after the inner one loaded)."""

    inner: dict[str, Any]
    load_scale: Callable[[], None]


def split_optimizer_state(ls: AnyScale, state_dict: Any) -> Checked | None:
    """Validate ``state_dict`` and split it (see ``LossScaleOptimizer.load_state_dict``).

    A ``torch.amp.GradScaler`` state is loaded into ``ls`` here and None is returned; otherwise
    nothing has changed yet when this returns.

    Raises:
      TypeError: ``state_dict`` is not a dict.
      ValueError: a malformed loss-scale part, naming the key.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {state_dict!r}")
    if is_grad_scaler_state(state_dict):
        if not isinstance(ls, DisabledScale):
            _load_grad_scaler(ls, read_grad_scaler_state(state_dict), state_dict.get(OWN_KEY))
        return None
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing:
        if any(key in state_dict for key in GRAD_SCALER_KEYS):
            read_grad_scaler_state(state_dict)  # a GradScaler state: names its missing key
        raise ValueError(
            f"state_dict has no {missing[-1]!r}: a LossScaleOptimizer state is a torch.optim "
            "state dict ('state', 'param_groups') plus 'loss_scale' and 'skipped_steps', as "
            f"state_dict() writes it; got the keys {sorted(state_dict)}. A GradScaler "
            "state_dict loads on its own (the loss scale only)."
        )
    rest = dict(state_dict)
    ls_state = rest.pop("loss_scale", None)
    skipped = _skipped(rest.pop("skipped_steps", None), "state_dict['skipped_steps']")
    if isinstance(ls, DisabledScale):
        return Checked(rest, lambda: None)
    loaded = None
    if ls_state is not None:
        loaded = ls.check_state_dict(ls_state)  # on the host

    def load_scale() -> None:
        if isinstance(ls, DynamicScale):
            if loaded is not None:
                ls.load(*loaded)
            if skipped is not None:
                ls.set_skipped(skipped)

    return Checked(rest, load_scale)


def _load_grad_scaler(ls: FixedScale | DynamicScale, sd: GradScalerState, own: Any) -> None:
    """A GradScaler checkpoint's scale and growth tracker, and (``own``: a lossscale scaler's
    ``'lossscale'`` entry) its hysteresis counter and skipped steps; its factors and interval
    are not this optimizer's (warned when they differ). Checked before anything is loaded."""
    if not isinstance(ls, DynamicScale):
        raise ValueError("a GradScaler state can only be loaded into a dynamic LossScaleOptimizer")
    own = own if isinstance(own, dict) else {}
    skipped = _skipped(own.get("skipped_steps"), "state_dict['lossscale']['skipped_steps']")
    rule = ls.rule
    good = min(sd.growth_tracker, rule.increment_period - 1)
    counters = (good, own.get("nonfinite_steps", 0))
    scale, good, nonfinite = ls.check_state_dict(scale_state_dict(sd.scale, counters))
    if sd.growth_factor != 2.0 or sd.backoff_factor != 0.5:
        warn_user(
            f"GradScaler state has growth_factor={sd.growth_factor!r} and "
            f"backoff_factor={sd.backoff_factor!r}; this optimizer keeps its multiplier "
            f"2.0 (TensorFlow's)",
            UserWarning,
        )
    if sd.growth_interval != rule.increment_period:
        warn_user(
            f"GradScaler state has growth_interval={sd.growth_interval!r}; this "
            f"optimizer keeps dynamic_growth_steps={rule.increment_period}",
            UserWarning,
        )
    ls.load(scale, good, nonfinite)
    if skipped is not None:
        ls.set_skipped(skipped)


def optimizer_config(
    inner: torch.optim.Optimizer,
    settings: ScaleSettings,
    alarm: StallAlarm,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """TensorFlow's config keys, then the non-default extensions and ``extra`` (the front
    end's own non-default keyword arguments)."""
    rule: DynamicRule | None = settings.rule
    out: dict[str, Any] = {
        "inner_optimizer": {"class_name": type(inner).__name__, "config": dict(inner.defaults)},
        "dynamic": settings.dynamic,
        "initial_scale": settings.initial_scale,
        "dynamic_growth_steps": None if rule is None else rule.increment_period,
    }
    out.update(extension_config(rule, alarm))
    out.update(extra)
    return out


def optimizer_from_config(
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
