"""The cost of the distributed agreement: one MAX all-reduce of the non-finite flag per step.

Run: ``python -m benchmarks.torch_dist_bench [--quick] [--rounds N] [--json F]``

Two processes (gloo on 127.0.0.1, CPU) each hold the same parameter sets as the torch benchmark
(24 tensors / 25M elements, 300 transformer-like / 25M, 2000 / 2M; ``--quick``: about 1%) with
SGD (momentum, foreach) gradients, and time, interleaved round by round after a barrier:

  ls_local    ``LossScaleOptimizer`` step without the reduction (its unscale + check, the inner
              step and the scale update: ``_finish(*_prepare())``, what ``step()`` runs when
              torch.distributed is not initialised)
  ls          ``step()``: the same plus the all-reduce over the default group
  allreduce   ``dist.all_reduce`` of a 0-d float32 flag (MAX) alone

Reported (rank 0's medians): ``ls - ls_local`` (the added cost) relative to ``ls``, and the bare
all-reduce relative to ``ls``. A gloo all-reduce on one machine is a loopback round trip; NCCL
on GPUs runs it on the device stream without a host sync. Speed is never asserted.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lossscale.torch import LossScaleOptimizer

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _report, _shapes
from benchmarks._timing import interleaved

WORLD = 2
SCALE = _shapes.SCALE


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(pset: _shapes.ParamSet, rounds: int) -> dict[str, Any]:
    """One interleaved run on this rank (both ranks call it in the same order)."""
    torch.manual_seed(0)
    params = [torch.randn(s).requires_grad_() for s in pset.shapes]
    sizes = [math.prod(s) for s in pset.shapes]
    flat = torch.randn(pset.n_elements) * 1e-3 * SCALE
    saved = flat.clone()
    for p, g, s in zip(params, flat.split(sizes), pset.shapes, strict=True):
        p.grad = g.view(s)
    lso = LossScaleOptimizer(
        torch.optim.SGD(params, lr=1e-9, momentum=0.9, foreach=True),
        dynamic_growth_steps=10**9,
    )
    flag = torch.zeros(())

    def reset() -> None:
        flat.copy_(saved)
        lso._ls.load(SCALE, 0, 0)  # a skip halved it
        lso._step.scaled = True  # the gradients stand for a scaled loss: no warning
        dist.barrier()

    def local_step() -> None:
        with torch.no_grad():
            step = lso._step
            found, unscaled = step.prepare()
            step.record(found, step.apply(found, unscaled)[1])

    def allreduce() -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    timing = interleaved(
        {
            "ls_local": (reset, local_step),
            "ls": (reset, lso.step),
            "allreduce": (dist.barrier, allreduce),
        },
        rounds=rounds,
    )
    summary = timing.summary()
    med = summary["median_ms"]
    return {
        "params": pset.name,
        "n_tensors": pset.n_tensors,
        "n_elements": pset.n_elements,
        "median_ms": med,
        "min_ms": summary["min_ms"],
        "spread": summary["spread"],
        "noisy": summary["noisy"],
        "added_over_step": (med["ls"] - med["ls_local"]) / med["ls"],
        "allreduce_over_step": med["allreduce"] / med["ls"],
    }


def _rank_main(rank: int, port: int, quick: bool, rounds: int, out: str) -> None:
    torch.set_num_threads(1)  # two processes share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=300),
    )
    try:
        rows = [measure(pset, rounds) for pset in _shapes.param_sets(quick)]
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()
    # The rows are saved: leave without the interpreter's teardown, where torch 2.13's gloo
    # now and then aborts a process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(quick: bool, rounds: int | None) -> dict[str, Any]:
    """The JSON section: config and one row per parameter set (rank 0's timings)."""
    rounds = rounds or (3 if quick else 30)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        torch.multiprocessing.start_processes(
            _rank_main,
            args=(_free_port(), quick, rounds, out),
            nprocs=WORLD,
            start_method="spawn",
        )
        rows: list[dict[str, Any]] = torch.load(out)
    return {
        "config": {"ranks": WORLD, "backend": "gloo", "rounds": rounds, "threads_per_rank": 1},
        "rows": rows,
    }


def render(section: dict[str, Any]) -> list[str]:
    return _report.render_torch_dist(section)


def main(argv: list[str] | None = None) -> int:
    args = _cli.parser(__doc__).parse_args(argv)
    return _cli.finish(run(args.quick, args.rounds), args.json, render)


if __name__ == "__main__":
    raise SystemExit(main())
