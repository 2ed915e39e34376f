"""The loss-scale state as a checkpoint dict: written and checked once for every front end.

``{'version': 1, 'class_name': 'DynamicLossScale', 'current_loss_scale': float,
'num_good_steps': int, 'num_nonfinite_steps': int}`` for a dynamic scale,
``{'version': 1, 'class_name': 'FixedLossScale', 'current_loss_scale': float}`` for a fixed one.
The stateful classes' ``state_dict()`` and the torch front ends' ``'loss_scale'`` entry are this
dict; :func:`read_scale_state` validates one against a configuration before anything loads it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from lossscale.core import _validation as v
from lossscale.core._rule import DynamicRule

#: Version of the dictionaries written by ``state_dict()``.
STATE_VERSION = 1
DYNAMIC_KEYS = ("current_loss_scale", "num_good_steps", "num_nonfinite_steps")
FIXED_KEYS = ("current_loss_scale",)


def scale_state_dict(scale: float, counters: tuple[int, int] | None = None) -> dict[str, Any]:
    """The checkpoint dict of a fixed (``counters`` None) or dynamic scale."""
    if counters is None:
        return {
            "version": STATE_VERSION,
            "class_name": "FixedLossScale",
            "current_loss_scale": scale,
        }
    return {
        "version": STATE_VERSION,
        "class_name": "DynamicLossScale",
        "current_loss_scale": scale,
        "num_good_steps": counters[0],
        "num_nonfinite_steps": counters[1],
    }


def _check_keys(state: Any, class_name: str, expected: tuple[str, ...]) -> dict[str, Any]:
    """A dict, this version and class, exactly these keys."""
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict written by state_dict(), got {state!r}")
    # Version and class first: a state of another class is named as such, not by the first
    # key it happens to lack.
    for key in ("version", "class_name"):
        if key not in state:
            what = "the state is empty" if not state else f"it has keys {sorted(map(str, state))}"
            raise ValueError(
                f"state is missing key {key!r} ({what}): load a {class_name}.state_dict(), "
                f"a dict with keys {sorted(['version', 'class_name', *expected])}"
            )
    if state["version"] != STATE_VERSION or isinstance(state["version"], bool):
        raise ValueError(
            f"state['version'] is {state['version']!r}; this lossscale reads version "
            f"{STATE_VERSION}"
        )
    if state["class_name"] != class_name:
        raise ValueError(
            f"state['class_name'] is {state['class_name']!r}, cannot load it into a {class_name}"
        )
    for key in expected:
        if key not in state:
            raise ValueError(f"state is missing key {key!r} (expected keys: {sorted(expected)})")
    extra = sorted(set(state) - {"version", "class_name", *expected})
    if extra:
        raise ValueError(f"state has unexpected key {extra[0]!r}")
    return state


def _scale(state: dict[str, Any]) -> float:
    value = state["current_loss_scale"]
    if not v.is_real_number(value):
        raise ValueError(f"state['current_loss_scale'] must be a float, got {value!r}")
    scale = float(value)
    if not (math.isfinite(scale) and v.FLOAT32_TINY <= v.as_float32(scale) < math.inf):
        raise ValueError(
            f"state['current_loss_scale'] must be a finite normal float32 > 0, got {value!r}"
        )
    return scale


def _counter(state: dict[str, Any], key: str, bound: int, bound_name: str) -> int:
    value = state[key]
    # Any integer but a bool: np.int64 is what a state round-tripped through NumPy holds.
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, numbers.Integral)
        or not 0 <= int(value) < bound
    ):
        raise ValueError(
            f"state[{key!r}] must be an int in [0, {bound_name}={bound}), got {value!r}"
        )
    return int(value)


def read_dynamic_state(state: Any, rule: DynamicRule) -> tuple[float, int, int]:
    """Check a dynamic scale's checkpoint dict against ``rule``; return (scale, good, nonfinite).

    Raises:
      ValueError: naming the key, for a state that is not a dict, has another version or
        class, misses or adds a key, has a wrong type, a scale that is not a finite normal
        float32 > 0 or exceeds ``max_loss_scale``, or a counter outside
        ``[0, increment_period)`` / ``[0, hysteresis)``.

    Example:
      >>> from lossscale.core import dynamic_rule
      >>> from lossscale.core._checkpoint import read_dynamic_state, scale_state_dict
      >>> read_dynamic_state(scale_state_dict(1024.0, (5, 0)), dynamic_rule())
      (1024.0, 5, 0)
    """
    _check_keys(state, "DynamicLossScale", DYNAMIC_KEYS)
    scale = _scale(state)
    if v.as_float32(scale) > v.as_float32(rule.max_loss_scale):
        raise ValueError(
            f"state['current_loss_scale']={scale!r} exceeds this object's "
            f"max_loss_scale={rule.max_loss_scale!r}"
        )
    good = _counter(state, "num_good_steps", rule.increment_period, "increment_period")
    nonfinite = _counter(state, "num_nonfinite_steps", rule.hysteresis, "hysteresis")
    return scale, good, nonfinite


def read_fixed_state(state: Any, value: float) -> None:
    """Check a fixed scale's checkpoint dict: well formed and holding ``value``.

    Raises:
      ValueError: naming the key, for a malformed state, one of another class, or another
        value (a fixed scale cannot change).
    """
    _check_keys(state, "FixedLossScale", FIXED_KEYS)
    scale = _scale(state)
    if scale != value:
        raise ValueError(
            f"state['current_loss_scale'] is {scale!r} but this FixedLossScale is "
            f"{value!r}; a fixed scale cannot change"
        )
