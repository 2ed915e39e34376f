"""Which loss scales keep each tensor representable: a recommendation with its evidence.

Made from each tensor's exponent histogram (its entries counted per power of two), so the
fraction of entries that underflow or overflow at another scale is known to within one
binade: a power-of-two scale moves whole binades, and a binade underflows entirely when its
upper edge is at most half the format's smallest subnormal. Overflow is judged
conservatively (a binade that reaches past the format's max counts whole), except that no
entry overflows while the largest one (``amax``, exact) does not.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from lossscale.numerics._formats import FloatFormat, float_format
from lossscale.numerics._report import Exponents, format_scale

if TYPE_CHECKING:
    from lossscale.numerics._report import Report

__all__ = ["Recommendation", "ScaleRange", "recommend"]

#: Loss scales considered: 2**K for K in this range.
EXPONENTS = range(-64, 129)


class ScaleRange(NamedTuple):
    """The power-of-two loss scales at which one tensor stays within the thresholds.

    Attributes:
      tensor: its name.
      low: the smallest scale whose underflow is within the threshold (None: none is).
      high: the largest scale whose overflow is within the threshold (None: none is).
      underflow: the fraction of entries that underflow at the scale in use (exact).

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import Report, recommend
      >>> report = Report()
      >>> g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
      >>> report.record(0, {"big": g * 2.0**10, "small": g * 1e-12 * 2.0**10}, loss_scale=2.0**10)
      >>> rec = recommend(report)
      >>> rec.ranges["big"].high, rec.ranges["big"].covers(2.0**10)  # |g| < 4
      (16384.0, True)
    """

    tensor: str
    low: float | None
    high: float | None
    underflow: float

    @property
    def empty(self) -> bool:
        """Whether no single scale satisfies both thresholds."""
        return self.low is None or self.high is None or self.low > self.high

    def covers(self, scale: float) -> bool:
        """Whether ``scale`` is in the range."""
        return not self.empty and self.low <= scale <= self.high  # type: ignore[operator]


class Recommendation(NamedTuple):
    """What :func:`recommend` found; ``str()`` states it with the evidence.

    Attributes:
      format: the format of the single loss scale (float16, or the report's first format).
      step: the sampled step it is made from.
      loss_scale: the loss scale in use at that step.
      ranges: per tensor, its :class:`ScaleRange`.
      covering: ``(low, high)``: the scales that keep every tensor within the thresholds, or
        None when no single scale does.
      chosen: the scale that covers the most tensors (in ``covering`` when there is one, the
        one nearest the scale in use).
      uncovered: the tensors ``chosen`` does not cover.
      float8: per float8 format in the report, per tensor, the largest power-of-two scale at
        which its largest entry does not overflow (None for an all-zero tensor), and the
        fraction that then underflows.
      underflow, overflow: the thresholds (fractions of a tensor's entries).

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import Report, recommend
      >>> report = Report()
      >>> g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
      >>> report.record(0, {"big": g * 2.0**10, "small": g * 1e-12 * 2.0**10}, loss_scale=2.0**10)
      >>> rec = recommend(report)
      >>> rec.covering is None, rec.uncovered  # 1e-12 and 4 cannot share a float16 scale
      (True, ('small',))
    """

    format: str
    step: int
    loss_scale: float
    ranges: dict[str, ScaleRange]
    covering: tuple[float, float] | None
    chosen: float | None
    uncovered: tuple[str, ...]
    float8: dict[str, dict[str, tuple[float | None, float]]]
    underflow: float
    overflow: float

    def __str__(self) -> str:
        lines = [
            f"{self.format} at step {self.step} (loss scale in use {format_scale(self.loss_scale)}"
            f"; thresholds: underflow <= {self.underflow:.2%}, overflow <= {self.overflow:.2%}"
            " of a tensor's entries; to within a factor of 2):"
        ]
        n = len(self.ranges)
        if self.covering is not None:
            low, high = self.covering
            inside = "inside" if low <= self.loss_scale <= high else "OUTSIDE"
            by_low = max(self.ranges.values(), key=lambda r: r.low or 0.0).tensor
            by_high = min(self.ranges.values(), key=lambda r: r.high or math.inf).tensor
            lines.append(
                f"  one loss scale covers all {n} tensors: {format_scale(low)} .. "
                f"{format_scale(high)} (the scale in use is {inside} it; set by {by_low} "
                f"below and {by_high} above)"
            )
        else:
            chosen = "-" if self.chosen is None else format_scale(self.chosen)
            lines.append(
                f"  no single loss scale covers all {n} tensors; {chosen} covers "
                f"{n - len(self.uncovered)}; not covered:"
            )
            for name in self.uncovered:
                r = self.ranges[name]
                span = (
                    "no scale"
                    if r.low is None or r.high is None or r.low > r.high
                    else f"{format_scale(r.low)} .. {format_scale(r.high)}"
                )
                lines.append(f"    {name}: {span} (underflow now {r.underflow:.2%})")
        for fmt, scales in self.float8.items():
            known = {k: (v[0], v[1]) for k, v in scales.items() if v[0] is not None}
            if not known:
                lines.append(f"  {fmt}: every tensor is zero")
                continue
            smallest = min(known, key=lambda k: known[k][0])
            largest = max(known, key=lambda k: known[k][0])
            worst = max(known, key=lambda k: known[k][1])
            lines.append(
                f"  {fmt}: per-tensor scales from {format_scale(known[smallest][0])} "
                f"({smallest}) to {format_scale(known[largest][0])} ({largest}); most lost "
                f"at its own scale: {worst} ({known[worst][1]:.2%} underflow)"
            )
        return "\n".join(lines)


def _binades(e: Exponents, log2_scale: float) -> list[tuple[float, int]]:
    """``(log2 of the binade's upper edge, entries)`` of the *unscaled* values."""
    src = float_format(e.source)
    ieee_top = len(e.counts) - 1 if src.overflow_value == "inf" else None
    out = []
    for field, count in enumerate(e.counts):
        if field == 0:
            count -= e.zeros  # subnormals of the source: below its smallest normal
        if count <= 0 or field == ieee_top:
            continue
        upper = max(field, 1) - src.exponent_bias + 1  # log2 of the binade's upper edge
        out.append((upper - log2_scale, count))
    return out


def _underflow_count(binades: list[tuple[float, int]], fmt: FloatFormat, k: int) -> int:
    limit = math.log2(fmt.min_subnormal) - 1  # a binade whose upper edge is <= this is zero
    return sum(c for upper, c in binades if upper + k <= limit)


def _overflow_count(binades: list[tuple[float, int]], fmt: FloatFormat, amax: float, k: int) -> int:
    if amax == 0 or not fmt.overflows(math.ldexp(amax, k)):
        return 0
    limit = math.log2(fmt.overflow_threshold)
    return max(1, sum(c for upper, c in binades if upper + k > limit))


def recommend(
    report: Report, *, step: int | None = None, underflow: float = 1e-3, overflow: float = 0.0
) -> Recommendation:
    """For each tensor, the loss scales at which it neither underflows nor overflows beyond the
    thresholds; whether one loss scale covers every tensor in float16 (and which tensors it
    does not); and for each float8 format, the per-tensor scale each would need.

    Args:
      report: a :class:`Report` with at least one sampled step from a front end (or rows
        added with exponent histograms).
      step: the sampled step to use (the last when None).
      underflow: the largest tolerated fraction of a tensor's entries that round to zero.
      overflow: the largest tolerated fraction that overflows (0: none; dynamic loss scaling
        skips every step with an overflow).

    Raises:
      ValueError: no sampled step with exponent histograms, or a threshold outside [0, 1).

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import Report, recommend
      >>> report = Report()
      >>> g = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
      >>> report.record(0, {"big": g * 2.0**10, "small": g * 1e-12 * 2.0**10}, loss_scale=2.0**10)
      >>> rec = recommend(report)
      >>> print(rec)  # doctest: +ELLIPSIS
      float16 at step 0 (loss scale in use 2^10; ...
        no single loss scale covers all 2 tensors; 2^10 covers 1; not covered:
          small: 2^24 .. 2^53 (underflow now 100.00%)
    """
    for name, value in (("underflow", underflow), ("overflow", overflow)):
        if not 0 <= value < 1:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    steps = sorted({s for s, _ in report.exponents})
    if not steps:
        raise ValueError("the report has no sampled step with exponent histograms")
    when = steps[-1] if step is None else step
    base = "float16" if "float16" in report.formats else report.formats[0]
    rows = {r.tensor: r for r in report.rows if r.step == when and r.format == base}
    if not rows:
        raise ValueError(f"no sampled step {when!r} in the report")
    loss_scale = next(iter(rows.values())).loss_scale
    fmt = float_format(base)
    ranges: dict[str, ScaleRange] = {}
    binades_of: dict[str, list[tuple[float, int]]] = {}
    for name, row in rows.items():
        e = report.exponents[(when, name)]
        binades = binades_of[name] = _binades(e, math.log2(row.loss_scale))
        amax = row.amax / row.loss_scale
        low = next(
            (k for k in EXPONENTS if _underflow_count(binades, fmt, k) <= underflow * row.size),
            None,
        )
        high = next(
            (
                k
                for k in reversed(EXPONENTS)
                if _overflow_count(binades, fmt, amax, k) <= overflow * row.size
            ),
            None,
        )
        ranges[name] = ScaleRange(
            name,
            None if low is None else math.ldexp(1.0, low),
            None if high is None else math.ldexp(1.0, high),
            row.underflow,
        )
    lows = [r.low for r in ranges.values() if r.low is not None]
    highs = [r.high for r in ranges.values() if r.high is not None]
    covering: tuple[float, float] | None = None
    if len(lows) == len(highs) == len(ranges) and max(lows) <= min(highs):
        covering = (max(lows), min(highs))

    def covered(k: int) -> int:
        return sum(r.covers(math.ldexp(1.0, k)) for r in ranges.values())

    best = max(EXPONENTS, key=lambda k: (covered(k), -abs(k - math.log2(loss_scale))))
    chosen: float | None = math.ldexp(1.0, best) if covered(best) else None
    if covering is not None:
        chosen = min(max(loss_scale, covering[0]), covering[1])
    uncovered = tuple(n for n, r in ranges.items() if chosen is None or not r.covers(chosen))
    float8: dict[str, dict[str, tuple[float | None, float]]] = {}
    for name8 in report.formats:
        if not name8.startswith("float8"):
            continue
        f8 = float_format(name8)
        per: dict[str, tuple[float | None, float]] = {}
        for name, row in rows.items():
            amax = row.amax / row.loss_scale
            if amax == 0:
                per[name] = (None, 0.0)
                continue
            k = math.floor(math.log2(f8.max / amax))
            while f8.overflows(math.ldexp(amax, k)):
                k -= 1
            while not f8.overflows(math.ldexp(amax, k + 1)):
                k += 1
            lost = _underflow_count(binades_of[name], f8, k) / row.size
            per[name] = (math.ldexp(1.0, k), lost)
        float8[name8] = per
    return Recommendation(
        base, when, loss_scale, ranges, covering, chosen, uncovered, float8, underflow, overflow
    )
