"""Sharded and parallel training recipes with lossscale: FSDP1, FSDP2, a pipeline schedule and
tensor parallelism, each with one skip decision on every rank.

Run with torchrun on exactly 2 processes (the pipeline recipe has two stages; CPU and gloo here,
on GPUs use nccl and cuda devices)::

    torchrun --nproc_per_node=2 examples/sharded_recipes.py --quick

Each recipe trains a tiny model for a few steps with an overflow injected on the last rank only
at step 3; at the end the ranks compare their loss scale, skipped steps and parameters, and the
script exits with status 1 unless every recipe agrees. docs/sharded.md shows the recipes.

CI: run by src/lossscale/torch/_parallel_test.py (under torchrun, 2 ranks, --quick).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

OVERFLOW_AT = 3
#: The number of processes the recipes need: the pipeline recipe splits the model in two stages.
WORLD_SIZE = 2


def overflow(step: int, grad: Any) -> None:
    """The test's injected overflow: an inf in the last rank's (local) gradient at one step."""
    if step == OVERFLOW_AT and dist.get_rank() == dist.get_world_size() - 1:
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = math.inf


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def fsdp1(steps: int) -> tuple[Any, Any]:
    rank = dist.get_rank()
    # --8<-- [start:fsdp1]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lossscale.torch import ShardedGradScaler  # was: torch.distributed.fsdp.sharded_grad_scaler

    model = FSDP(mlp(), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ShardedGradScaler("cpu", growth_interval=400)  # verl's settings; agrees over WORLD
    for step in range(steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        overflow(step, next(model.parameters()).grad)
        scaler.unscale_(opt)  # the flag is agreed here: every rank sees the same overflow
        model.clip_grad_norm_(1.0)
        scaler.step(opt)  # applied or skipped on every rank together
        scaler.update()
        opt.zero_grad()
    # --8<-- [end:fsdp1]
    return scaler, model


def fsdp2(steps: int) -> tuple[Any, Any]:
    rank = dist.get_rank()
    # --8<-- [start:fsdp2]
    from torch.distributed.fsdp import fully_shard

    from lossscale.torch import GradScaler  # FSDP2 needs no sharded scaler

    model = mlp()
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu")  # process_group=None: the default group
    for step in range(steps):
        x, y = batch(step, rank)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        overflow(step, model[0].weight.grad)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    # --8<-- [end:fsdp2]
    return scaler, model


def pipeline(steps: int) -> tuple[Any, Any]:
    # --8<-- [start:pipeline]
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from lossscale.torch import GradScaler

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = mlp()
    part = layers[0:2] if rank == 0 else layers[2:]  # stage 0: Linear+Tanh, stage 1: Linear
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    scaler = GradScaler("cpu")  # agrees over WORLD: both stages skip together

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The schedule runs backward itself, on what loss_fn returns: scale the loss here.
        return scaler.scale(torch.nn.functional.mse_loss(output, target))

    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = batch(step)
        if rank == 0:
            schedule.step(x)  # the first stage: its gradients arrive scaled
        else:
            schedule.step(target=y)
        overflow(step, part[0].weight.grad)
        scaler.step(opt)  # every stage steps its own parameters, with one decision
        scaler.update()
        opt.zero_grad()
    # --8<-- [end:pipeline]
    return scaler, part


def tensor_parallel(steps: int) -> tuple[Any, Any]:
    # --8<-- [start:tp]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from lossscale.torch import GradScaler

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = torch.nn.Sequential(*mlp(), torch.nn.LayerNorm(2))  # the norm stays unsharded
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu", process_group=mesh.get_group("tp"))
    for step in range(steps):
        x, y = batch(step)  # the same batch on every tensor-parallel rank
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        overflow(step, model[3].weight.grad)  # a plain (non-DTensor) parameter
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    # --8<-- [end:tp]
    return scaler, model


RECIPES = {"fsdp1": fsdp1, "fsdp2": fsdp2, "pipeline": pipeline, "tp": tensor_parallel}


def summary(scaler: Any, model: Any) -> torch.Tensor:
    """What must agree across ranks: scale, skipped steps, and (for replicated parameters: all
    of them after gathering) a checksum of the parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    checksum = 0.0
    with FSDP.summon_full_params(model) if isinstance(model, FSDP) else nullcontext():
        for p in model.parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            checksum += float(full.detach().double().sum())
    return torch.tensor([scaler.get_scale(), float(scaler.skipped_steps), checksum])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps per recipe (CI)")
    args = parser.parse_args(argv)
    steps = 6 if args.quick else 20
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != WORLD_SIZE:  # checked before joining: a wrong size would hang in a collective
        print(
            f"sharded_recipes.py needs exactly {WORLD_SIZE} processes (the pipeline recipe has "
            f"{WORLD_SIZE} stages), got WORLD_SIZE={os.environ.get('WORLD_SIZE')}: run "
            f"torchrun --nproc_per_node={WORLD_SIZE} examples/sharded_recipes.py",
            file=sys.stderr,
        )
        return 2
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rank = dist.get_rank()
    ok = True
    try:
        for name, recipe in RECIPES.items():
            scaler, model = recipe(steps)
            mine = summary(scaler, model)
            if name == "pipeline":  # each stage holds its own parameters: compare the rest
                mine[2] = 0.0
            everyone = [torch.zeros(3, dtype=mine.dtype) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            agree = all(torch.equal(e, everyone[0]) for e in everyone)
            skipped = int(mine[1])
            ok = ok and agree and skipped == 1
            if rank == 0:
                print(f"{name}: scale {mine[0]:.0f}, skipped {skipped}, ranks agree={agree}")
    finally:
        dist.barrier()  # no rank tears down while another still has collectives in flight
        dist.destroy_process_group()
    if not ok:
        print("FAILED: a recipe's ranks disagree, or the overflow was not skipped exactly once")
        return 1
    if rank == 0:
        print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
