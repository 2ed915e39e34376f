"""One skip decision across parallel dimensions: FSDP2, pipeline stages, tensor parallelism and a
pipeline x FSDP2 mesh, on real gloo jobs of 2 and 4 ranks (loopback), beside torch's GradScaler.

Each setup trains a tiny model several times from the same start, with overflows injected into
one rank's local gradient only, after backward:

* ``torch``: torch's ``GradScaler`` as shipped;
* ``idiom``: torch's ``GradScaler`` with the user's agreement, an in-place MAX all-reduce of
  ``_found_inf_per_device`` over the world after ``unscale_`` (the reference where torch agrees
  on nothing itself);
* ``lossscale``: ``lossscale.torch.GradScaler`` (``process_group=None``: the default group);
* ``optimizer``: ``lossscale.torch.LossScaleOptimizer`` (pipeline setups).

Passing means: the same scale and growth tracker after every update and bit-identical
parameters after every step as torch's run (``torch`` where torch agrees: FSDP2 and sharded TP
gradients, whose DTensor check reduces the flag over the mesh; ``idiom`` elsewhere), the same
decisions on every rank, and exactly one ``torch.distributed.all_reduce`` per step for
lossscale's agreement (counted by wrapping it; DTensor's own reduction is a functional
collective, not counted). Where torch does not agree (pipeline stages, a pipeline x FSDP2 mesh)
the tests show its ranks diverge and lossscale's do not. The pipeline uses
``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``), which runs backward
itself: the loss is scaled inside the schedule's ``loss_fn``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from lossscale._testing import counting_all_reduces, expected_scales, gloo_job_once, tensors_equal  # noqa: E402

JOB_TIMEOUT_S = 60.0
STEPS = 10
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 3
MICROBATCHES = 2


def _overflows(world: int) -> dict[int, int]:
    """step -> the one rank that overflows (the same on every rank)."""
    return {2: world - 1, 5: 0, 6: world - 1}


def _expected(overflows: set[int]) -> list[tuple[float, int]]:
    return expected_scales(overflows, STEPS, INIT_SCALE, GROWTH_INTERVAL)


# -- the loop (inside every rank) -----------------------------------------------------------------
def _mlp() -> Any:
    torch.manual_seed(0)  # the same start on every rank and in every run
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _local(p: Any) -> Any:
    return p.to_local() if hasattr(p, "to_local") else p


def _snapshot(params: list[Any]) -> list[Any]:
    return [_local(p).detach().clone() for p in params]


def _batch(seed: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _train(
    mode: str,
    params: list[Any],
    backward: Callable[[int, Callable[[Any], Any], Callable[[], Any]], None],
    inject: Callable[[int], None],
    group: Any = None,
) -> dict[str, Any]:
    """STEPS steps; ``backward(step, scale, read)`` runs forward and backward with the loss
    scaled by ``scale`` (a stage that computes no loss calls ``read()`` instead: reading
    ``LossScaleOptimizer.loss_scale`` tells it that the gradients arrive scaled);
    ``inject(step)`` may then put an inf into this rank's gradients. Records the warnings
    (lossscale's unscaled-gradients warning must stay silent)."""
    from lossscale.torch import GradScaler, LossScaleOptimizer

    inner = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    kwargs = {"growth_interval": GROWTH_INTERVAL}
    if mode == "optimizer":
        opt: Any = LossScaleOptimizer(
            inner,
            initial_scale=INIT_SCALE,
            dynamic_growth_steps=GROWTH_INTERVAL,
            process_group=group,
        )
        scale: Callable[[Any], Any] = opt.get_scaled_loss
        read: Callable[[], Any] = lambda: opt.loss_scale  # noqa: E731
    else:
        read = lambda: None  # noqa: E731
        if mode == "lossscale":
            scaler: Any = GradScaler("cpu", INIT_SCALE, process_group=group, **kwargs)
        else:
            scaler = torch.amp.GradScaler("cpu", INIT_SCALE, **kwargs)
            scaler.scale(torch.ones(()))  # torch's scaler needs a scale() on every rank first
        scale = scaler.scale
    trajectory, snapshots, calls = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            backward(step, scale, read)
            inject(step)
            with counting_all_reduces() as counted:
                if mode == "optimizer":
                    opt.step()
                    trajectory.append((float(opt.loss_scale), int(opt.dynamic_counter)))
                else:
                    scaler.unscale_(inner)
                    if mode == "idiom":
                        for v in scaler._found_inf_per_device(inner).values():
                            dist.all_reduce(v, op=dist.ReduceOp.MAX)
                    scaler.step(inner)
                    scaler.update()
                    trajectory.append((scaler.get_scale(), int(scaler._growth_tracker)))
            calls.append([op for op, _ in counted])  # idiom: the user's own call
            snapshots.append(_snapshot(params))
            inner.zero_grad()
    warned = [str(w.message) for w in caught if "scaled" in str(w.message).lower()]
    return {"trajectory": trajectory, "params": snapshots, "calls": calls, "warnings": warned}


def _inf_into(p: Any) -> None:
    _local(p.grad).view(-1)[0] = math.inf


# -- setups ---------------------------------------------------------------------------------------
def _fsdp2(rank: int, world: int, mode: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    fully_shard(model[0])
    fully_shard(model)
    overflows = _overflows(world)

    def backward(step: int, scale: Callable[[Any], Any], read: Callable[[], Any]) -> None:
        x, y = _batch(100 * rank + step)
        scale(torch.nn.functional.mse_loss(model(x), y)).backward()

    def inject(step: int) -> None:
        if overflows.get(step) == rank:
            _inf_into(model[2].weight if step % 2 else model[0].weight)  # this rank's shard

    out = _train(mode, list(model.parameters()), backward, inject)
    out["full"] = [p.full_tensor() for p in model.parameters()]
    return out


def _gpipe_backward(
    stage: Any, first: bool, batch: Callable[[int], Any], read_everywhere: bool
) -> Callable[[int, Callable[[Any], Any], Callable[[], Any]], None]:
    """The ``backward`` of :func:`_train` for one pipeline ``stage`` under a GPipe schedule:
    the schedule runs backward itself, the loss scaled inside its ``loss_fn``; ``batch(step)``
    is the step's ``(x, y)``; the first stage feeds ``x``, the others ``y``. ``read`` is called
    before the schedule steps, on the first stage (no loss there), or on every stage with
    ``read_everywhere``."""
    from torch.distributed.pipelining import ScheduleGPipe

    scaling: list[Callable[[Any], Any]] = []

    def loss_fn(output: Any, target: Any) -> Any:
        return scaling[0](torch.nn.functional.mse_loss(output, target))

    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)

    def backward(step: int, scale: Callable[[Any], Any], read: Callable[[], Any]) -> None:
        scaling[:] = [scale]
        x, y = batch(step)
        if first or read_everywhere:
            read()
        if first:
            schedule.step(x)
        else:
            schedule.step(target=y)

    return backward


def _last_rank_inject(rank: int, world: int, part: Any) -> Callable[[int], None]:
    """The ``inject`` of :func:`_train` for a pipeline: at an overflow step, the last rank's
    gradient of its stage's first weight turns inf."""

    def inject(step: int) -> None:
        if step in _overflows(world) and rank == world - 1:
            _inf_into(part[0].weight)

    return inject


def _pipeline(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Two stages, one rank each; the last stage overflows. The schedule runs backward itself:
    the loss is scaled inside its ``loss_fn``."""
    from torch.distributed.pipelining import PipelineStage

    full = _mlp()
    part = full[0:2] if rank == 0 else full[2:]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    # the same batch on every stage; no loss on the first: its gradients arrive scaled
    backward = _gpipe_backward(stage, rank == 0, _batch, read_everywhere=False)
    return _train(mode, list(part.parameters()), backward, _last_rank_inject(rank, world, part))


def _tp(rank: int, world: int, mode: str, norm: bool) -> dict[str, Any]:
    """Megatron-style column- then row-parallel linears: weights and the first bias sharded,
    the second bias replicated (a DTensor); with ``norm``, a LayerNorm left unparallelised
    (plain tensors on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)]
    model = torch.nn.Sequential(*layers, *([torch.nn.LayerNorm(2)] if norm else []))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    targets = [model[0].weight, model[2].bias, model[3].weight if norm else model[2].weight]

    def backward(step: int, scale: Callable[[Any], Any], read: Callable[[], Any]) -> None:
        x, y = _batch(step)  # tensor parallelism: the same batch on every rank
        scale(torch.nn.functional.mse_loss(model(x), y)).backward()

    def inject(step: int) -> None:
        if _overflows(world).get(step) == rank:
            _inf_into(targets[step % 3])  # sharded weight, replicated bias, sharded or plain

    try:
        return _train(mode, list(model.parameters()), backward, inject)
    except RuntimeError as error:
        return {"error": str(error)}


def _pp_fsdp2(rank: int, world: int, mode: str, groups: str = "world") -> dict[str, Any]:
    """A (pp=2, dp=world/2) mesh: two pipeline stages, each FSDP2-sharded over its dp group; the
    last rank overflows. ``groups``: what lossscale agrees over — ``world`` (one group), ``pp``
    (drops the dp dimension: the control), or ``pp+dp`` (two optimizers, one per group,
    stepped with ``step_together``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    from lossscale.torch import LossScaleOptimizer, step_together

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    full = _mlp()
    part = full[0:2] if pp == 0 else full[2:]
    fully_shard(part, mesh=mesh["dp"])
    stage = PipelineStage(part, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    # data parallel: each dp rank its own batch; read on every stage, for a second optimizer
    backward = _gpipe_backward(
        stage, pp == 0, lambda step: _batch(100 * dp + step), read_everywhere=True
    )
    inject = _last_rank_inject(rank, world, part)
    params = list(part.parameters())
    if groups == "world":
        return _train(mode, params, backward, inject)
    if groups == "pp":
        return _train(mode, params, backward, inject, group=mesh.get_group("pp"))
    # two optimizers (weight, bias) over two groups, stepped together
    opts = [
        LossScaleOptimizer(
            torch.optim.SGD([p], lr=0.05, momentum=0.9),
            initial_scale=INIT_SCALE,
            dynamic_growth_steps=GROWTH_INTERVAL,
            process_group=mesh.get_group(name),
        )
        for p, name in zip(params, ("pp", "dp"), strict=True)
    ]
    trajectory, calls = [], []
    for step in range(STEPS):
        backward(step, opts[0].get_scaled_loss, lambda: [o.loss_scale for o in opts])
        inject(step)
        with counting_all_reduces() as counted:
            step_together(*opts)
        calls.append([op for op, g in counted])
        trajectory.append(tuple((float(o.loss_scale), int(o.dynamic_counter)) for o in opts))
        for o in opts:
            o.zero_grad()
    return {"trajectory": trajectory, "calls": calls, "params": [_snapshot(params)]}


def _suite(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": {}}

    def timed(name: str, fn: Any, *args: Any) -> None:
        start = time.perf_counter()
        out[name] = fn(rank, world, *args)
        out["seconds"][name] = time.perf_counter() - start

    for mode in ("torch", "lossscale"):
        timed(f"fsdp2/{mode}", _fsdp2, mode)
        timed(f"tp/{mode}", _tp, mode, False)
        timed(f"tp_norm/{mode}", _tp, mode, True)
    pipeline = _pipeline if world == 2 else _pp_fsdp2
    for mode in ("torch", "idiom", "lossscale", "optimizer"):
        timed(f"pp/{mode}", pipeline, mode)
    if world == 4:
        timed("pp/lossscale_pp_only", _pp_fsdp2, "lossscale", "pp")
        timed("pp/two_groups", _pp_fsdp2, "optimizer", "pp+dp")
    return out


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return gloo_job_once(_suite, request.param, JOB_TIMEOUT_S, tmp_path_factory)


@pytest.fixture
def job4(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return gloo_job_once(_suite, 4, JOB_TIMEOUT_S, tmp_path_factory)


# -- checks (in the pytest process) ---------------------------------------------------------------
def _same_run(ours: dict[str, Any], theirs: dict[str, Any], where: Any) -> None:
    assert ours["trajectory"] == theirs["trajectory"], where
    for step, (a, b) in enumerate(zip(ours["params"], theirs["params"], strict=True)):
        assert tensors_equal(a, b), (where, step)


def _one_max_per_step(run: dict[str, Any], where: Any) -> None:
    assert run["calls"] == [["MAX"]] * STEPS, where
    assert run["warnings"] == [], where


def test_fsdp2_grad_scaler_matches_torch(job: list[dict[str, Any]]) -> None:
    """FSDP2 needs no sharded scaler: DTensor reduces torch's flag over the shards. lossscale's
    GradScaler makes the same decisions, bit for bit, with its one MAX per step (idempotent
    where DTensor already agreed)."""
    expected = _expected(set(_overflows(len(job))))
    for rank, r in enumerate(job):
        _same_run(r["fsdp2/lossscale"], r["fsdp2/torch"], rank)
        assert r["fsdp2/lossscale"]["trajectory"] == expected, rank
        assert tensors_equal(r["fsdp2/lossscale"]["full"], job[0]["fsdp2/lossscale"]["full"]), rank
        _one_max_per_step(r["fsdp2/lossscale"], rank)


def test_tensor_parallel_matches_torch(job: list[dict[str, Any]]) -> None:
    """Sharded and replicated DTensor gradients: torch's DTensor check agrees over the mesh;
    lossscale's run is the same, bit for bit, and counts one MAX per step."""
    expected = _expected(set(_overflows(len(job))))
    for rank, r in enumerate(job):
        _same_run(r["tp/lossscale"], r["tp/torch"], rank)
        assert r["tp/lossscale"]["trajectory"] == expected, rank
        _one_max_per_step(r["tp/lossscale"], rank)


def test_tensor_parallel_with_a_plain_parameter(job: list[dict[str, Any]]) -> None:
    """A LayerNorm left out of the TP plan keeps plain tensors beside the DTensors: torch's
    GradScaler cannot check the mix; lossscale's agrees on an overflow in it on one rank."""
    expected = _expected(set(_overflows(len(job))))
    for rank, r in enumerate(job):
        assert "mixed torch.Tensor and DTensor" in r["tp_norm/torch"]["error"], rank
        ours = r["tp_norm/lossscale"]
        assert ours["trajectory"] == expected, rank
        assert tensors_equal(
            ours["params"][-1][-2:], job[0]["tp_norm/lossscale"]["params"][-1][-2:]
        )
        _one_max_per_step(ours, rank)


def test_pipeline_stages_skip_together(job: list[dict[str, Any]]) -> None:
    """2 ranks: two pipeline stages; 4 ranks: two stages x FSDP2 over two ranks each. The
    last rank overflows. torch's ranks diverge (FSDP2 agrees within a stage, nothing across
    stages); lossscale's GradScaler and LossScaleOptimizer match torch + the MAX idiom over
    the world, bit for bit, with one MAX per step."""
    world = len(job)
    expected = _expected(set(_overflows(world)))
    theirs = [r["pp/torch"]["trajectory"] for r in job]
    assert theirs[0] == _expected(set()) and theirs[-1] == expected  # diverged
    for rank, r in enumerate(job):
        reference = r["pp/idiom"]
        assert reference["trajectory"] == expected, rank
        for mode in ("lossscale", "optimizer"):
            _same_run(r[f"pp/{mode}"], reference, (rank, mode))
            _one_max_per_step(r[f"pp/{mode}"], (rank, mode))


def test_dropping_a_dimension_diverges_two_groups_agree(job4: list[dict[str, Any]]) -> None:
    """The (pp=2, dp=2) mesh: agreeing over the pp group only leaves the dp peers of the
    overflowing rank deciding alone (the control); two optimizers over the pp and the dp group
    stepped together agree everywhere, with one MAX per distinct group per step."""
    job = job4
    expected = _expected(set(_overflows(4)))
    alone = [r["pp/lossscale_pp_only"]["trajectory"] for r in job]
    assert len({tuple(t) for t in alone}) > 1
    for rank, r in enumerate(job):
        two = r["pp/two_groups"]
        assert two["trajectory"] == [(e, e) for e in expected], rank
        assert two["calls"] == [["MAX", "MAX"]] * STEPS, rank


# -- the runnable examples (docs/sharded.md shows them), under torchrun ---------------------------
@pytest.mark.parametrize(
    ("script", "expect"),
    [
        ("sharded_recipes.py", ["fsdp1:", "fsdp2:", "pipeline:", "tp:", "OK"]),
        ("fp16_rl_actor_fsdp2.py", ["skipped steps 1 ", "LR schedule steps 11 of 12", "OK"]),
    ],
)
def test_the_examples_run_on_two_ranks(script: str, expect: list[str]) -> None:
    from pathlib import Path

    from lossscale._testing import run_torchrun

    root = Path(__file__).resolve().parents[3]
    done = run_torchrun(root / "examples" / script, ["--quick"], expect, JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    for line in expect:
        assert line in done.stdout, done.stdout
    assert "ranks agree=False" not in done.stdout


def test_the_recipes_refuse_a_world_size_other_than_two() -> None:
    """Run as with ``torchrun --nproc_per_node=4``, the script says what it needs and exits
    with status 2 before joining a group (a 4-rank pipeline of two stages would hang). One
    process: the check reads ``WORLD_SIZE`` before any collective."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, WORLD_SIZE="4", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    command = [sys.executable, str(root / "examples" / "sharded_recipes.py"), "--quick"]
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs exactly 2 processes" in done.stderr
    assert "got WORLD_SIZE=4" in done.stderr
