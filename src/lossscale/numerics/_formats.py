"""Floating-point formats as numbers: what a cast to float16, bfloat16 or float8 does to a value.

A :class:`FloatFormat` is described by its width, mantissa bits, exponent bias and largest
finite value. From these, :func:`thresholds` computes on the host, in float64, the exact
magnitudes (as bit patterns of the *source* dtype) at which the round-to-nearest-even cast of
``x * scale`` becomes zero, reaches the smallest normal and exceeds the format's largest value.
Counting the entries of a tensor against those few integers (:mod:`lossscale.numerics._counts`) is
then exact on any array library and device, with no float64 arithmetic and no cast on the
device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "FloatFormat",
    "Thresholds",
    "float_format",
    "format_of_dtype",
    "formats",
    "register_format",
    "thresholds",
]


class FloatFormat(NamedTuple):
    """A binary floating-point format with subnormals.

    Attributes:
      name: the dtype's NumPy-style name (``"float16"``, ``"float8_e4m3fn"``).
      bits: the width in bits (sign included).
      mantissa_bits: the stored fraction bits.
      exponent_bias: the exponent bias; the smallest normal is ``2 ** (1 - exponent_bias)``.
      max: the largest finite value.
      overflow_value: what a non-saturating cast gives above ``max``: ``"inf"`` (IEEE formats,
        float8_e5m2) or ``"nan"`` (float8_e4m3fn, which has no infinity).

    The magnitude bit pattern just above ``max`` is the first non-finite one (inf, or the NaN
    of a format without infinity).

    Example:
      >>> from lossscale.numerics import float_format
      >>> f = float_format("float16")
      >>> f.min_normal, f.min_subnormal, f.max
      (6.103515625e-05, 5.960464477539063e-08, 65504.0)
      >>> float_format("float8_e4m3fn").overflow_threshold  # 464 still rounds to 448
      464.0
    """

    name: str
    bits: int
    mantissa_bits: int
    exponent_bias: int
    max: float
    overflow_value: str = "inf"

    @property
    def min_normal(self) -> float:
        """The smallest positive normal value."""
        return math.ldexp(1.0, 1 - self.exponent_bias)

    @property
    def min_subnormal(self) -> float:
        """The smallest positive (subnormal) value."""
        return math.ldexp(1.0, 1 - self.exponent_bias - self.mantissa_bits)

    @property
    def max_bits(self) -> int:
        """The magnitude bit pattern of ``max``; the next pattern is not finite."""
        return self.magnitude_bits(self.max)

    @property
    def top_ulp(self) -> float:
        """The spacing of values in the binade of ``max``."""
        return math.ldexp(1.0, math.frexp(self.max)[1] - 1 - self.mantissa_bits)

    @property
    def overflow_threshold(self) -> float:
        """``max`` plus half an ulp: the midpoint above which (and at which, when ``max`` has
        an odd last bit, as in IEEE formats) the rounded value exceeds ``max``."""
        return self.max + self.top_ulp / 2

    def value(self, magnitude_bits: int) -> float:
        """The value of a non-negative finite bit pattern (sign bit clear), exactly."""
        exponent = magnitude_bits >> self.mantissa_bits
        fraction = magnitude_bits & ((1 << self.mantissa_bits) - 1)
        if exponent == 0:
            return math.ldexp(fraction, 1 - self.exponent_bias - self.mantissa_bits)
        return math.ldexp(
            (1 << self.mantissa_bits) | fraction, exponent - self.exponent_bias - self.mantissa_bits
        )

    def magnitude_bits(self, value: float) -> int:
        """The bit pattern of a non-negative value of this format (exact; ValueError if not)."""
        if not 0 <= value <= self.max:
            raise ValueError(f"{value!r} is not a finite non-negative {self.name} value")
        if value < self.min_normal:
            stored, fraction = 0, value / self.min_subnormal
        else:
            mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, [0.5, 1)
            stored = exponent - 1 + self.exponent_bias
            fraction = math.ldexp(mantissa * 2 - 1, self.mantissa_bits)  # exact
        if fraction != int(fraction):
            raise ValueError(f"{value!r} is not a {self.name} value")
        return (stored << self.mantissa_bits) + int(fraction)

    def rounds_to_zero(self, product: float) -> bool:
        """Whether a non-negative float64 value rounds (nearest, ties to even) to zero."""
        return product <= self.min_subnormal / 2

    def rounds_to_normal(self, product: float) -> bool:
        """Whether a non-negative float64 value rounds to at least the smallest normal."""
        return product >= self.min_normal - self.min_subnormal / 2

    def overflows(self, product: float) -> bool:
        """Whether a non-negative float64 value rounds to a magnitude above ``max``."""
        threshold = self.overflow_threshold
        if product == threshold:  # a tie goes to the even neighbour
            return int(self.max / self.top_ulp) % 2 == 1
        return product > threshold


_FORMATS: dict[str, FloatFormat] = {}


def register_format(fmt: FloatFormat) -> FloatFormat:
    """Add a format to the table (or replace one of the same name); returns it.

    Raises:
      TypeError: ``fmt`` is not a :class:`FloatFormat`.
      ValueError: its fields are inconsistent (``max`` not a value of the layout, or a layout
        that does not fit ``bits``).

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import FloatFormat, register_format, tensor_stats
      >>> fmt = register_format(FloatFormat("float8_e4m3", 8, 3, 7, 240.0))  # IEEE-like, inf
      >>> tensor_stats(np.array([250.0, 1e-3]), formats="float8_e4m3")["float8_e4m3"].overflow
      0.5
    """
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"register_format expects a FloatFormat, got {type(fmt).__name__}")
    if fmt.overflow_value not in ("inf", "nan"):
        raise ValueError(f"overflow_value must be 'inf' or 'nan', got {fmt.overflow_value!r}")
    if not 0 < fmt.mantissa_bits < fmt.bits - 1 or not math.isfinite(fmt.max) or fmt.max <= 1:
        raise ValueError(f"inconsistent format {fmt!r}")
    max_bits = fmt.magnitude_bits(fmt.max)  # ValueError when max is not a value of the layout
    if max_bits + 1 >= 1 << (fmt.bits - 1):
        raise ValueError(f"format {fmt.name!r}: max {fmt.max!r} leaves no non-finite pattern")
    _FORMATS[fmt.name] = fmt
    thresholds.cache_clear()
    return fmt


def formats() -> dict[str, FloatFormat]:
    """The known formats by name (a copy of the table).

    Example:
      >>> from lossscale.numerics import formats
      >>> [name for name in formats() if name.startswith("float8")][:2]
      ['float8_e5m2', 'float8_e4m3fn']
    """
    return dict(_FORMATS)


def dtype_name(dtype: Any) -> str | None:
    """The NumPy-style name of a framework's dtype, recognised by its name, without importing
    the framework: ``torch.float16`` -> ``"float16"``; NumPy's dtypes and scalar types
    (``np.float16``, ``np.dtype("float16")``, ml_dtypes' ``bfloat16``) and JAX's
    (``jnp.float16``, ``jnp.bfloat16``) by their dtype's name. None for anything else.

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics._formats import dtype_name
      >>> dtype_name(np.float16), dtype_name(np.dtype("float32")), dtype_name(3)
      ('float16', 'float32', None)
    """
    kind = type(dtype)
    if kind.__module__.split(".")[0] == "torch" and kind.__name__ == "dtype":
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, np.dtype):
        return str(dtype.name)
    inner = getattr(dtype, "dtype", None)  # JAX's scalar types carry their NumPy dtype
    if isinstance(inner, np.dtype):
        return str(inner.name)
    if isinstance(dtype, type) and issubclass(dtype, np.generic):
        return str(np.dtype(dtype).name)
    return None


def float_format(name: Any) -> FloatFormat:
    """The format named ``name``: a format name, a :class:`FloatFormat` (returned as it is),
    or a framework's dtype (``torch.float16``, ``np.float16``, ``jnp.bfloat16``: see
    :func:`dtype_name`).

    Raises:
      TypeError: ``name`` is neither a string, a FloatFormat nor a dtype.
      ValueError: no format of that name is known.

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import float_format
      >>> float_format("float8_e5m2").max, float_format("bfloat16").mantissa_bits
      (57344.0, 7)
      >>> float_format(np.float16).name
      'float16'
    """
    if isinstance(name, FloatFormat):
        return name
    if not isinstance(name, str):
        named = dtype_name(name)
        if named is None:
            raise TypeError(
                f"a format is a name, a FloatFormat or a dtype, got {type(name).__name__}"
            )
        name = named
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(sorted(_FORMATS))}")
    return fmt


def format_of_dtype(dtype_name: str) -> FloatFormat:
    """The format of a tensor's dtype (its NumPy-style name), for reading its bits.

    Raises:
      TypeError: the dtype is not a floating-point format in the table.
    """
    fmt = _FORMATS.get(dtype_name)
    if fmt is None:
        raise TypeError(
            f"expected a floating-point tensor ({', '.join(sorted(_FORMATS))}), "
            f"got dtype {dtype_name!r}"
        )
    return fmt


class Thresholds(NamedTuple):
    """Magnitude bit patterns of a source dtype that split its values for one cast.

    For ``|x|`` with magnitude bits ``b`` (finite when ``b < nonfinite``) and the cast of
    ``x * scale`` to the target: zero when ``b <= zero_max``, a subnormal when
    ``zero_max < b < normal_min``, above the target's max when ``overflow_min <= b``.
    """

    zero_max: int
    normal_min: int
    overflow_min: int
    nonfinite: int


def _first(lo: int, hi: int, predicate: Callable[[int], bool]) -> int:
    """The smallest ``b`` in ``[lo, hi)`` with ``predicate(b)`` (monotone), else ``hi``."""
    while lo < hi:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@functools.lru_cache(maxsize=4096)
def thresholds(source: str, target: str, scale: float) -> Thresholds:
    """The exact :class:`Thresholds` of casting ``x * scale`` (``x`` of dtype ``source``) to
    ``target``, the product rounded to float64 as the reference cast does.

    A binary search over the source's bit patterns with the predicates of
    :class:`FloatFormat`: about ``bits`` float64 products per threshold, cached per
    (source, target, scale).

    Example:
      >>> from lossscale.numerics._formats import thresholds
      >>> t = thresholds("float32", "float16", 1.0)
      >>> t.zero_max == 0x33000000  # float32 bits of 2**-25: half of float16's 2**-24
      True
    """
    src, dst = float_format(source), float_format(target)
    end = src.max_bits + 1

    def product(b: int) -> float:
        with_scale = src.value(b) * scale
        return with_scale if math.isfinite(with_scale) else math.inf

    zero_max = _first(0, end, lambda b: not dst.rounds_to_zero(product(b))) - 1
    normal_min = _first(0, end, lambda b: dst.rounds_to_normal(product(b)))
    overflow_min = _first(0, end, lambda b: dst.overflows(product(b)))
    return Thresholds(zero_max, normal_min, overflow_min, end)


for _fmt in (
    FloatFormat("float64", 64, 52, 1023, float.fromhex("0x1.fffffffffffffp+1023")),
    FloatFormat("float32", 32, 23, 127, float.fromhex("0x1.fffffep+127")),
    FloatFormat("float16", 16, 10, 15, 65504.0),
    FloatFormat("bfloat16", 16, 7, 127, float.fromhex("0x1.fep+127")),
    FloatFormat("float8_e5m2", 8, 2, 15, 57344.0),
    FloatFormat("float8_e4m3fn", 8, 3, 7, 448.0, "nan"),
):
    register_format(_fmt)
