"""Interleaved A/B timing: every variant runs once per round, rounds repeat, medians compare.

CPU timings on a shared machine are noisy; interleaving spreads the noise over all variants
alike, and the spread of the per-round times is reported so a noisy run is flagged as such.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Timing:
    """Per-variant samples in seconds."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def spread(self, name: str) -> float:
        """Interquartile range relative to the median."""
        xs = sorted(self.samples[name])
        if len(xs) < 4:
            return (xs[-1] - xs[0]) / max(statistics.median(xs), 1e-12)
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / max(statistics.median(xs), 1e-12)

    def noisy(self, threshold: float = 0.25) -> bool:
        return any(self.spread(name) > threshold for name in self.samples)


def interleaved(
    variants: dict[str, tuple[Callable[[], None] | None, Callable[[], None]]],
    rounds: int,
    sync: Callable[[], None] | None = None,
    warmup: int = 2,
) -> Timing:
    """Time each variant once per round, in rotating order.

    ``variants`` maps a name to ``(setup, run)``; ``setup`` (untimed) runs right before ``run``.
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
