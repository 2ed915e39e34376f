"""What the float16 audit costs per batch, against a training step of the same model.

Two Llama-style models built from a config (``lossscale.torch._audit._testing.llama``: 4 layers,
width 256, vocabulary 1024, about 3.2M parameters; 8 x 64 tokens a batch, a token-summed
loss): one with a massive activation in a down projection (the audit finds it, keeps that
module in float32 and runs again), one without (nothing to keep). For each, five variants
run interleaved, once per round (``benchmarks._timing.interleaved``):

- ``fp16_step``: a float16 training step (``torch.autocast``, lossscale's ``GradScaler``,
  SGD): forward, backward, step, update;
- ``fp32_step``: the same step in float32;
- ``audit``: ``lossscale.torch.audit(model, loss, [batch], verify=False)``;
- ``audit_no_report``: the same with ``report=False`` (no numerics rows);
- ``audit_verified``: the same with ``verify=True`` (one more float16 run with the plan);
- ``no_report_verified``: ``report=False, verify=True``.

The ratios are of the medians over the rounds; ``host reads`` is the number of device values
read on the host by one ``audit(..., report=False)`` of the batch (``item()``, ``tolist()``,
value-sized ops: ``lossscale.torch._audit._testing.HostReads``); on CUDA, ``CUDA syncs`` counts
the same audit's syncs by torch's sync debug mode (``CudaSyncs``), ``-`` elsewhere. With
``--large`` (and always with ``--device cuda``) a Llama of about 150M parameters follows (8
layers, width 1024, vocabulary 32000, 8 x 512 tokens, 3 rounds): too big for a CPU run in CI.
On one CPU thread (``torch.set_num_threads(1)``) by default. Run::

    python -m benchmarks.audit_bench                  # 7 rounds
    python -m benchmarks.audit_bench --quick          # a smaller model, 2 rounds (CI)
    python -m benchmarks.audit_bench --device cuda    # on a GPU, the 150M Llama too
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
from typing import Any

if not __package__:  # run as a file: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import _machine
from benchmarks._timing import interleaved
from lossscale.torch import GradScaler, audit
from lossscale.torch._audit import _testing as models

VARIANTS = (
    "fp16_step",
    "fp32_step",
    "audit",
    "audit_no_report",
    "audit_verified",
    "no_report_verified",
)


def _step(model: Any, batch: torch.Tensor, half: bool) -> Any:
    device = next(model.parameters()).device.type
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = GradScaler(device, init_scale=2.0**4, enabled=half)

    def run() -> None:
        with torch.autocast(device, dtype=torch.float16, enabled=half):
            loss = models.token_sum_loss(model, batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    return run


def _build(layers: int, width: int, vocab: int, length: int, device: str, faulty: bool) -> Any:
    model = models.llama(layers, width=width, vocab=vocab, length=length).to(device)
    return models.massive_activation_failure(model) if faulty else model


def measure(name: str, model: Any, batch: torch.Tensor, rounds: int) -> dict[str, Any]:
    """One model's variants, interleaved; medians in ms and the ratios."""
    stepped = copy.deepcopy(model)  # the steps move their weights; the audit reads its own
    last: dict[str, Any] = {}

    def audited(verify: bool, report: bool = True) -> Any:
        def run() -> None:
            last["audit"] = audit(
                model, models.token_sum_loss, [batch], verify=verify, report=report
            )

        return run

    timing = interleaved(
        {
            "fp16_step": (None, _step(stepped, batch, True)),
            "fp32_step": (None, _step(stepped, batch, False)),
            "audit": (None, audited(False)),
            "audit_no_report": (None, audited(False, report=False)),
            "audit_verified": (None, audited(True)),
            "no_report_verified": (None, audited(True, report=False)),
        },
        rounds=rounds,
        warmup=1,
        sync=torch.cuda.synchronize if next(model.parameters()).is_cuda else None,
    )
    medians = {v: timing.median(v) for v in VARIANTS}
    result = last["audit"]
    with models.HostReads() as reads:
        audit(model, models.token_sum_loss, [batch], report=False)
    syncs = None
    if next(model.parameters()).is_cuda:
        with models.CudaSyncs() as counted:
            audit(model, models.token_sum_loss, [batch], report=False)
        syncs = counted.count
    return {
        "model": name,
        "kept": len(result.float32_modules),
        "modules": result.modules,
        "median_ms": {v: m * 1e3 for v, m in medians.items()},
        "audit_over_fp16_step": medians["audit"] / medians["fp16_step"],
        "audit_over_fp32_step": medians["audit"] / medians["fp32_step"],
        "no_report_over_fp16_step": medians["audit_no_report"] / medians["fp16_step"],
        "verified_over_fp16_step": medians["audit_verified"] / medians["fp16_step"],
        "no_report_verified_over_fp16_step": (medians["no_report_verified"] / medians["fp16_step"]),
        "fp16_over_fp32_step": medians["fp16_step"] / medians["fp32_step"],
        "noisy": timing.noisy(),
        "host_reads": reads.count,
        "cuda_syncs": syncs,
    }


#: (layers, width, vocabulary, tokens, batch, rounds) per size.
SIZES = {
    "quick": (4, 64, 256, 32, 4, 2),
    "default": (4, 256, 1024, 64, 8, 7),
    "large": (8, 1024, 32000, 512, 8, 3),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 2 rounds")
    parser.add_argument("--large", action="store_true", help="the 150M Llama too")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = ["quick"] if args.quick else ["default"]
    if args.large or args.device.startswith("cuda"):
        sizes.append("large")
    facts = _machine.facts()
    fp16 = {True: "yes", False: "no", None: "unknown"}[_machine.cpu_has("avx512_fp16")]
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    for size in sizes:
        layers, width, vocab, length, batch_size, rounds = SIZES[size]
        rounds = args.rounds or rounds

        build = functools.partial(_build, layers, width, vocab, length, args.device)
        batch = models.batches(1, vocab=vocab, shape=(batch_size, length))[0]
        params = sum(p.numel() for p in build(False).parameters())
        print(
            f"{gpu or facts['cpu']}, {args.threads} CPU thread(s), AVX512-FP16 "
            f"{fp16}; torch {torch.__version__}; {layers} layers, "
            f"{params / 1e6:.1f}M parameters, {batch_size} x {length} tokens, {rounds} rounds"
        )
        print(
            "| model | kept in float32 | fp16 step ms | fp32 step ms | audit ms "
            "| audit / fp16 step | audit / fp32 step | no report / fp16 step "
            "| audit + verify / fp16 step | no report + verify / fp16 step | fp16 / fp32 step "
            "| host reads | CUDA syncs |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, faulty in (("massive activation", True), ("clean", False)):
            r = measure(name, build(faulty), batch, rounds)
            ms = r["median_ms"]
            noisy = " (noisy)" if r["noisy"] else ""
            print(
                f"| {name}{noisy} | {r['kept']} of {r['modules']} | {ms['fp16_step']:.1f} | "
                f"{ms['fp32_step']:.1f} | {ms['audit']:.1f} | "
                f"{r['audit_over_fp16_step']:.2f}x | {r['audit_over_fp32_step']:.2f}x | "
                f"{r['no_report_over_fp16_step']:.2f}x | {r['verified_over_fp16_step']:.2f}x | "
                f"{r['no_report_verified_over_fp16_step']:.2f}x | "
                f"{r['fp16_over_fp32_step']:.2f}x | {r['host_reads']} | "
                f"{'-' if r['cuda_syncs'] is None else r['cuda_syncs']} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
