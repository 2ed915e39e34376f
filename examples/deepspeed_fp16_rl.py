"""An fp16 RL actor update (PPO's clipped objective) on a DeepSpeed ZeRO-2 engine with lossscale.

The engine is configured as OpenRLHF configures fp16 (``"fp16": {"enabled": true}``, all of
DeepSpeed's defaults: 2**16, window 1000, hysteresis 2, floor 1) and gets lossscale's rule with
one call, ``lossscale.deepspeed.install(engine)``. Two ranks train; an overflow is injected on
the last rank only at step 4. The script checks that both ranks skipped that step and only that
one, that DeepSpeed counted it (``engine.skipped_steps``) and held the LR schedule back, that the
ranks hold the same scale and weights, and exits with status 1 otherwise.

Run it as it is (it starts two CPU processes joined by gloo on 127.0.0.1, on any CPU: it lifts
DeepSpeed's check for float16 instructions there), or under a launcher
(``deepspeed --num_gpus 2 examples/deepspeed_fp16_rl.py`` on GPUs)::

    python examples/deepspeed_fp16_rl.py --quick
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist

OBS, ACTIONS, BATCH, CLIP = 8, 4, 16, 0.2
INJECT_AT = 4


def rollout(policy: torch.nn.Module, step: int, rank: int) -> dict[str, torch.Tensor]:
    """A stand-in for a rollout: observations, the old policy's actions and log-probabilities,
    and normalised advantages (each rank its own)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    obs = torch.randn(BATCH, OBS, generator=g).to(next(policy.parameters()).dtype)
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
    """PPO's clipped surrogate, computed in float32 from the float16 logits."""
    logp = torch.log_softmax(policy(batch["obs"]).float(), dim=-1)
    logp = logp.gather(1, batch["actions"][:, None]).squeeze(1)
    ratio = torch.exp(logp - batch["old_logp"])
    adv = batch["advantages"]
    return -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()


def train(steps: int) -> bool:
    import deepspeed

    from lossscale.deepspeed import install

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    policy = torch.nn.Sequential(
        torch.nn.Linear(OBS, 32), torch.nn.Tanh(), torch.nn.Linear(32, ACTIONS)
    )
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": True},  # OpenRLHF's fp16 config: DeepSpeed's defaults
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=policy, optimizer=opt, lr_scheduler=sched, config=config
    )
    scaler = install(engine)  # lossscale's rule: a floor, hysteresis, one decision, a stall alarm
    skipped_at = []
    for step in range(steps):
        batch = rollout(engine.module, step, rank)
        loss = actor_loss(engine, batch)
        if step == INJECT_AT and rank == world - 1:
            loss = loss * float("inf")  # an overflow on the last rank only
        engine.backward(loss)
        engine.step()
        if not engine.was_step_applied():
            skipped_at.append(step)
    weights = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    scales = [0.0] * world
    dist.all_gather_object(scales, scaler.cur_scale)
    ok = (
        skipped_at == [INJECT_AT]
        and engine.skipped_steps == 1
        and sched.last_epoch == steps - 1
        and len(set(scales)) == 1
        and all(torch.equal(gathered[0], g) for g in gathered)
    )
    if rank == 0:
        agree = len(set(scales)) == 1
        print(
            f"ZeRO-2 fp16, {world} ranks, {steps} PPO steps, overflow injected at step {INJECT_AT}"
        )
        print(f"skipped steps {engine.skipped_steps} (at {skipped_at}), scale {scaler.cur_scale}")
        print(f"LR schedule steps {sched.last_epoch} of {steps}; ranks agree: {agree}")
    return ok


def _worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
    )  # fmt: skip
    # On the CPU: DeepSpeed's CPU accelerator, and gloo instead of building its C++ shm op.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed allows fp16 only on CPUs with AVX512-FP16 or AMX; torch's float16 runs on any
    # CPU (emulated where those instructions are missing), so lift the check for this run.
    CPU_Accelerator.is_fp16_supported = lambda self: True
    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    ok = train(steps)
    if rank == 0:
        with open(out, "w") as f:
            f.write("OK" if ok else "FAILED")
    dist.barrier()
    sys.stdout.flush()
    # Leave without the C++ teardown of gloo's group and DeepSpeed's engine: when one rank
    # exits first, the other's teardown can abort ("terminate called without an active
    # exception"). Everything this process reports is written by now.
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 steps (default 40)")
    steps = 12 if parser.parse_args().quick else 40
    if "RANK" in os.environ:  # under a launcher: this process is one rank
        import deepspeed

        deepspeed.init_distributed()
        ok = train(steps)
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        torch.multiprocessing.spawn(_worker, args=(2, port, steps, out), nprocs=2)
        with open(out) as f:
            result = f.read()
    print(result)
    return 0 if result == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
