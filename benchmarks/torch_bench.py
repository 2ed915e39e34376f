"""lossscale.torch.LossScaleOptimizer vs torch.amp.GradScaler vs the bare optimizer step.

Run: ``.venv/bin/python benchmarks/torch_bench.py [--quick] [--json out.json] [--device cpu]``

Per parameter set and optimizer variant, one process, interleaved rounds, medians:
  bare      inner optimizer step alone
  gs        torch.amp.GradScaler: scale, step (unscale_ inside, or grad_scale for fused), update
  ls        LossScaleOptimizer: get_scaled_loss, step
  gs_skip / ls_skip   the same with one inf gradient (the step is skipped)
  floor     one in-place multiply over all gradient bytes (torch._foreach_mul_)
  ls_unscale          lossscale's fused unscale + non-finite check alone
Ratios: overhead = (ls - bare) / (gs - bare) (target <= 1; <= 0.5 on the 2000-tensor set) and
ls_unscale / floor. Speed thresholds are never asserted: CI runs ``--quick`` only to keep this
script working.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved

from lossscale.torch import LossScaleOptimizer


def param_sets(scale: float) -> dict[str, list[tuple[int, ...]]]:
    """Three shapes of model: few big tensors, transformer-like, many small tensors."""
    n = max(1, int(1024 * 1024 * scale))
    big = [(n,)] * 24  # 24 tensors, ~25M elements
    width = max(8, int(288 * math.sqrt(scale)))
    layer = [
        (width, 3 * width),
        (3 * width,),
        (width, width),
        (width,),
        (width, 4 * width),
        (4 * width,),
        (4 * width, width),
        (width,),
        (width,),
        (width,),
        (width,),
        (width,),
    ]
    transformer = layer * 25  # 300 tensors, ~25M elements
    small = [(max(1, int(1000 * scale)),)] * 2000  # 2000 tensors, ~2M elements
    return {"24x25M": big, "300x25M": transformer, "2000x2M": small}


def optimizer_variants(device: str) -> dict[str, Callable[[list[torch.Tensor]], Any]]:
    out: dict[str, Callable[[list[torch.Tensor]], Any]] = {}
    for impl in ("forloop", "foreach", "fused"):
        kw = {
            "forloop": {"foreach": False},
            "foreach": {"foreach": True},
            "fused": {"fused": True},
        }[impl]
        out[f"SGDm-{impl}"] = lambda ps, kw=kw: torch.optim.SGD(ps, lr=1e-6, momentum=0.9, **kw)
        out[f"AdamW-{impl}"] = lambda ps, kw=kw: torch.optim.AdamW(ps, lr=1e-6, **kw)
    return out


def count_syncs(fn: Callable[[], None]) -> int | None:
    """Host syncs of one call, via CUDA's sync debug mode (None when not on CUDA)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def bench_one(shapes, make_opt, device, rounds) -> dict[str, Any]:
    torch.manual_seed(0)
    params = [torch.randn(s, device=device).requires_grad_() for s in shapes]
    grads = [torch.randn(s, device=device) * 1e-3 for s in shapes]
    saved = [g.clone() for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    bare = make_opt(params)
    gs_opt = make_opt(params)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**15, growth_interval=10**9)
    lso = LossScaleOptimizer(make_opt(params), dynamic_growth_steps=10**9)
    loss = torch.ones((), device=device, requires_grad=True)

    def reset() -> None:
        torch._foreach_copy_(grads, saved)

    def reset_inf() -> None:
        reset()
        grads[len(grads) // 2].view(-1)[0] = math.inf

    def gs_step() -> None:
        scaler.scale(loss)
        scaler.step(gs_opt)
        scaler.update(new_scale=2.0**15)  # keep the scale fixed across skip rounds

    def ls_step() -> None:
        lso.get_scaled_loss(loss)
        lso.step()
        lso._loss_scale.load_state_dict(  # keep the scale fixed across skip rounds (no sync)
            {
                "version": 1,
                "class_name": "DynamicLossScale",
                "current_loss_scale": 2.0**15,
                "num_good_steps": 0,
                "num_nonfinite_steps": 0,
            }
        )

    sync = torch.cuda.synchronize if device == "cuda" else None
    variants = {
        "bare": (reset, bare.step),
        "gs": (reset, gs_step),
        "ls": (reset, ls_step),
        "gs_skip": (reset_inf, gs_step),
        "ls_skip": (reset_inf, ls_step),
        "floor": (reset, lambda: torch._foreach_mul_(grads, 0.5)),
        "ls_unscale": (reset, lambda: (lso._unscale_all(), setattr(lso, "_unscaled_found", None))),
    }
    timing = interleaved(variants, rounds=rounds, sync=sync)
    med = {k: timing.median(k) * 1e3 for k in variants}
    gs_over = med["gs"] - med["bare"]
    result = {
        "median_ms": med,
        "spread": {k: timing.spread(k) for k in variants},
        "noisy": timing.noisy(),
        "overhead_ratio": (med["ls"] - med["bare"]) / gs_over if gs_over > 0 else None,
        "unscale_over_floor": med["ls_unscale"] / med["floor"],
    }
    if device == "cuda":
        reset()
        result["syncs_per_step"] = {"gs": count_syncs(gs_step), "ls": count_syncs(ls_step)}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (CI)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--only", default=None, help="substring filter on 'set/optimizer'")
    args = ap.parse_args(argv)
    scale = 0.01 if args.quick else 1.0
    rounds = args.rounds or (2 if args.quick else 7)
    results: dict[str, Any] = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": args.device,
            "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        },
        "quick": args.quick,
        "rounds": rounds,
        "runs": {},
    }
    header = (
        f"{'set':8} {'optimizer':15} {'bare':>8} {'gs':>8} {'ls':>8} {'gs_skip':>8} "
        f"{'ls_skip':>8} {'floor':>7} {'ls_unsc':>7} {'ovh(ls)/ovh(gs)':>16} {'unsc/floor':>10}"
    )
    print(header)
    for set_name, shapes in param_sets(scale).items():
        for opt_name, make in optimizer_variants(args.device).items():
            key = f"{set_name}/{opt_name}"
            if args.only and args.only not in key:
                continue
            r = bench_one(shapes, make, args.device, rounds)
            results["runs"][key] = r
            m = r["median_ms"]
            ratio = "n/a" if r["overhead_ratio"] is None else f"{r['overhead_ratio']:.2f}"
            flag = "  (noisy)" if r["noisy"] else ""
            print(
                f"{set_name:8} {opt_name:15} {m['bare']:8.2f} {m['gs']:8.2f} {m['ls']:8.2f} "
                f"{m['gs_skip']:8.2f} {m['ls_skip']:8.2f} {m['floor']:7.2f} {m['ls_unscale']:7.2f} "
                f"{ratio:>16} {r['unscale_over_floor']:10.2f}{flag}",
                flush=True,
            )
    noisy = sum(r["noisy"] for r in results["runs"].values())
    if noisy:
        print(
            f"note: {noisy} of {len(results['runs'])} rows had an interquartile spread > 25% "
            f"of the median: the machine was noisy; compare ratios, rerun for tighter numbers"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
