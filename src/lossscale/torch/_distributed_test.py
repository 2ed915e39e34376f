"""Data-parallel and sharded training: real multi-process jobs, gloo on loopback (127.0.0.1).

Each world size (2 and 4 ranks) is one job that runs every scenario in turn (a process start
costs a torch import, so scenarios share a job); each rank saves what it saw and the tests
compare the ranks. Overflows are injected on one rank only, after DDP's gradient all-reduce,
so without lossscale's flag reduction the ranks would decide differently: the "isolated"
scenario (a one-rank process group per rank) shows that they then do.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from lossscale import DynamicLossScale  # noqa: E402
from lossscale._testing import run_gloo_job, run_torchrun, tensors_equal  # noqa: E402
from lossscale.torch import LossScaleOptimizer, step_together  # noqa: E402

JOB_TIMEOUT_S = 240.0  # the whole job, all ranks; a deadlock fails the test instead of hanging
STEPS = 24
INITIAL_SCALE = 2.0**10
GROWTH_STEPS = 3
INNERS = ("sgd_foreach", "adamw_forloop", "adamw_fused", "adam_foreach")
CHECKPOINT_AT = 10


# -- the job ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every rank's results of one job (run once per world size)."""
    world = request.param
    out = tmp_path_factory.mktemp(f"world{world}")
    return run_gloo_job(_suite, world, JOB_TIMEOUT_S, out, args=(out,))


# -- scenarios (run inside every rank) ---------------------------------------------------------
def _schedule(world: int, seed: int) -> dict[int, int]:
    """step -> the one rank that overflows at that step (the same on every rank)."""
    rng = random.Random(seed)
    steps = rng.sample(range(1, STEPS), 6)
    return {s: rng.randrange(world) for s in steps}


def _model() -> Any:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)
    )


def _inner(name: str, params: Any) -> Any:
    if name == "sgd_foreach":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    if name == "adamw_forloop":
        return torch.optim.AdamW(params, lr=1e-2, foreach=False)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.Adam(params, lr=1e-2, foreach=True)


def _batch(rank: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _snapshot(module: Any) -> list[Any]:
    return [p.detach().clone() for p in module.parameters()]


def _record(opt: Any) -> tuple[float, int, bool]:
    return (float(opt.loss_scale), int(opt.dynamic_counter), bool(opt.last_step_applied))


def _train(
    rank: int,
    world: int,
    model: Any,
    opt: Any,
    schedule: dict[int, int],
    steps: range,
    count: list[int] | None = None,
) -> dict[str, Any]:
    """Train on per-rank batches; at a scheduled step, the scheduled rank's gradient turns inf
    after backward (and after DDP's all-reduce)."""
    trajectory, unchanged_on_skip = [], []
    for step in steps:
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.get_scaled_loss(loss).backward()
        if schedule.get(step) == rank:
            next(iter(model.parameters())).grad.view(-1)[0] = math.inf
        before = _snapshot(model)
        calls = _count_all_reduces(count)
        try:
            opt.step()
        finally:
            _restore_all_reduce(calls)
        trajectory.append(_record(opt))
        if not trajectory[-1][2]:
            after = _snapshot(model)
            unchanged_on_skip.append(tensors_equal(before, after))
        opt.zero_grad()
    return {
        "trajectory": trajectory,
        "unchanged_on_skip": unchanged_on_skip,
        "params": _snapshot(model),
    }


_REAL_ALL_REDUCE = dist.all_reduce


def _count_all_reduces(count: list[int] | None) -> Any:
    if count is None:
        return None

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return _REAL_ALL_REDUCE(*args, **kwargs)

    dist.all_reduce = counting
    return counting


def _restore_all_reduce(calls: Any) -> None:
    if calls is not None:
        dist.all_reduce = _REAL_ALL_REDUCE


def _ddp_case(rank: int, world: int, inner: str, group: Any = None) -> dict[str, Any]:
    model = DDP(_model())
    opt = LossScaleOptimizer(
        _inner(inner, model.parameters()),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
        process_group=group,
    )
    return _train(rank, world, model, opt, _schedule(world, seed=7), range(STEPS))


def _two_dtypes_case(rank: int, world: int) -> dict[str, Any]:
    """float32 and float64 parameters (two check groups): still one all-reduce per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2).double())

    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: Any) -> Any:
            return self.net[1](self.net[0](x).double()).float()

    mixed = DDP(Mixed())
    opt = LossScaleOptimizer(
        torch.optim.SGD(mixed.parameters(), lr=0.05),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )
    count = [0]
    result = _train(rank, world, mixed, opt, _schedule(world, seed=11), range(STEPS), count)
    result["all_reduces"] = count[0]
    return result


def _missing_grads_case(rank: int, world: int) -> dict[str, Any]:
    """No DDP; every rank but 0 leaves some parameters (at some steps: all) without grads."""
    model = _model()
    opt = LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )
    schedule = {3: 0, 9: world - 1, 15: 0}
    trajectory = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        if rank == 0 or step % 4 != 0:
            opt.get_scaled_loss(torch.nn.functional.mse_loss(model(x), y)).backward()
        if rank != 0 and step % 2 == 1:
            model[2].weight.grad = None
            model[2].bias.grad = None
        if schedule.get(step) == rank:
            model[0].weight.grad.view(-1)[0] = math.nan
        opt.step()
        trajectory.append(_record(opt))
        opt.zero_grad()
    return {"trajectory": trajectory, "schedule": schedule}


def _fsdp2_case(rank: int, world: int, fused: bool) -> dict[str, Any]:
    """FSDP2: DTensor gradients, each rank holding shards; an overflow in one rank's shard."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused or None),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )
    schedule = _schedule(world, seed=5)
    trajectory, unchanged_on_skip = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.get_scaled_loss(torch.nn.functional.mse_loss(model(x), y)).backward()
        if schedule.get(step) == rank:
            model[0].weight.grad.to_local().view(-1)[0] = math.inf  # this rank's shard only
        before = [p.to_local().clone() for p in model.parameters()]
        opt.step()
        trajectory.append(_record(opt))
        if not trajectory[-1][2]:
            after = [p.to_local() for p in model.parameters()]
            unchanged_on_skip.append(tensors_equal(before, after))
        opt.zero_grad()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {
        "trajectory": trajectory,
        "unchanged_on_skip": unchanged_on_skip,
        "params": full,
        "schedule": schedule,
    }


def _step_together_case(rank: int, world: int) -> dict[str, Any]:
    """Two optimizers (a GAN's) stepped together: one rank's overflow in one of them skips
    both, on every rank."""
    g_model, d_model = DDP(_model()), DDP(_model())
    g_opt = LossScaleOptimizer(
        torch.optim.SGD(g_model.parameters(), lr=0.05, foreach=True),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )
    d_opt = LossScaleOptimizer(
        torch.optim.AdamW(d_model.parameters(), lr=1e-2, fused=True),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )
    schedule = _schedule(world, seed=3)
    decisions = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        g_opt.get_scaled_loss(torch.nn.functional.mse_loss(g_model(x), y)).backward()
        d_opt.get_scaled_loss(torch.nn.functional.mse_loss(d_model(x), -y)).backward()
        if schedule.get(step) == rank:
            target = d_model if step % 2 else g_model
            next(iter(target.parameters())).grad.view(-1)[0] = math.inf
        applied = step_together(g_opt, d_opt)
        decisions.append((bool(applied), _record(g_opt), _record(d_opt)))
        g_opt.zero_grad()
        d_opt.zero_grad()
    return {"decisions": decisions, "schedule": schedule}


def _lbfgs_case(rank: int, world: int) -> dict[str, Any]:
    """The closure path (LBFGS): the decision is reduced too."""
    model = DDP(_model())
    opt = LossScaleOptimizer(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3),
        initial_scale=INITIAL_SCALE,
        dynamic_growth_steps=GROWTH_STEPS,
    )
    schedule = _schedule(world, seed=9)
    trajectory = []
    for step in range(12):
        x, y = _batch(rank, step)
        calls = [0]

        def closure(x: Any = x, y: Any = y, step: int = step, calls: list[int] = calls) -> Any:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.get_scaled_loss(loss).backward()
            calls[0] += 1
            if calls[0] == 1 and schedule.get(step) == rank:
                next(iter(model.parameters())).grad.view(-1)[0] = math.inf
            return loss

        opt.step(closure)
        trajectory.append(_record(opt))
    return {"trajectory": trajectory, "schedule": schedule, "params": _snapshot(model)}


def _checkpoint_case(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    """Save at CHECKPOINT_AT (each rank its own file), keep going; then resume from the files
    into new objects and run the same steps: both runs must end identical."""
    schedule = _schedule(world, seed=13)

    def build() -> tuple[Any, Any]:
        model = DDP(_model())
        opt = LossScaleOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
            initial_scale=INITIAL_SCALE,
            dynamic_growth_steps=GROWTH_STEPS,
            hysteresis=2,
        )
        return model, opt

    model, opt = build()
    _train(rank, world, model, opt, schedule, range(CHECKPOINT_AT))
    path = out_dir / f"checkpoint-rank{rank}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    straight = _train(rank, world, model, opt, schedule, range(CHECKPOINT_AT, STEPS))

    model, opt = build()
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    resumed = _train(rank, world, model, opt, schedule, range(CHECKPOINT_AT, STEPS))
    return {"straight": straight, "resumed": resumed, "skipped": int(opt.skipped_steps)}


def _suite(rank: int, world: int, out_dir: Path) -> dict[str, Any]:
    isolated = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    results: dict[str, Any] = {}
    for inner in INNERS:
        results[f"ddp/{inner}"] = _ddp_case(rank, world, inner)
    results["isolated"] = _ddp_case(rank, world, "sgd_foreach", group=isolated[rank])
    results["two_dtypes"] = _two_dtypes_case(rank, world)
    results["missing_grads"] = _missing_grads_case(rank, world)
    results["fsdp2/foreach"] = _fsdp2_case(rank, world, fused=False)
    results["fsdp2/fused"] = _fsdp2_case(rank, world, fused=True)
    results["step_together"] = _step_together_case(rank, world)
    results["lbfgs"] = _lbfgs_case(rank, world)
    results["checkpoint"] = _checkpoint_case(rank, world, out_dir)
    return results


# -- checks (in the pytest process) -------------------------------------------------------------
def _expected_trajectory(nonfinite_steps: set[int], steps: int, **kwargs: Any) -> list[Any]:
    """What one process with the same finite/non-finite sequence does: the core rule."""
    ls = DynamicLossScale(INITIAL_SCALE, GROWTH_STEPS, **kwargs)
    out = []
    for step in range(steps):
        grad = np.array([np.inf if step in nonfinite_steps else 1.0], dtype=np.float32)
        _, applied = ls.update([grad])
        out.append((float(ls()), ls.num_good_steps, bool(applied)))
    return out


@pytest.mark.parametrize("inner", INNERS)
def test_ddp_ranks_agree_and_follow_the_rule(job: list[dict[str, Any]], inner: str) -> None:
    world = len(job)
    runs = [r[f"ddp/{inner}"] for r in job]
    expected = _expected_trajectory(set(_schedule(world, seed=7)), STEPS)
    for rank, run in enumerate(runs):
        assert run["trajectory"] == expected, f"rank {rank}"
        assert run["unchanged_on_skip"] == [True] * 6, f"rank {rank}"
        assert tensors_equal(run["params"], runs[0]["params"]), f"rank {rank} params differ"


def test_without_the_reduction_ranks_disagree(job: list[dict[str, Any]]) -> None:
    """The control: one-rank groups (no agreement) make the ranks decide differently, so the
    tests above can fail."""
    world = len(job)
    schedule = _schedule(world, seed=7)
    runs = [r["isolated"] for r in job]
    for rank, run in enumerate(runs):
        mine = {s for s, r in schedule.items() if r == rank}
        assert [applied for *_, applied in run["trajectory"]] == [
            s not in mine for s in range(STEPS)
        ]
    assert not all(tensors_equal(run["params"], runs[0]["params"]) for run in runs)


def test_one_all_reduce_per_step_for_all_dtype_groups(job: list[dict[str, Any]]) -> None:
    world = len(job)
    expected = _expected_trajectory(set(_schedule(world, seed=11)), STEPS)
    for rank, r in enumerate(job):
        assert r["two_dtypes"]["all_reduces"] == STEPS, f"rank {rank}"
        assert r["two_dtypes"]["trajectory"] == expected, f"rank {rank}"


def test_ranks_without_some_or_any_grads_agree(job: list[dict[str, Any]]) -> None:
    schedule = job[0]["missing_grads"]["schedule"]
    expected = _expected_trajectory(set(schedule), STEPS)
    for rank, r in enumerate(job):
        assert r["missing_grads"]["trajectory"] == expected, f"rank {rank}"


@pytest.mark.parametrize("variant", ["foreach", "fused"])
def test_fsdp2_shards_agree(job: list[dict[str, Any]], variant: str) -> None:
    runs = [r[f"fsdp2/{variant}"] for r in job]
    expected = _expected_trajectory(set(runs[0]["schedule"]), STEPS)
    for rank, run in enumerate(runs):
        assert run["trajectory"] == expected, f"rank {rank}"
        assert run["unchanged_on_skip"] == [True] * len(runs[0]["schedule"]), f"rank {rank}"
        assert tensors_equal(run["params"], runs[0]["params"]), f"rank {rank}"


def test_step_together_skips_every_optimizer_on_every_rank(job: list[dict[str, Any]]) -> None:
    schedule = job[0]["step_together"]["schedule"]
    expected = _expected_trajectory(set(schedule), STEPS)
    for rank, r in enumerate(job):
        decisions = r["step_together"]["decisions"]
        assert [d[0] for d in decisions] == [s not in schedule for s in range(STEPS)]
        assert [d[1] for d in decisions] == expected, f"rank {rank} generator"
        assert [d[2] for d in decisions] == expected, f"rank {rank} discriminator"


def test_lbfgs_closure_decision_is_shared(job: list[dict[str, Any]]) -> None:
    schedule = job[0]["lbfgs"]["schedule"]
    for rank, r in enumerate(job):
        applied = [a for *_, a in r["lbfgs"]["trajectory"]]
        assert applied == [s not in schedule for s in range(12)], f"rank {rank}"
        assert r["lbfgs"]["trajectory"] == job[0]["lbfgs"]["trajectory"]
        assert tensors_equal(r["lbfgs"]["params"], job[0]["lbfgs"]["params"])


def test_a_checkpoint_resumes_identically(job: list[dict[str, Any]]) -> None:
    world = len(job)
    expected = _expected_trajectory(set(_schedule(world, seed=13)), STEPS, hysteresis=2)
    for rank, r in enumerate(job):
        straight, resumed = r["checkpoint"]["straight"], r["checkpoint"]["resumed"]
        assert straight["trajectory"] == expected[CHECKPOINT_AT:], f"rank {rank}"
        assert resumed["trajectory"] == straight["trajectory"], f"rank {rank}"
        assert tensors_equal(resumed["params"], straight["params"]), f"rank {rank}"
        assert tensors_equal(resumed["params"], job[0]["checkpoint"]["resumed"]["params"])
        assert r["checkpoint"]["skipped"] == job[0]["checkpoint"]["skipped"]


# -- single process: the argument ----------------------------------------------------------------
@pytest.mark.parametrize("bad", ["world", 0, object()])
def test_process_group_must_be_a_process_group(bad: Any) -> None:
    inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(TypeError, match="process_group"):
        LossScaleOptimizer(inner, process_group=bad)
    LossScaleOptimizer(inner)  # the failed constructor left it unmarked


def test_no_reduction_when_torch_distributed_is_not_initialised() -> None:
    assert not dist.is_initialized()
    p = torch.nn.Parameter(torch.ones(2))
    opt = LossScaleOptimizer(torch.optim.SGD([p], lr=0.1))
    assert opt.process_group is None
    p.grad = torch.full((2,), math.inf)
    opt.step()  # would raise (no default group) if it tried to all-reduce
    assert not bool(opt.last_step_applied)
    assert "process_group" not in opt.get_config()


# -- the runnable example, under torchrun -------------------------------------------------------
@pytest.mark.parametrize("mode", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_the_distributed_example_runs_under_torchrun(mode: list[str]) -> None:
    root = Path(__file__).resolve().parents[3]
    script = root / "examples" / "distributed_torch.py"
    done = run_torchrun(script, ["--quick", *mode], ["ranks agree"], JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ranks agree" in done.stdout


_ABORTS_ONCE = """
import os, sys
marker = sys.argv[1]
print("work done", flush=True)
if os.environ["RANK"] == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()
"""


def test_torchrun_runs_once_more_only_after_an_abort_at_teardown(tmp_path: Path) -> None:
    """``run_torchrun``: a rank that printed everything and then aborted at exit (gloo's
    teardown) gets one more run; a run that did not print everything is not run again."""
    script = tmp_path / "aborts_once.py"
    script.write_text(_ABORTS_ONCE)
    marker = tmp_path / "aborted"
    done = run_torchrun(script, [str(marker)], ["work done"], JOB_TIMEOUT_S)
    assert marker.exists() and done.returncode == 0, done.stdout + done.stderr
    marker.unlink()
    done = run_torchrun(script, [str(marker)], ["never printed"], JOB_TIMEOUT_S)
    assert marker.exists() and done.returncode != 0  # not run again: it stays failed
