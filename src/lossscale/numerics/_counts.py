"""The statistics kernel: how a cast of ``x * scale`` to each format treats a tensor's entries.

One function, :func:`count_row`, written once against :class:`~lossscale.core.ArrayNamespace`:
it reads ``x``'s bits as integers (:meth:`~lossscale.core.ArrayNamespace.bits`), clears the
sign bit and counts the magnitudes against the integer thresholds of
:func:`lossscale.numerics._formats.thresholds`. Integer comparisons are exact on every library and
device: no float64 on the device (JAX without x64, Apple GPUs), no cast, and no
flush-to-zero of subnormal inputs (XLA:CPU compares float32 subnormals as zero). The counts
come back as one 1-D integer array (the *row*) on ``x``'s device, so that many tensors are read
back to the host with one transfer; :func:`decode_row` turns a row into
:class:`TensorStats` per format.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lossscale.core._backends import ArrayNamespace, namespace_of
from lossscale.numerics._formats import (
    FloatFormat,
    dtype_name,
    float_format,
    format_of_dtype,
    thresholds,
)

__all__ = [
    "TensorStats",
    "check_scale",
    "count_row",
    "decode_row",
    "histogram_length",
    "row_length",
]

#: Row entries before the per-format counts: zero and finite entries.
HEAD = 2
#: Row entries per format: ``|x|`` bits <= zero_max, < normal_min, < overflow_min.
PER_FORMAT = 3


class TensorStats(NamedTuple):
    """What a cast of ``x * scale`` to one format does to the entries of ``x``.

    Fractions are over all ``size`` entries (0.0 for an empty tensor). A finite entry is in at
    most one of ``underflow``, ``subnormal``, ``overflow`` and ``zeros``; a non-finite one only
    in ``nonfinite``.

    Attributes:
      underflow: nonzero finite entries whose cast is zero.
      subnormal: entries whose cast is a nonzero subnormal of the format.
      overflow: finite entries whose rounded magnitude exceeds the format's max (a
        non-saturating cast gives inf, or NaN for float8_e4m3fn; a saturating one gives max).
      zeros: entries of ``x`` that are zero already (either sign).
      nonfinite: entries of ``x`` that are inf or NaN already.
      amax: the largest ``|x|`` over finite entries (0.0 when there is none), before scaling.
      headroom_max: ``log2(max / (amax * scale))``: how many doublings of the scale the largest
        entry stands before it passes the format's max (negative: it is above; inf when amax
        is 0).
      headroom_normal: ``log2(amax * scale / min_normal)``: how many halvings before the
        largest entry falls below the smallest normal (-inf when amax is 0).
      size: the number of entries.
      scale: the factor applied before the cast.

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import TensorStats, tensor_stats
      >>> s = tensor_stats(np.array([3e-8, 1e5], np.float32))["float16"]
      >>> isinstance(s, TensorStats), s.underflow, s.overflow, s.amax
      (True, 0.0, 0.5, 100000.0)
    """

    underflow: float
    subnormal: float
    overflow: float
    zeros: float
    nonfinite: float
    amax: float
    headroom_max: float
    headroom_normal: float
    size: int
    scale: float


def check_scale(scale: Any, name: str = "scale") -> float:
    """``scale`` as a Python float; TypeError unless a real number, ValueError unless finite
    and > 0."""
    if isinstance(scale, bool) or (not isinstance(scale, int | float) and not _is_real(scale)):
        raise TypeError(f"{name} must be a real number, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {scale!r}")
    return value


def _is_real(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and getattr(x, "shape", None) == () and "float" in str(dtype)


def histogram_length(source: FloatFormat) -> int:
    """Entries of a row's exponent histogram for tensors of ``source``: one per exponent
    field value (0: zeros and subnormals; the last: inf and NaN in IEEE formats)."""
    return 1 << (source.bits - 1 - source.mantissa_bits)


def row_length(source: FloatFormat, n_formats: int) -> int:
    """The length of :func:`count_row`'s result."""
    return HEAD + PER_FORMAT * n_formats + 1 + histogram_length(source)


def count_row(
    x: Any,
    targets: Sequence[str | FloatFormat],
    scale: float = 1.0,
    *,
    limits: Sequence[Sequence[Any]] | None = None,
    xp: ArrayNamespace | None = None,
) -> Any:
    """Count ``x``'s entries against the cast of ``x * scale`` to each format of ``targets``.

    Args:
      x: a floating-point array of NumPy (ml_dtypes types included), torch or JAX (traced
        under ``jax.jit`` too).
      targets: format names (or :class:`~lossscale.numerics._formats.FloatFormat`).
      scale: a positive finite float (host value).
      limits: instead of ``scale``, the ``(zero_max, normal_min, overflow_min)`` bit
        thresholds of each target (ints or 0-d integer arrays of ``x``'s library; for a scale
        known only on the device).
      xp: the namespace of ``x`` (found from ``x`` when None).

    Returns:
      A 1-D integer array on ``x``'s device, for the magnitude bits ``b`` of ``x``:
      ``[#(b == 0), #(b finite)]``, then per target ``[#(b <= zero_max), #(b < normal_min),
      #(b < overflow_min)]``, then the bits of the largest finite magnitude, then the
      exponent-field histogram of all entries (see :func:`decode_row`). Reads ``x``'s bits for
      the masking, the maximum, the histogram and the comparisons with the ``2 + 3 *
      len(targets)`` thresholds: in one kernel on a GPU, one per threshold on the CPU (see
      :meth:`~lossscale.core.ArrayNamespace.count_below`), fused under ``jax.jit``.
      Allocates the bits, the comparisons' booleans and a few scalars; no host sync.

    Raises:
      TypeError: ``x`` is not an array of a known library, or not floating-point.
    """
    if xp is None:
        xp = namespace_of(x)
        if xp is None:
            raise TypeError(f"expected a NumPy, torch or JAX array, got {type(x).__name__}")
    source = format_of_dtype(xp.dtype_name(x))
    fmts = [float_format(t) for t in targets]
    if limits is None:
        limits = [thresholds(source.name, f.name, scale)[:3] for f in fmts]
    end = source.max_bits + 1
    b = xp.bits(x) & ((1 << (source.bits - 1)) - 1)
    histogram = xp.count_values(b >> source.mantissa_bits, histogram_length(source))
    if math.prod(getattr(x, "shape", ())) == 0:
        zero = b.sum()  # a 0 of the library's integer type, on x's device
        return xp.stack_ints([zero] * (HEAD + PER_FORMAT * len(fmts) + 1) + [histogram])
    bounds: list[Any] = [1, end]  # b < 1: zero; b < end: finite
    for zero_max, normal_min, overflow_min in limits:
        bounds += [zero_max + 1, normal_min, overflow_min]
    amax = xp.where(b < end, b, 0).max()
    return xp.stack_ints([xp.count_below(b, bounds), amax, histogram])


def decode_row(
    row: Sequence[Any],
    source: str | FloatFormat,
    targets: Sequence[str | FloatFormat],
    size: int,
    scale: Any = 1.0,
    *,
    ops: RowOps | None = None,
) -> dict[str, TensorStats]:
    """The :class:`TensorStats` per target (by name) of a row: the one decoding of a row.

    With ``ops=None`` the row has been read back to the host and the fields are Python numbers;
    a front end that decodes on its device (``lossscale.jax.grad_stats`` under ``jax.jit``)
    passes its :class:`RowOps` and gets 0-d arrays, computed by the same formulas.

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics._counts import count_row, decode_row
      >>> x = np.array([1e-8, 3e-5, 1.0, 7e4, 0.0], np.float32)
      >>> s = decode_row(count_row(x, ["float16"]).tolist(), "float32", ["float16"], x.size)
      >>> s["float16"].underflow, s["float16"].subnormal, s["float16"].overflow
      (0.2, 0.2, 0.2)
    """
    ops = HOST_OPS if ops is None else ops
    src = float_format(source)
    zeros, finite = (ops.count(v) for v in row[:HEAD])
    amax = ops.amax(src, row[HEAD + PER_FORMAT * len(targets)], finite)
    n = ops.size(size if size else 1)
    log_amax = ops.log2(amax) + ops.log2(scale)  # -inf when amax is 0
    out: dict[str, TensorStats] = {}
    for i, target in enumerate(targets):
        fmt = float_format(target)
        le_zero, lt_normal, lt_over = (ops.count(v) for v in row[HEAD + 3 * i : HEAD + 3 * i + 3])
        out[fmt.name] = TensorStats(
            underflow=(le_zero - zeros) / n,
            subnormal=(lt_normal - le_zero) / n,
            overflow=(finite - lt_over) / n,
            zeros=zeros / n,
            nonfinite=(size - finite) / n,
            amax=amax,
            headroom_max=math.log2(fmt.max) - log_amax,  # inf when amax is 0
            headroom_normal=log_amax - math.log2(fmt.min_normal),  # -inf when amax is 0
            size=size,
            scale=ops.scale(scale),
        )
    return out


class RowOps:
    """How :func:`decode_row` reads a row's entries: on the host, Python numbers (this class);
    a front end that decodes on its device subclasses it with its array operations."""

    @staticmethod
    def count(value: Any) -> Any:
        """A count entry of the row."""
        return int(value)

    @staticmethod
    def size(size: int) -> Any:
        """The divisor of the fractions (the entry count, at least 1)."""
        return size

    @staticmethod
    def amax(source: FloatFormat, bits: Any, finite: Any) -> Any:
        """The largest finite magnitude from its bits (0.0 when no entry is finite)."""
        return source.value(int(bits)) if finite else 0.0

    @staticmethod
    def log2(value: Any) -> Any:
        """``log2``, with ``log2(0) = -inf``."""
        return math.log2(value) if value > 0 else -math.inf

    @staticmethod
    def scale(scale: Any) -> Any:
        """The ``scale`` field."""
        return scale


#: The host's :class:`RowOps`.
HOST_OPS = RowOps()


def histogram(row: Sequence[int], n_formats: int) -> list[int]:
    """The exponent-field histogram at the end of a row."""
    return [int(v) for v in row[HEAD + PER_FORMAT * n_formats + 1 :]]


def targets_of(formats: Any, name: str = "formats") -> tuple[str, ...]:
    """Validated format names: a name, a FloatFormat or a dtype (:func:`float_format`), or a
    non-empty sequence of them."""
    if isinstance(formats, str | FloatFormat) or dtype_name(formats) is not None:
        formats = (formats,)
    if not isinstance(formats, Sequence | Mapping) or not formats:
        raise TypeError(
            f"{name} must be a format (a name or a dtype) or a non-empty sequence of them, got "
            f"{formats!r}"
        )
    names = tuple(float_format(f).name for f in formats)
    if len(set(names)) != len(names):
        raise ValueError(f"{name} names a format twice: {names!r}")
    return names
