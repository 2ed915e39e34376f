"""Data-parallel (DDP) or sharded (FSDP2) float16-style training with one loss scale per job.

Every rank checks its own gradients (FSDP2: its own shards); ``LossScaleOptimizer`` all-reduces
the non-finite flag once per step (MAX, over the default process group), so all ranks skip the
same steps and hold the same scale. One rank injects an overflow at step 3 to show it.

Run (CPU, 2 processes, gloo on loopback)::

    torchrun --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=29500 \\
        examples/distributed_torch.py --backend gloo
    torchrun --nproc_per_node=2 ... examples/distributed_torch.py --fsdp   # FSDP2

On GPUs use ``--backend nccl`` (each rank takes ``cuda:LOCAL_RANK``) and float16 autocast.

CI: run by src/lossscale/torch/_distributed_test.py (under torchrun, 2 ranks, --quick).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

from lossscale.torch import LossScaleOptimizer

OVERFLOW_STEP = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="40 steps (what CI runs)")
    return parser.parse_args(argv)


def build(device: torch.device, fsdp: bool) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)
    ).to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = 40 if args.quick else args.steps
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        autocast = torch.autocast("cuda", dtype=torch.float16)
    else:
        device = torch.device("cpu")
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    model = build(device, args.fsdp)
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        initial_scale=2.0**12,
        dynamic_growth_steps=10,
    )  # process_group=None: the default group, since torch.distributed is initialised
    gen = torch.Generator(device=device).manual_seed(100 + rank)  # each rank its own data
    w_true = torch.linspace(-1, 1, 16, device=device)

    losses = []
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen, device=device)
        y = torch.tanh(x @ w_true)[:, None]
        with autocast:
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.get_scaled_loss(loss).backward()
        if step == OVERFLOW_STEP and rank == world - 1:  # one rank only
            grad = next(iter(model.parameters())).grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    mine = (float(opt.loss_scale), int(opt.skipped_steps), opt.dynamic_counter)
    everyone: list[object] = [None] * world
    dist.all_gather_object(everyone, mine)
    ok = all(other == mine for other in everyone) and mine[1] >= 1
    ok = ok and sum(losses[-5:]) < sum(losses[:5])
    if rank == 0:
        kind = "FSDP2" if args.fsdp else "DDP"
        print(f"{kind} on {world} ranks ({backend}), {steps} steps")
        print(f"loss: {sum(losses[:5]) / 5:.4f} (first 5 steps) -> {sum(losses[-5:]) / 5:.4f}")
        print(f"(loss scale, skipped steps, counter) on each rank: {everyone}")
        print("ranks agree" if ok else "FAILED: ranks disagree or training did not work")
    # Shut down cleanly: free the model and optimizer (FSDP2 keeps tensors that gloo's worker
    # threads may still reference) while the interpreter is fully alive, wait for every rank,
    # then destroy the group. Left to interpreter exit, that clean-up can abort a rank with
    # "terminate called without an active exception" (pytorch#179291).
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
