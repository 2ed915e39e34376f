"""lossscale's settings for verl's scaler, from environment variables (verl's config has no
place for them, and every Ray worker inherits the driver's environment)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

#: The variables, what each sets and how it is read: ``(variable, keyword, kind)``; ``kind`` is
#: ``float`` or ``int``. A variable that is unset or empty leaves the setting to verl (for
#: ``init_scale`` and ``growth_interval``, which verl passes) or to lossscale's default.
VARIABLES: tuple[tuple[str, str, type], ...] = (
    ("LOSSSCALE_INIT_SCALE", "init_scale", float),
    ("LOSSSCALE_GROWTH_INTERVAL", "growth_interval", int),
    ("LOSSSCALE_MIN_LOSS_SCALE", "min_loss_scale", float),
    ("LOSSSCALE_MAX_LOSS_SCALE", "max_loss_scale", float),
    ("LOSSSCALE_HYSTERESIS", "hysteresis", int),
)

#: The path of a float16 plan written by ``Float16Audit.save``.
PLAN_VARIABLE = "LOSSSCALE_PLAN"


class Settings(NamedTuple):
    """What the environment asks of verl's scaler.

    Attributes:
      scaler: keyword arguments for :class:`lossscale.torch.ShardedGradScaler`, only those
        whose variable is set (they override the arguments verl passes).
      plan: the plan file's path, or None.

    >>> import lossscale.verl
    >>> found = lossscale.verl.settings({"LOSSSCALE_MIN_LOSS_SCALE": "0.5"})
    >>> found.scaler, found.plan
    ({'min_loss_scale': 0.5}, None)
    """

    scaler: dict[str, Any]
    plan: str | None


def _parse(variable: str, text: str, kind: type) -> float | int:
    """``text`` as ``kind``; a ``ValueError`` naming the variable when it is not one."""
    try:
        if kind is int:
            return int(text, 10)
        value = float(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{variable}={text!r} is not {what}") from None
    if not math.isfinite(value):
        raise ValueError(f"{variable}={text!r} is not a finite number")
    return value


def read(environ: Mapping[str, str] | None = None) -> Settings:
    """Read lossscale's settings for verl from ``environ`` (default ``os.environ``).

    Only the syntax is checked here: a value that is not a number (or not an integer, for
    ``LOSSSCALE_GROWTH_INTERVAL`` and ``LOSSSCALE_HYSTERESIS``) raises ``ValueError`` naming
    the variable and its value. Ranges are the scaler's, checked when it is built
    (:func:`lossscale.verl.settings` checks both). Surrounding
    blanks are ignored; an empty value is unset. No host sync, no allocation.

    Returns:
      :class:`Settings`.
    """
    env = os.environ if environ is None else environ
    scaler: dict[str, Any] = {}
    for variable, keyword, kind in VARIABLES:
        text = env.get(variable, "").strip()
        if text:
            scaler[keyword] = _parse(variable, text, kind)
    plan = env.get(PLAN_VARIABLE, "").strip() or None
    return Settings(scaler, plan)


def variable_of(keyword: str) -> str:
    """The environment variable that sets ``keyword`` (``KeyError`` for another keyword)."""
    for variable, name, _ in VARIABLES:
        if name == keyword:
            return variable
    raise KeyError(keyword)
