"""The loss scales the float16 audit allows: the top exact from one backward at scale 1, the
bottom measured (see :func:`lossscale.torch.audit`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lossscale.numerics import format_scale
from lossscale.torch._audit_result import Finding
from lossscale.torch._audit_watch import NodeRecord, float16_max

__all__ = [
    "MAX_EXPONENT",
    "BatchScales",
    "Place",
    "batch_scales",
    "pow2",
    "predicted_low",
    "scale_range",
    "underflow_of",
]

#: Loss scales probed: 2**0 .. 2**MAX_EXPONENT.
MAX_EXPONENT = 32

#: A place: ``(module, phase, op)``.
Place = tuple[str, str, str]


class BatchScales(NamedTuple):
    """The loss scales one batch allows, with the plan applied (exponents of 2)."""

    high: int  # the largest without a float16 gradient overflow
    low: int | None  # the smallest with underflow within the threshold (None: none <= high)
    underflow: float  # measured at low (or at high when low is None)
    worst: str  # the parameter that underflows most there


def pow2(k: int) -> float:
    """``2.0**k``."""
    return math.ldexp(1.0, k)


def predicted_low(reference: dict[str, torch.Tensor], threshold: float) -> int:
    """The smallest ``k >= 0`` at which casting each float32 gradient times ``2**k`` to float16
    leaves at most ``threshold`` of its nonzero entries zero: the final cast alone, where a
    float16 backward starts its search. An entry rounds to zero when its magnitude is at most
    ``2**-25``, half float16's smallest subnormal. One host sync per gradient."""
    survivors = []
    for g in reference.values():
        a = g.abs().flatten()
        a = a[a > 0]
        m = int(threshold * a.numel()) + 1  # the m-th smallest must survive
        if m <= a.numel():
            survivors.append(torch.kthvalue(a.float(), m).values)
    if not survivors:
        return 0
    smallest = float(torch.stack(survivors).min())
    return min(MAX_EXPONENT, max(0, math.floor(-25 - math.log2(smallest)) + 1))


def underflow_of(
    reference: dict[str, torch.Tensor], names: list[str], grads: list[Any]
) -> tuple[float, str]:
    """The largest fraction of a parameter gradient's nonzero float32 entries (``reference``)
    that are zero in ``grads``, and that parameter (one host sync)."""
    pairs = [(n, g) for n, g in zip(names, grads, strict=True) if n in reference and g is not None]
    if not pairs:
        return 0.0, ""
    counts = []
    for n, g in pairs:
        nonzero = reference[n] != 0
        counts.append(torch.stack([(nonzero & (g == 0)).sum(), nonzero.sum()]))
    flat = torch.stack([c.to(counts[0].device) for c in counts]).tolist()
    fractions = [
        (lost / max(total, 1), n) for (lost, total), (n, _) in zip(flat, pairs, strict=True)
    ]
    return max(fractions)


def batch_scales(
    nodes: list[NodeRecord],
    underflow_at: Callable[[int], tuple[float, str]],
    reference: dict[str, torch.Tensor],
    threshold: float,
) -> BatchScales:
    """One batch's range from its backward at loss scale 1 (``nodes``, all finite) and
    ``underflow_at(k)``, the underflow a float16 backward at ``2**k`` measures (``k = 0``: the
    backward at 1, already run). The top is exact: ``2**k`` times a float16 value is exact
    until it overflows. The bottom is searched from :func:`predicted_low`, down while the
    measured underflow holds and up until it does (underflow only falls as the scale
    doubles), so it is measured, and the scale below it measured too."""
    largest = max((max(p) for _, _, p, _, _ in nodes), default=0.0)
    high = MAX_EXPONENT
    while high > 0 and largest * pow2(high) > float16_max():
        high -= 1
    measured: dict[int, tuple[float, str]] = {}

    def at(k: int) -> tuple[float, str]:
        if k not in measured:
            measured[k] = underflow_at(k)
        return measured[k]

    def within(k: int) -> bool:
        return at(k)[0] <= threshold

    k = 0 if within(0) else min(max(predicted_low(reference, threshold), 1), high)
    if within(k):
        while k > 0 and within(k - 1):
            k -= 1
        return BatchScales(high, k, *at(k))
    while k < high and not within(k):
        k += 1
    if within(k):
        return BatchScales(high, k, *at(k))
    return BatchScales(high, None, *at(high))


def scale_range(
    findings: list[Finding],
    scales: list[BatchScales] | None,
    places: dict[Place, float],
    threshold: float,
) -> tuple[tuple[float, float] | None, str, list[Finding]]:
    """The range over every batch (or None and why) and the findings that bound it: the
    places (``places``: their largest float16 gradient at scale 1) whose gradient overflows
    first, at twice the range's top."""
    unfixed = [f for f in findings if not f.fixable]
    if unfixed:
        f = unfixed[0]
        where = f"{f.phase} {f.op} in {f.module or '(root)'}"
        return None, f"float16 overflows at loss scale 1 with the plan applied ({where})", []
    if not scales:
        return None, "the plan search ended with overflows at loss scale 1 left", []
    high = min(s.high for s in scales)
    bounds = []
    if high < MAX_EXPONENT:
        for place, amax in places.items():
            # the place overflows first at 2**(high + 1), not at 2**high
            if amax * pow2(high + 1) > float16_max() >= amax * pow2(high):
                bounds.append(Finding(*place, amax, False, pow2(high + 1)))
    lows = [s.low for s in scales if s.low is not None]
    if len(lows) == len(scales) and max(lows) <= high:
        return (pow2(max(lows)), pow2(high)), "", bounds
    worst = max(scales, key=lambda s: s.underflow)
    reason = (
        f"at {format_scale(pow2(worst.high))}, the largest scale at which no float16 "
        f"gradient overflows, {worst.underflow:.2%} of {worst.worst}'s nonzero gradient "
        f"entries underflow (more than {threshold:.2%})"
    )
    return None, reason, bounds
