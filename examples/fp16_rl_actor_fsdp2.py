"""An fp16 RL-style actor update (PPO's clipped objective) under FSDP2 with lossscale.

float16 autocast, FSDP2 (``fully_shard``), ``lossscale.torch.GradScaler``, gradient clipping
after ``unscale_``, and a learning-rate schedule that advances only on applied steps. Run with
torchrun (CPU and gloo here; on GPUs use nccl, cuda devices and ``torch.autocast("cuda")``)::

    torchrun --nproc_per_node=2 examples/fp16_rl_actor_fsdp2.py --quick

An overflow is injected on the last rank only at step 4. The script checks that every rank
skipped that step (and only steps it skipped on every rank), that the schedule advanced once
per applied step, that the ranks hold the same scale and weights, and exits with status 1
otherwise.

CI: run by src/lossscale/torch/_parallel_test.py (under torchrun, 2 ranks, --quick).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from lossscale.torch import GradScaler

OBS, ACTIONS, BATCH, CLIP = 8, 4, 64, 0.2
INJECT_AT = 4


def rollout(policy: torch.nn.Module, step: int, rank: int) -> dict[str, torch.Tensor]:
    """A stand-in for a rollout: observations, the old policy's actions and log-probabilities,
    and normalised advantages (each rank its own)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    obs = torch.randn(BATCH, OBS, generator=g)
    with torch.no_grad():
        logp_all = torch.log_softmax(policy(obs).float(), dim=-1)
    actions = torch.multinomial(logp_all.exp(), 1, generator=g).squeeze(1)
    advantages = torch.randn(BATCH, generator=g)
    return {
        "obs": obs,
        "actions": actions,
        "old_logp": logp_all.gather(1, actions[:, None]).squeeze(1),
        "advantages": (advantages - advantages.mean()) / (advantages.std() + 1e-8),
    }


def actor_loss(policy: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        logits = policy(batch["obs"])
    logp = torch.log_softmax(logits.float(), dim=-1)  # log-probabilities in float32
    logp = logp.gather(1, batch["actions"][:, None]).squeeze(1)
    ratio = torch.exp(logp - batch["old_logp"])
    clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    return -torch.min(ratio * batch["advantages"], clipped * batch["advantages"]).mean()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 steps (CI)")
    args = parser.parse_args(argv)
    steps = 12 if args.quick else 200
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        # --8<-- [start:update]
        torch.manual_seed(0)  # the same initial weights on every rank
        policy = torch.nn.Sequential(
            torch.nn.Linear(OBS, 32), torch.nn.Tanh(), torch.nn.Linear(32, ACTIONS)
        )
        for layer in (policy[0], policy[2]):
            fully_shard(layer)
        fully_shard(policy)
        opt = torch.optim.AdamW(policy.parameters(), lr=3e-4)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: min(1.0, (n + 1) / 5))
        scaler = GradScaler("cpu", init_scale=2.0**16, growth_interval=400)
        applied = []
        for step in range(steps):
            batch = rollout(policy, step, rank)
            scaler.scale(actor_loss(policy, batch)).backward()
            if step == INJECT_AT and rank == world - 1:  # one rank's shard overflows
                policy[0].weight.grad.to_local().view(-1)[0] = math.inf
            scaler.unscale_(opt)  # the non-finite flag is agreed across ranks here
            torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scaler.step_scheduler(warmup)  # skip-aware: no LR step for a skipped step
            applied.append(scaler.read_last_step_applied())
        # --8<-- [end:update]
        skipped = int(scaler.skipped_steps)
        state = torch.tensor(
            [scaler.get_scale(), skipped, warmup.last_epoch]
            + [float(p.detach().full_tensor().double().sum()) for p in policy.parameters()],
            dtype=torch.float64,
        )
        everyone = [torch.zeros_like(state) for _ in range(world)]
        dist.all_gather(everyone, state)
    finally:
        dist.barrier()  # no rank tears down while another still has collectives in flight
        dist.destroy_process_group()
    agree = all(torch.equal(e, everyone[0]) for e in everyone)
    ok = agree and not applied[INJECT_AT] and warmup.last_epoch == sum(applied)
    if rank == 0:
        print(f"fp16 actor, FSDP2 on {world} ranks, {steps} steps")
        skip = not applied[INJECT_AT]
        print(f"skipped steps {skipped} (the injected overflow at step {INJECT_AT}: {skip})")
        print(f"scale {scaler.get_scale():.0f}, LR schedule steps {warmup.last_epoch} of {steps}")
        print(f"ranks agree={agree}")
        print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
