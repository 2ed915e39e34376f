"""A GPT-2 trained in float16 with lossscale's GradScaler and with torch's, side by side.

A ``GPT2LMHeadModel`` built from a config (6 layers, width 512, 8 heads, GPT-2's vocabulary;
nothing is downloaded), 16 x 256 tokens a batch (random ids, 8 batches in turn), fused AdamW
(lr 1e-4), dropout as GPT-2's config has it (seeded per step, the same masks in every run),
``torch.autocast`` in float16, ``scaler.unscale_`` then gradient clipping to norm
1.0, ``step``, ``update``: 150 steps from the same weights with each of

- ``torch``: ``torch.amp.GradScaler`` (its defaults: 2**16, growth every 2000 steps);
- ``lossscale``: ``lossscale.torch.GradScaler`` (the same defaults);
- ``lossscale_device_skip``: the same with ``device_side_skip=True`` (a fused optimizer on a
  GPU skips in its kernel, with no host sync).

The three run interleaved, one step of each in turn, each step timed alone (the device
synchronised around it). Reported: whether each lossscale run's losses, skipped steps and
scales equal torch's bit for bit; the median step time and its ratio to torch's; and the host
syncs of a step in steady state (a few steps more after the compared ones: on CUDA the
warnings of ``torch.cuda.set_sync_debug_mode("warn")``; on every device the
``aten._local_scalar_dense`` calls, each a device value read on the host), beside those of the
same step without a scaler (the model's and the clipping's own).

Exit status 1 when a run's losses are not bit-equal to torch's. Run::

    python -m benchmarks.gpt2_side_by_side --device cuda            # the measured run
    python -m benchmarks.gpt2_side_by_side --quick                  # tiny, on the CPU (tests)
    python -m benchmarks.gpt2_side_by_side --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if not __package__:  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import _machine
from benchmarks.torch_bench import count_syncs

VARIANTS = ("torch", "lossscale", "lossscale_device_skip")
#: (layers, width, heads, vocabulary, batch, tokens, steps, initial scale) per size; the quick
#: run starts at 2**24, where its gradients overflow, so that both scalers skip and back off.
SIZES = {
    "full": (6, 512, 8, 50257, 16, 256, 150, 2.0**16),
    "quick": (2, 32, 2, 128, 4, 16, 12, 2.0**24),
}
#: Steps run after the compared ones to count host syncs (the first warms caches up).
COUNTED_STEPS = 3


def gpt2(layers: int, width: int, heads: int, vocab: int, tokens: int, device: str) -> Any:
    """A ``GPT2LMHeadModel`` from a config, seeded, on ``device``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=tokens
    )
    return GPT2LMHeadModel(config).to(device)


def make_scaler(variant: str, device: str, init_scale: float) -> Any:
    if variant == "torch":
        return torch.amp.GradScaler(device, init_scale=init_scale)
    from lossscale.torch import GradScaler

    skip = variant == "lossscale_device_skip"
    return GradScaler(device, init_scale=init_scale, device_side_skip=skip)


class Run:
    """One model, its fused AdamW and its scaler; ``step(ids, seed)`` trains one step and keeps
    its loss (on the device)."""

    def __init__(self, variant: str, base: Any, device: str, init_scale: float) -> None:
        self.model = copy.deepcopy(base)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.scaler = make_scaler(variant, device, init_scale)
        self.device = device
        self.losses: list[torch.Tensor] = []
        self.scales: list[float] = []  # read after each timed step, outside its time

    def step(self, ids: torch.Tensor, seed: int) -> None:
        torch.manual_seed(seed)  # the same dropout masks in every run (CPU and CUDA RNGs)
        with torch.autocast(self.device, dtype=torch.float16):
            loss = self.model(input_ids=ids, labels=ids).loss
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())


class Bare(Run):
    """The same step without a scaler (no loss scaling): the model's and the clipping's own
    host syncs, for reference."""

    def step(self, ids: torch.Tensor, seed: int) -> None:
        torch.manual_seed(seed)
        with torch.autocast(self.device, dtype=torch.float16):
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _Reads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (a device value read on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.count += 1
        return func(*args, **(kwargs or {}))


def host_syncs(step: Callable[[], None], device: str) -> dict[str, int | None]:
    """The host syncs of one call of ``step``: CUDA's sync debug mode warnings (None off
    CUDA) and the ``_local_scalar_dense`` calls."""
    cuda = count_syncs(None, step) if device == "cuda" else None
    with _Reads() as reads:
        step()
    return {"cuda_sync_debug": cuda, "local_scalar_dense": reads.count}


def side_by_side(size: str, device: str, steps: int | None = None) -> dict[str, Any]:
    """Train each variant ``steps`` steps, interleaved; the comparison (see the module)."""
    layers, width, heads, vocab, batch, tokens, default_steps, init_scale = SIZES[size]
    steps = steps or default_steps
    base = gpt2(layers, width, heads, vocab, tokens, device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, tokens), generator=g).to(device) for _ in range(8)]
    runs = {v: Run(v, base, device, init_scale) for v in VARIANTS}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(steps):
        for v in VARIANTS:
            sync()
            start = time.perf_counter()
            runs[v].step(batches[i % len(batches)], seed=i)
            sync()
            times[v].append(time.perf_counter() - start)
            runs[v].scales.append(float(runs[v].scaler.get_scale()))
    losses = {v: torch.stack(r.losses).float().cpu() for v, r in runs.items()}
    scales = {v: torch.tensor(r.scales) for v, r in runs.items()}
    syncs = {}
    for v, r in runs.items():
        for k in range(COUNTED_STEPS - 1):
            r.step(batches[0], seed=steps + k)
        syncs[v] = host_syncs(lambda r=r: r.step(batches[1], seed=steps), device)
    bare = Bare("torch", base, device, init_scale)
    for k in range(COUNTED_STEPS - 1):
        bare.step(batches[0], seed=steps + k)
    bare_syncs = host_syncs(lambda: bare.step(batches[1], seed=steps), device)
    warm = times["torch"][steps // 10 :] or times["torch"]
    torch_ms = statistics.median(warm) * 1e3
    out: dict[str, Any] = {}
    for v in VARIANTS:
        ms = statistics.median(times[v][steps // 10 :] or times[v]) * 1e3
        out[v] = {
            "losses_bit_equal": torch.equal(losses[v], losses["torch"]),
            "scales_equal": torch.equal(scales[v], scales["torch"]),
            "skipped": int((scales[v][1:] < scales[v][:-1]).sum()) + int(scales[v][0] < init_scale),
            "final_scale": float(scales[v][-1]),
            "final_loss": float(losses[v][-1]),
            "median_step_ms": ms,
            "step_time_over_torch": ms / torch_ms,
            "syncs_per_step": syncs[v],
        }
    params = sum(p.numel() for p in base.parameters())
    return {
        "size": size,
        "device": device,
        "steps": steps,
        "initial_scale": init_scale,
        "shape": {"layers": layers, "width": width, "batch": batch, "tokens": tokens},
        "parameters": params,
        "bare_syncs_per_step": bare_syncs,
        "variants": out,
    }


def table(result: dict[str, Any]) -> str:
    """The result as a Markdown table with a heading line."""
    shape = result["shape"]
    lines = [
        f"GPT-2 {shape['layers']} layers x {shape['width']}, {result['parameters'] / 1e6:.1f}M "
        f"parameters, {shape['batch']} x {shape['tokens']} tokens, {result['steps']} float16 "
        f"steps on {result['device']}",
        "| scaler | losses bit-equal to torch's | scales equal | skipped | final scale "
        "| median step ms | step time / torch's | host syncs per step (CUDA debug mode / "
        "_local_scalar_dense) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    b = result["bare_syncs_per_step"]
    cuda = "-" if b["cuda_sync_debug"] is None else str(b["cuda_sync_debug"])
    lines.append(
        f"| (no scaler: the model's own) | | | | | | | {cuda} / {b['local_scalar_dense']} |"
    )
    for v, r in result["variants"].items():
        s = r["syncs_per_step"]
        cuda = "-" if s["cuda_sync_debug"] is None else str(s["cuda_sync_debug"])
        lines.append(
            f"| {v} | {'yes' if r['losses_bit_equal'] else 'NO'} | "
            f"{'yes' if r['scales_equal'] else 'NO'} | {r['skipped']} | "
            f"{r['final_scale']:g} | {r['median_step_ms']:.2f} | "
            f"{r['step_time_over_torch']:.3f}x | {cuda} / {s['local_scalar_dense']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2, 12 steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the result here too")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if args.device.startswith("cuda") else args.device
    result = side_by_side("quick" if args.quick else "full", device, args.steps)
    facts = _machine.facts()
    result["machine"] = torch.cuda.get_device_name() if device == "cuda" else facts["cpu"]
    result["torch"] = torch.__version__
    print(f"{result['machine']}; torch {result['torch']}")
    print(table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**result, "facts": facts}, f, indent=2)
    equal = all(r["losses_bit_equal"] for r in result["variants"].values())
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
