"""The loss scales the float16 audit allows: the top exact from one backward at scale 1, the
bottom measured (see :func:`lossscale.torch.audit`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lossscale.core import namespace_of
from lossscale.numerics import format_scale
from lossscale.torch._audit.finding import Finding
from lossscale.torch._audit.ops import float16_max, read_all
from lossscale.torch._audit.watch import NodeRecord

__all__ = [
    "MAX_EXPONENT",
    "BatchScales",
    "Place",
    "batch_scales",
    "pow2",
    "NOISE",
    "Reference",
    "predicted_low",
    "reference_of",
    "scale_range",
    "underflow_counts",
    "underflow_of",
    "worst_underflow",
]

#: Loss scales probed: 2**0 .. 2**MAX_EXPONENT.
MAX_EXPONENT = 32

#: float32's unit roundoff: gradient entries below this fraction of the batch's global
#: gradient norm (L2, every parameter) are rounding noise, not underflow.
NOISE = 2.0**-24
#: float32 exponent fields (the histogram's bins) and the bin of entries that do not count.
_EXPONENTS = 256
_NOT_COUNTED = 255

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


class Reference(NamedTuple):
    """One batch's float32 gradients, read for underflow (see :func:`reference_of`)."""

    grads: dict[str, torch.Tensor]  # by parameter name
    counted: dict[str, torch.Tensor]  # bool: the entries that count (at or above the noise)
    counts: dict[str, torch.Tensor]  # 0-d: how many entries count


def reference_of(grads: dict[str, torch.Tensor], *, noise: float = NOISE) -> Reference:
    """One batch's float32 gradients prepared for the underflow count, on the device (no
    host read): an entry *counts* when its magnitude is at least ``noise`` times the global
    L2 norm of ``grads`` (float32's rounding level of the model's gradient: a gradient that is
    zero in exact arithmetic, such as the key bias's in softmax attention, lands below it);
    the others are rounding noise and never count as underflow."""
    if not grads:
        return Reference({}, {}, {})
    values = list(grads.values())
    device = values[0].device
    norms = torch._foreach_norm([g.detach().float() for g in values], 2)
    level = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms])) * noise
    counted: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    for name, g in grads.items():
        keep = g.detach().abs() >= level.to(g.device)
        counted[name], counts[name] = keep, keep.sum()
    return Reference(dict(grads), counted, counts)


def predicted_low(reference: Reference, threshold: float) -> int:
    """The smallest ``k`` in ``0 .. MAX_EXPONENT`` at which casting each gradient times
    ``2**k`` to float16 leaves at most ``threshold`` of its counting entries zero (the final
    cast alone, where a float16 backward's search starts), from an exact histogram of each
    gradient's float32 exponents (an entry below ``2**(-25 - k)`` rounds to zero at
    ``2**k``): no sort, no selection, one host read."""
    if not reference.grads:
        return 0
    first = next(iter(reference.grads.values()))
    device = first.device
    xp = namespace_of(first)
    assert xp is not None
    hists = []
    for name, g in reference.grads.items():
        bits = g.detach().float().abs().view(torch.int32) >> 23
        exponent = torch.where(reference.counted[name], bits, _NOT_COUNTED)
        hists.append(xp.count_values(exponent, _EXPONENTS).to(device))
    below = torch.stack(hists).cumsum(1)  # [p, e]: counting entries with exponent field <= e
    total = torch.stack([c.to(device) for c in reference.counts.values()]).clamp(min=1)
    # at 2**k an entry underflows when its exponent field is below 102 - k (2**-25 / 2**k)
    columns = torch.arange(101, 101 - MAX_EXPONENT - 1, -1, device=device)
    fractions = below[:, columns].double() / total[:, None]
    fits = (fractions <= threshold).all(0)
    ks = torch.arange(MAX_EXPONENT + 1, device=device)
    return int(read_all([torch.where(fits, ks, MAX_EXPONENT).min()])[0])


def underflow_counts(
    reference: Reference, names: list[str], grads: list[Any]
) -> tuple[list[str], list[torch.Tensor]]:
    """Per parameter of ``grads`` that ``reference`` holds, on the device (no host read): its
    counting float32 entries (see :func:`reference_of`) that are zero in ``grads``, and how
    many count. Returns the names and ``[lost, counted]`` of each, flat (0-d int64)."""
    pairs = [
        (n, g) for n, g in zip(names, grads, strict=True) if n in reference.grads and g is not None
    ]
    values: list[torch.Tensor] = []
    for n, g in pairs:
        values += [(reference.counted[n] & (g == 0)).sum(), reference.counts[n]]
    return [n for n, _ in pairs], values


def worst_underflow(names: list[str], counts: list[float]) -> tuple[float, str]:
    """From :func:`underflow_counts` read on the host: the largest fraction of a parameter's
    counting entries lost, and that parameter (``(0.0, "")`` for none)."""
    if not names:
        return 0.0, ""
    fractions = [
        lost / max(total, 1.0) for lost, total in zip(counts[::2], counts[1::2], strict=True)
    ]
    return max(zip(fractions, names, strict=True))


def underflow_of(reference: Reference, names: list[str], grads: list[Any]) -> tuple[float, str]:
    """The largest fraction of a parameter gradient's counting float32 entries (see
    :func:`reference_of`) that are zero in ``grads``, and that parameter (one host read)."""
    counted, values = underflow_counts(reference, names, grads)
    return worst_underflow(counted, read_all(values))


def batch_scales(
    nodes: list[NodeRecord],
    underflow_at: Callable[[int], tuple[float, str]],
    predicted: Callable[[], int],
    threshold: float,
) -> BatchScales:
    """One batch's range from its backward at loss scale 1 (``nodes``, all finite) and
    ``underflow_at(k)``, the underflow a float16 backward at ``2**k`` measures (``k = 0``: the
    backward at 1, already run). The top is exact: ``2**k`` times a float16 value is exact
    until it overflows. The bottom is searched from ``predicted``, down while the
    measured underflow holds and up until it does (underflow only falls as the scale
    doubles), so it is measured, and the scale below it measured too. ``predicted()``: where
    the search starts (:func:`predicted_low`, called only when the backward at 1 does not
    keep the threshold)."""
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

    k = 0 if within(0) else min(max(predicted(), 1), high)
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
