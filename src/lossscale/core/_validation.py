"""Argument checks shared by every class and adapter: clear errors, named argument and value.

TensorFlow converts its arguments with ``float()``/``int()`` and checks no ranges; lossscale
rejects what could only produce a wrong or degenerate run (see "Differences from TensorFlow"
in the documentation). Types are checked first (``TypeError``), then values (``ValueError``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

#: The largest finite float32, the default ``max_loss_scale``.
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The smallest normal float32: scales below it are subnormal, which TensorFlow's CPU kernels
#: flush to zero (so no trajectory through them can be TF-exact).
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def is_real_number(value: Any) -> bool:
    """Python int/float and NumPy real scalars; not bool, complex, strings or arrays."""
    if isinstance(value, bool | np.bool_):
        return False
    return isinstance(value, numbers.Real) and not isinstance(value, np.ndarray)


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as a Python float (overflow gives inf, without a warning)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def real(name: str, value: Any) -> float:
    """Check ``value`` is a real number (TypeError otherwise) and return it as a Python float."""
    if not is_real_number(value):
        raise TypeError(f"{name} must be a real number (int or float), got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range, e.g. 2**1024
        raise ValueError(f"{name}={value!r} is too large for a float") from None


def positive_float32(name: str, value: Any) -> float:
    """A real number, finite and > 0, that is a finite normal float32 once rounded."""
    v = real(name, value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    f32 = as_float32(v)
    if math.isinf(f32):
        raise ValueError(
            f"{name}={value!r} overflows float32 (largest {FLOAT32_MAX!r}); "
            "the scale lives in float32"
        )
    if f32 == 0:
        raise ValueError(f"{name}={value!r} rounds to 0 in float32; the scale lives in float32")
    if f32 < FLOAT32_TINY:
        raise ValueError(
            f"{name}={value!r} is subnormal in float32 (smallest normal {FLOAT32_TINY!r}); "
            "the scale lives in float32, where TensorFlow flushes subnormals to zero"
        )
    return v


def scale_at_most(name: str, value: Any, maximum: float, maximum_name: str) -> float:
    """A scale: :func:`positive_float32`, and at most ``maximum`` once both are rounded to
    float32 (ValueError naming both otherwise)."""
    scale = positive_float32(name, value)
    if as_float32(scale) > as_float32(maximum):
        raise ValueError(f"{name}={value!r} exceeds {maximum_name}={maximum!r}")
    return scale


def integer(name: str, value: Any, minimum: int) -> int:
    """An int (not bool, not a float, not a string) that is at least ``minimum``."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= {minimum}, got {value!r} of type {type(value).__name__}"
        )
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


def boolean(name: str, value: Any) -> bool:
    """Exactly a Python bool (as TensorFlow's ``dynamic`` check)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def finite_flag(name: str, value: Any) -> None:
    """Check a step's finite flag: a Python/NumPy bool or a 0-d bool array of any library.

    A flag of another dtype (a float ``0.5``, an int) would be read as truthy and a flag with
    a shape would turn the scale and the counters into vectors, silently; both are refused.
    Only the dtype and the shape are read (no device work, no sync), so the check also holds
    while tracing (``jax.jit``, ``torch.compile``).

    Raises:
      TypeError: ``value`` is not a bool or a bool array (naming ``name`` and the dtype).
      ValueError: ``value`` has a shape.
    """
    if isinstance(value, (bool, np.bool_)):  # a tuple: torch.compile traces no `X | Y` here
        return
    dtype, ndim = getattr(value, "dtype", None), getattr(value, "ndim", None)
    if dtype is None or ndim is None:
        raise TypeError(
            f"{name} must be a bool or a 0-d bool array, got {value!r} of type "
            f"{type(value).__name__}"
        )
    # Read as text, whatever the library (NumPy and JAX: "bool"; torch: "torch.bool"), so that
    # core imports none and torch.compile traces it without a graph break.
    name_attr = getattr(dtype, "name", None)  # NumPy, JAX, TensorFlow: "bool"
    dtype_name = name_attr if isinstance(name_attr, str) else str(dtype).removeprefix("torch.")
    if dtype_name != "bool":
        raise TypeError(f"{name} must be a bool or a 0-d bool array, got dtype {dtype_name}")
    if ndim != 0:
        raise ValueError(
            f"{name} must be 0-d (one flag for the whole step), got shape "
            f"{tuple(value.shape)}; reduce it first (all_finite)"
        )


def choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of the strings ``choices`` (TypeError for a non-string, ValueError for another)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {list(choices)}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def fraction(name: str, value: Any) -> float:
    """A real number in ``[0, 1)`` (TypeError for a non-number, ValueError outside)."""
    v = real(name, value)
    if not 0 <= v < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return v
