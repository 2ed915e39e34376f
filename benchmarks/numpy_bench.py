"""NumPy: what a user of lossscale's NumPy API pays per step, against the memory-bandwidth floor.

Run: ``python -m benchmarks.numpy_bench [--quick] [--rounds N] [--json out.json]``

Per parameter set (24 tensors / 25M elements, 300 / 25M, 2000 / 2M) and gradient dtype (float16,
float32), in one interleaved run, medians of the rounds:

  floor               one in-place multiply over the gradients' bytes:
                      ``np.multiply(g, np.float32(1 / scale), out=g)`` per array
  floor_flat          the same multiply, once over one flat buffer holding every gradient
                      (the gradients are views into it): the memory-bandwidth floor without
                      the per-array call overhead
  update              ``ls.update(grads)`` alone: the non-finite check (``all_finite``:
                      ``isfinite`` chunk by chunk) and the scale rule
  unscale_update      the floor's multiply, then ``ls.update(grads)``: a careful user's step
  unscale_update_skip the same with one inf gradient (in the middle array: the check stops there)
  readme              the README's recipe: ``[g.astype(np.float32) / ls() for g in grads]``,
                      then ``ls.update`` (new float32 arrays)
  isfinite_all        ``all(np.isfinite(g).all() for g in grads)``: a reference check

Ratios: unscale_update / floor (and / floor_flat), update / floor, readme / floor. The
gradients hold scaled values (about N(0, 33)), so unscaling never produces subnormals. Speed
is never asserted.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import lossscale

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _report, _shapes
from benchmarks._timing import interleaved

SCALE = _shapes.SCALE
STATE = _shapes.SCALE_STATE
DTYPES = ("float16", "float32")

Variants = dict[str, tuple[Callable[[], object] | None, Callable[[], object]]]


def make_grads(pset: _shapes.ParamSet, dtype: str, seed: int = 0) -> np.ndarray:
    """Scaled gradients, N(0, 1e-3) times the scale in ``dtype``, as one flat buffer."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(pset.n_elements, dtype=np.float32) * (1e-3 * SCALE)).astype(dtype)


def views(flat: np.ndarray, pset: _shapes.ParamSet) -> list[np.ndarray]:
    """``flat`` cut into arrays of the set's shapes (views, no copy)."""
    cuts = np.cumsum([math.prod(s) for s in pset.shapes])[:-1]
    return [v.reshape(s) for v, s in zip(np.split(flat, cuts), pset.shapes, strict=True)]


def variants(flat: np.ndarray, grads: list[np.ndarray], ls: lossscale.DynamicLossScale) -> Variants:
    """The timed steps, each with its (untimed) reset of the gradients and the scale."""
    saved = flat.copy()
    inv = np.float32(1 / SCALE)

    def reset() -> None:
        np.copyto(flat, saved)
        ls.load_state_dict(STATE)

    def reset_inf() -> None:
        reset()
        grads[len(grads) // 2].reshape(-1)[0] = np.inf

    def floor() -> None:
        for g in grads:
            np.multiply(g, inv, out=g)

    def unscale_update() -> None:
        floor()
        ls.update(grads)

    def readme() -> None:
        ls.update([g.astype(np.float32) / ls() for g in grads])

    return {
        "floor": (reset, floor),
        "floor_flat": (reset, lambda: np.multiply(flat, inv, out=flat)),
        "update": (reset, lambda: ls.update(grads)),
        "unscale_update": (reset, unscale_update),
        "unscale_update_skip": (reset_inf, unscale_update),
        "readme": (reset, readme),
        "isfinite_all": (reset, lambda: all(np.isfinite(g).all() for g in grads)),
    }


def bench_row(pset: _shapes.ParamSet, dtype: str, rounds: int, warmup: int) -> dict[str, Any]:
    """One interleaved run of every variant on one parameter set and dtype."""
    flat = make_grads(pset, dtype)
    ls = lossscale.DynamicLossScale(SCALE, increment_period=10**9)
    timing = interleaved(variants(flat, views(flat, pset), ls), rounds=rounds, warmup=warmup)
    stats = timing.summary()
    m = stats["median_ms"]
    return {
        "set": pset.name,
        "n_tensors": pset.n_tensors,
        "n_elements": pset.n_elements,
        "dtype": dtype,
        **stats,
        "ratios": {
            "unscale_update_over_floor": m["unscale_update"] / m["floor"],
            "update_over_floor": m["update"] / m["floor"],
            "readme_over_floor": m["readme"] / m["floor"],
            "unscale_update_over_floor_flat": m["unscale_update"] / m["floor_flat"],
        },
    }


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    """The NumPy section of the report."""
    rounds = rounds or (3 if quick else 9)
    warmup = 1
    rows = []
    for pset in _shapes.param_sets(quick):
        for dtype in DTYPES:
            row = bench_row(pset, dtype, rounds, warmup)
            _cli.progress(
                f"numpy {pset.name}/{dtype}: (unscale+update)/floor "
                f"{row['ratios']['unscale_update_over_floor']:.2f}"
            )
            rows.append(row)
    return {
        "framework": "numpy",
        "config": {
            "quick": quick,
            "rounds": rounds,
            "warmup": warmup,
            "scale": SCALE,
            "numpy": np.__version__,
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    args = _cli.parser(__doc__).parse_args(argv)
    return _cli.finish(run(args.quick, args.rounds), args.json, _report.render_numpy)


if __name__ == "__main__":
    raise SystemExit(main())
