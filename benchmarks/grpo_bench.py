"""The cost of ``lossscale.accelerate.install`` in a TRL GRPO step, beside torch's GradScaler.

Run: ``python -m benchmarks.grpo_bench [--quick] [--rounds N] [--json F]``

TRL's ``GRPOTrainer(fp16=True)`` on the CPU (float16 autocast) with a tiny Llama-style model
built from a config over a character tokenizer (the GRPO tests' set-up,
``lossscale.accelerate._testing``): 4 prompts a step, 4 completions of up to 6 characters each,
AdamW (torch's, not fused), gradient clipping at 1.0 (so ``unscale_`` runs). Two variants:

  torch      ``torch.amp.GradScaler("cpu")`` as ``accelerator.scaler`` with ``native_amp`` on:
             what Accelerate builds on a GPU, set by hand (on the CPU it builds none)
  lossscale  ``lossscale.accelerate.install(trainer)``

Both with GradScaler's defaults. Each round builds a fresh trainer per variant (untimed; the
variants in rotating order, as ``_timing.interleaved``) and trains ``steps`` steps; timed per
round: the median step (``on_step_begin`` to ``on_step_end``: generation, reward, forward,
backward, clipping, the optimizer step) and the time inside the scaler's four calls per step
(``scale``, ``unscale_``, ``step`` with AdamW's step inside, ``update``). Ratios, lossscale
over torch, of the medians over rounds: ``step`` and ``scaler``; and ``install`` itself (ms).
Speed is never asserted.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed, imported by transformers, is quiet

import importlib.metadata
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _report
from benchmarks._timing import Timing

VARIANTS = ("torch", "lossscale")
SCALER_CALLS = ("scale", "unscale_", "step", "update")


def _timed_scaler(scaler: Any, spent: list[float]) -> None:
    """Wrap ``scaler``'s four calls (on the instance) so that their time adds to ``spent``."""
    for name in SCALER_CALLS:
        method = getattr(scaler, name)

        def timed(*args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(scaler, name, timed)


def one_run(variant: str, steps: int, layers: int, width: int) -> dict[str, Any]:
    """Build a trainer for ``variant`` and train ``steps`` steps: the step times (s), the time
    in the scaler per step (s) and the install call's time (s, lossscale only)."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from lossscale.accelerate import install
    from lossscale.accelerate._testing import grpo_trainer, tiny_llama

    with tempfile.TemporaryDirectory() as out:
        trainer = grpo_trainer(tiny_llama(layers=layers, width=width), out, max_steps=steps)
        trainer.remove_callback(PrinterCallback)
        install_s = None
        if variant == "torch":
            trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
            trainer.accelerator.native_amp = True
        else:
            t0 = time.perf_counter()
            install(trainer)
            install_s = time.perf_counter() - t0
        spent = [0.0]
        _timed_scaler(trainer.accelerator.scaler, spent)
        times: list[float] = []
        in_scaler: list[float] = []

        class Clock(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                self.t0 = time.perf_counter()
                spent[0] = 0.0

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                times.append(time.perf_counter() - self.t0)
                in_scaler.append(spent[0])

        trainer.add_callback(Clock())
        trainer.train()
    return {"steps": times, "scaler": in_scaler, "install": install_s}


def run(quick: bool, rounds: int | None) -> dict[str, Any]:
    """Every round, each variant once (rotating order); the section, JSON-ready."""
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    rounds = rounds or (2 if quick else 7)
    steps, layers, width = (3, 1, 16) if quick else (10, 2, 64)
    warmup = 1
    step_timing = Timing({name: [] for name in VARIANTS})
    scaler_timing = Timing({name: [] for name in VARIANTS})
    installs: list[float] = []
    for r in range(warmup + rounds):
        order = list(VARIANTS[r % 2 :] + VARIANTS[: r % 2])
        for variant in order:
            _cli.progress(f"grpo: round {r + 1 - warmup}/{rounds} {variant}")
            out = one_run(variant, steps, layers, width)
            if r < warmup:
                continue
            step_timing.samples[variant].append(statistics.median(out["steps"]))
            scaler_timing.samples[variant].append(statistics.median(out["scaler"]))
            if out["install"] is not None:
                installs.append(out["install"])
    stats = step_timing.summary()
    scaler_ms = {n: scaler_timing.median(n) * 1e3 for n in VARIANTS}
    row = {
        "model": f"Llama {layers} layer(s), width {width}",
        **stats,
        "scaler_ms": scaler_ms,
        "install_ms": statistics.median(installs) * 1e3,
        "ratios": {
            "step": step_timing.median("lossscale") / step_timing.median("torch"),
            "scaler": scaler_ms["lossscale"] / scaler_ms["torch"],
        },
    }
    versions = {p: importlib.metadata.version(p) for p in ("trl", "transformers", "accelerate")}
    return {
        "config": {"rounds": rounds, "steps": steps, "device": "cpu", "versions": versions},
        "rows": [row],
    }


def render(section: dict[str, Any]) -> list[str]:
    return _report.render_grpo(section)


def main(argv: list[str] | None = None) -> int:
    args = _cli.parser(__doc__).parse_args(argv)
    return _cli.finish(run(args.quick, args.rounds), args.json, render)


if __name__ == "__main__":
    raise SystemExit(main())
