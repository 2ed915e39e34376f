"""``tensor_stats``: the numerics of one tensor, read back to the host."""

from __future__ import annotations

import math
from typing import Any

from lossscale.core._backends import namespace_of
from lossscale.numerics._counts import TensorStats, check_scale, count_row, decode_row, targets_of

__all__ = ["tensor_stats"]


def tensor_stats(
    x: Any, *, scale: Any = 1.0, formats: Any = ("float16",)
) -> dict[str, TensorStats]:
    """What casting ``x * scale`` to each format would do to ``x``'s entries, exactly.

    Each fraction equals what the real cast gives (round to nearest even, the product in
    float64): ``underflow`` counts nonzero entries that become zero, ``subnormal`` those that
    become nonzero subnormals, ``overflow`` those whose rounded magnitude exceeds the format's
    max (inf, or NaN for float8_e4m3fn; counted by value, so a saturating cast such as torch's
    CPU float8_e4m3fn counts the same). Entries already zero are ``zeros``; inf and NaN are
    ``nonfinite`` and in no other field.

    Args:
      x: a float16, bfloat16, float32, float64 or float8 array of NumPy (ml_dtypes types
        included), torch (any device) or JAX.
      scale: the factor applied before the cast: a positive finite real number.
      formats: a format, or a sequence of them: names (``"float16"``, ``"bfloat16"``,
        ``"float8_e4m3fn"``, ``"float8_e5m2"``, or one added with :func:`register_format`) or
        the frameworks' dtypes of those names (``torch.float16``, ``np.float16``,
        ``jnp.bfloat16``), recognised by name without importing the framework.

    Returns:
      ``{format name: TensorStats}`` of Python floats, in the order of ``formats``.

    Raises:
      TypeError: ``x`` is not a floating-point array of a known library, ``scale`` is not a
        real number, or ``formats`` is not a format or a sequence of them.
      ValueError: ``scale`` is not finite and > 0, or a format is unknown.

    Host syncs: one (the counts of all formats come back together). Device work: a few
    integer comparisons and reductions per format over ``x`` and one exponent histogram.

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import tensor_stats
      >>> g = np.array([1e-9, 1e-7, 1e-3, 0.0], np.float32)
      >>> s = tensor_stats(g, formats=("float16", "float8_e4m3fn"))["float16"]
      >>> s.underflow, s.subnormal, s.zeros
      (0.25, 0.25, 0.25)
      >>> tensor_stats(g, scale=2.0**10)["float16"].underflow
      0.0
    """
    value = check_scale(scale)
    targets = targets_of(formats)
    xp = namespace_of(x)
    if xp is None:
        raise TypeError(f"x must be a NumPy, torch or JAX array, got {type(x).__name__}")
    row = count_row(x, targets, value, xp=xp)
    return decode_row(row.tolist(), xp.dtype_name(x), targets, math.prod(x.shape), value)
