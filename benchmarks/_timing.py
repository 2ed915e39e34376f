"""Interleaved A/B timing: every variant runs once per round, rounds repeat, medians compare.

CPU timings on a shared machine are noisy; interleaving spreads the noise over all variants
alike, and the spread of the per-round times is reported so a noisy run is flagged as such.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: A variant whose interquartile range exceeds this fraction of its median is "noisy".
NOISY_SPREAD = 0.25


@dataclass
class Timing:
    """Per-variant samples in seconds."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def spread(self, name: str) -> float:
        """Interquartile range relative to the median (the full range below 4 samples)."""
        xs = sorted(self.samples[name])
        if len(xs) < 4:
            return (xs[-1] - xs[0]) / max(statistics.median(xs), 1e-12)
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / max(statistics.median(xs), 1e-12)

    def paired_median(self, name: str, base: str) -> float:
        """The median over the rounds of ``name``'s time minus ``base``'s in the same round
        (seconds). For :func:`interleaved` timings, where sample ``i`` of every variant comes
        from round ``i``: a difference taken within a round cancels the drift between rounds
        (another process starting, the clock changing), which a difference of the two
        medians keeps. Used for the overheads of small differences between long steps."""
        a, b = self.samples[name], self.samples[base]
        if len(a) != len(b):
            raise ValueError(f"{name!r} has {len(a)} samples and {base!r} {len(b)}: not paired")
        return statistics.median(x - y for x, y in zip(a, b, strict=True))

    def noisy(self, threshold: float = NOISY_SPREAD, names: list[str] | None = None) -> bool:
        """Whether any of ``names`` (default: every variant) has a spread above ``threshold``."""
        return any(self.spread(name) > threshold for name in names or self.samples)

    def summary(self) -> dict[str, Any]:
        """JSON-ready medians, minima (ms), spreads and the noise flag of every variant."""
        return {
            "median_ms": {n: self.median(n) * 1e3 for n in self.samples},
            "min_ms": {n: min(xs) * 1e3 for n, xs in self.samples.items()},
            "spread": {n: self.spread(n) for n in self.samples},
            "noisy": self.noisy(),
        }


def interleaved(
    variants: dict[str, tuple[Callable[[], object] | None, Callable[[], object]]],
    rounds: int,
    sync: Callable[[], None] | None = None,
    warmup: int = 2,
) -> Timing:
    """Time each variant once per round, in rotating order.

    ``variants`` maps a name to ``(setup, run)``; ``setup`` (untimed) runs right before ``run``.
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the clock starts and before it stops.
    """
    timing = Timing({name: [] for name in variants})
    names = list(variants)
    for r in range(warmup + rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            setup, run = variants[name]
            if setup is not None:
                setup()
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            run()
            if sync is not None:
                sync()
            elapsed = time.perf_counter() - t0
            if r >= warmup:
                timing.samples[name].append(elapsed)
    return timing


def back_to_back(
    variants: dict[str, Callable[[], object]], blocks: int, steps: int, warmup: int = 2
) -> Timing:
    """Time each variant's ``run`` over ``steps`` consecutive calls per block, as a training
    loop calls its step (caches hold what the previous call of the *same* step left), blocks
    alternating forwards and backwards over the variants so drift hits all alike. The first
    ``warmup`` calls of each block are not recorded."""
    timing = Timing({name: [] for name in variants})
    names = list(variants)
    for b in range(blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            run = variants[name]
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                run()
                elapsed = time.perf_counter() - t0
                if i >= warmup:
                    timing.samples[name].append(elapsed)
    return timing
