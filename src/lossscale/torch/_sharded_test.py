"""FSDP1 and the GradScaler idiom on real multi-process jobs, side by side with torch's scalers.

One gloo job per world size (2 and 4 ranks, loopback) runs every scenario in turn (a process start
costs a torch import); each rank saves what it saw and the tests compare. Every scenario trains
the same tiny model twice or more, once per scaler, with overflows injected into one rank's
gradient shard only, after backward:

* FSDP1 (``device_id=cpu``), torch's ``ShardedGradScaler`` against lossscale's, both built with
  the same positional arguments (torch's order: backoff before growth), SGD with momentum;
  float32 parameters, and float16 parameters with ``CPUOffload(offload_params=True)``. On a
  CPU-only machine torch's offload path calls ``pin_memory`` and ``torch.cpu.Stream.synchronize``,
  which fail without CUDA: the job makes both no-ops (everything already lives in host memory);
  the rest is torch's normal offload path.
* Two ranks overflowing at once with fused SGD: torch's SUM makes the flag 2.0, which the fused
  kernel does not read as a skip, so torch's run takes the inf; lossscale's MAX skips.
* The ``_found_inf_per_device`` idiom (an in-place MAX or SUM all-reduce after ``unscale_``,
  before ``step``) with torch's ``GradScaler`` and lossscale's, with and without lossscale's own
  agreement, and torch's private surface (``_per_optimizer_states``' stages) along the way:
  each rank reads its own flag (or the user's reduction of it) as with torch's.
* The flags after ``unscale_``, side by side: torch's ``ShardedGradScaler`` sums the ranks' flags
  in place (``_found_inf_per_device`` reads the number of ranks that overflowed, on every rank),
  lossscale's too, with the same decisions and parameters, also after a user's MAX all-reduce of
  those sums (S1); torch's ``GradScaler`` and lossscale's keep each rank's own flag.
* FSDP1 with ``use_orig_params=True`` and a one-element head in its own unit, so that one rank's
  shard of it is empty (no gradient there): two optimizers (body, head) and one over the head
  only; that rank still takes part in the agreement, as with torch's ``ShardedGradScaler``.
* 200 forced overflows in a row: torch's scale reaches 0 (and its next clean step writes NaN into
  the weights); lossscale's stays at ``min_loss_scale`` and the stall alarm fires.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from lossscale._testing import expected_scales, gloo_job_once, tensors_equal  # noqa: E402

JOB_TIMEOUT_S = 60.0
STEPS = 12
INIT_SCALE = 2.0**10  # well above the floor: torch's and lossscale's runs agree bit for bit
GROWTH_INTERVAL = 3
STALL_STEPS = 50  # lossscale's alarm threshold in the stall scenario
FORCED = 200  # overflows in a row in the stall scenario


def _overflows(world: int) -> dict[int, int]:
    """step -> the one rank that overflows at that step (the same on every rank)."""
    return {2: world - 1, 5: 0, 6: world // 2, 10: 1}


# -- scenarios (run inside every rank) ----------------------------------------------------------
def _no_pinning() -> None:
    """CPUOffload on a CPU-only machine: pinning and CPU-stream syncs become no-ops."""
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[method-assign]


def _fsdp1_model(dtype: Any, offload: bool) -> Any:
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)
    ).to(dtype)
    return FSDP(
        model,
        device_id=torch.device("cpu"),
        cpu_offload=CPUOffload(offload_params=True) if offload else None,
    )


def _scaler(kind: str) -> Any:
    """Positional arguments in torch's ShardedGradScaler order (backoff before growth).
    ``lossscale_device``: a GPU's way forced on the CPU, the fused kernel given ``found_inf``
    (``device_side_skip=True``), so that the flag's value itself decides the step."""
    args = ("cpu", INIT_SCALE, 0.5, 2.0, GROWTH_INTERVAL)
    if kind == "torch":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(*args)
    from lossscale.torch import ShardedGradScaler as LossscaleSharded
    from lossscale.torch import _engine

    device = kind == "lossscale_device"
    _engine.device_decides = lambda place, skip: skip  # type: ignore[assignment]
    return LossscaleSharded(*args, device_side_skip=device)


def _batch(rank: int, step: int, dtype: Any = torch.float32) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 2, generator=g)


def _local(model: Any) -> list[Any]:
    return [p.detach().clone() for p in model.parameters()]


def _full(model: Any) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


def _fsdp1_run(
    rank: int,
    kind: str,
    dtype: Any,
    offload: bool,
    overflows: dict[int, Any],
    fused: bool = False,
    unscale: bool = False,
) -> dict[str, Any]:
    model = _fsdp1_model(dtype, offload)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=fused or None)
    scaler = _scaler(kind)
    trajectory, params, grads = [], [], set()
    for step in range(STEPS):
        x, y = _batch(rank, step, dtype)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        grads |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        who = overflows.get(step, ())
        if rank in (who if isinstance(who, tuple) else (who,)):
            next(iter(model.parameters())).grad.view(-1)[0] = math.inf  # this rank's shard
        if unscale:  # as before gradient clipping
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        trajectory.append((scaler.get_scale(), int(scaler._growth_tracker)))
        params.append(_local(model))
        opt.zero_grad()
    return {"trajectory": trajectory, "params": params, "full": _full(model), "grads": grads}


def _empty_shard_run(rank: int, kind: str, layout: str) -> dict[str, Any]:
    """FSDP1, ``use_orig_params=True``; the head (one weight) is its own FSDP unit, so every
    rank but rank 0 holds an empty shard of it and gets no gradient there. ``layout``: "two"
    (a body optimizer and a head optimizer, stepped in turn) or "head" (one optimizer over the
    head; the body is frozen). Overflows: the head's at step 2 (rank 0 holds it), the body's at
    step 5 on the last rank ("two" only)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    world = dist.get_world_size()
    torch.manual_seed(0)
    head = torch.nn.Linear(1, 1, bias=False)
    model = torch.nn.Sequential(torch.nn.Linear(6, 1), torch.nn.Tanh(), head)
    if layout == "head":
        model[0].requires_grad_(False)
    model[2] = FSDP(head, device_id=torch.device("cpu"), use_orig_params=True)
    model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    body_params = [p for n, p in model.named_parameters() if ".2." not in n]
    head_params = [p for n, p in model.named_parameters() if ".2." in n]
    if layout == "head":
        opts = [torch.optim.SGD(head_params, lr=0.05, momentum=0.9)]
    else:
        opts = [torch.optim.SGD(ps, lr=0.05, momentum=0.9) for ps in (body_params, head_params)]
    scaler = _scaler(kind)
    overflows = {2: (head_params, 0), 5: (body_params, world - 1)}
    trajectory, params, empty = [], [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y[:, :1])
        scaler.scale(loss).backward()
        empty.append(all(p.grad is None for p in head_params))
        where, who = overflows.get(step, (None, None))
        if who == rank and not (layout == "head" and where is body_params):
            next(p for p in where if p.grad is not None).grad.view(-1)[0] = math.inf
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        trajectory.append((scaler.get_scale(), int(scaler._growth_tracker)))
        params.append(_local(model))
        for opt in opts:
            opt.zero_grad()
    return {"trajectory": trajectory, "params": params, "full": _full(model), "empty": empty}


def _idiom_run(rank: int, world: int, kind: str, idiom: str | None, group: Any) -> dict[str, Any]:
    """DDP; one rank's gradient turns inf after DDP's all-reduce (so only that rank sees it).
    ``idiom``: the user's in-place all-reduce of ``_found_inf_per_device`` ("max", "sum") or
    None. The flag read after it is recorded with each step's scale."""
    from torch.amp.grad_scaler import OptState
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale.torch import GradScaler

    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "torch":
        scaler: Any = torch.amp.GradScaler("cpu", INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    else:
        scaler = GradScaler("cpu", INIT_SCALE, growth_interval=GROWTH_INTERVAL, process_group=group)
    overflows = _overflows(world)
    trajectory, stages = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if overflows.get(step) == rank:
            next(iter(model.parameters())).grad.view(-1)[0] = math.inf
        scaler.unscale_(opt)
        state = scaler._per_optimizer_states[id(opt)]
        stages.append(state["stage"] == OptState.UNSCALED)
        if idiom is not None:
            op = dist.ReduceOp.MAX if idiom == "max" else dist.ReduceOp.SUM
            for v in scaler._found_inf_per_device(opt).values():
                dist.all_reduce(v, op=op)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        scaler.step(opt)
        stages.append(state["stage"] == OptState.STEPPED)
        scaler.update()
        trajectory.append((scaler.get_scale(), int(scaler._growth_tracker), found))
        opt.zero_grad()
    return {"trajectory": trajectory, "stages": stages, "params": _local(model)}


def _flag_overflows(world: int) -> dict[int, tuple[int, ...]]:
    """step -> the ranks that overflow there: the last, the first, then both at once."""
    return {2: (world - 1,), 5: (0,), 8: (0, world - 1)}


def _flags_run(rank: int, world: int, kind: str, sharded: bool, idiom: bool) -> dict[str, Any]:
    """DDP, AdamW; the overflowing ranks' gradient turns inf after DDP's all-reduce. Each step
    records the scale, the growth tracker, the sum of ``_found_inf_per_device(opt)`` read after
    ``unscale_`` and, with ``idiom``, read again after the user's in-place MAX all-reduce.
    ``kind``: "torch" or "lossscale"; ``sharded``: ``ShardedGradScaler`` (torch's positional
    order) or ``GradScaler`` (lossscale's agreeing over the default group)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lossscale.torch import GradScaler, ShardedGradScaler

    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if sharded:
        cls: Any = TorchSharded if kind == "torch" else ShardedGradScaler
        scaler: Any = cls("cpu", INIT_SCALE, 0.5, 2.0, GROWTH_INTERVAL)
    else:
        cls = torch.amp.GradScaler if kind == "torch" else GradScaler
        scaler = cls("cpu", INIT_SCALE, 2.0, 0.5, GROWTH_INTERVAL)
    overflows = _flag_overflows(world)
    trajectory = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if rank in overflows.get(step, ()):
            next(iter(model.parameters())).grad.view(-1)[0] = math.inf
        scaler.unscale_(opt)
        read = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        after = read
        if idiom:
            for v in scaler._found_inf_per_device(opt).values():
                dist.all_reduce(v, op=dist.ReduceOp.MAX)
            after = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        scaler.step(opt)
        scaler.update()
        trajectory.append((scaler.get_scale(), int(scaler._growth_tracker), read, after))
        opt.zero_grad()
    return {"trajectory": trajectory, "params": _local(model)}


def _stall_run(rank: int, world: int, kind: str) -> dict[str, Any]:
    """FORCED overflows in a row on the last rank only, then one clean step; torch's
    ShardedGradScaler with its defaults (2**16, halving at every overflow) against
    lossscale's (its floor, min_loss_scale=1, and a stall alarm after STALL_STEPS). A plain
    model: the agreement is the scaler's all-reduce, FSDP1 adds nothing here but time."""
    from lossscale.core import LossScaleStalledWarning

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if kind == "torch":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler: Any = ShardedGradScaler("cpu")
    else:
        from lossscale.torch import ShardedGradScaler as LossscaleSharded

        scaler = LossscaleSharded("cpu", stall_steps=STALL_STEPS)
    x, y = _batch(rank, 0)
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(FORCED + 1):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step < FORCED and rank == world - 1:
                model.weight.grad.view(-1)[0] = math.inf
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            opt.zero_grad()
    stalls = [w for w in caught if issubclass(w.category, LossScaleStalledWarning)]
    return {
        "scales": scales,
        "stall_warnings": len(stalls),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "skipped": None if kind == "torch" else int(scaler.skipped_steps),
    }


def _suite(rank: int, world: int) -> dict[str, Any]:
    _no_pinning()  # before any FSDP unit is built; harmless without offload
    isolated = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    out: dict[str, Any] = {"seconds": {}}

    def timed(name: str, fn: Any, *args: Any) -> None:
        start = time.perf_counter()
        out[name] = fn(*args)
        out["seconds"][name] = time.perf_counter() - start

    for kind in ("torch", "lossscale"):
        overflows = _overflows(world)
        timed(f"fsdp1/{kind}", _fsdp1_run, rank, kind, torch.float32, False, overflows)
        timed(f"offload16/{kind}", _fsdp1_run, rank, kind, torch.float16, True, overflows)
        both = {4: (0, world - 1)}  # two ranks overflow in the same step
        timed(f"fused_two/{kind}", _fsdp1_run, rank, kind, torch.float32, False, both, True, True)
        timed(f"fused_one/{kind}", _fsdp1_run, rank, kind, torch.float32, False, overflows, True)
        if world == 2:  # the floor does not depend on the world size
            timed(f"stall/{kind}", _stall_run, rank, world, kind)
    both = {4: (0, world - 1)}
    timed(
        "fused_two/lossscale_device",
        _fsdp1_run,
        rank,
        "lossscale_device",
        torch.float32,
        False,
        both,
        True,
        True,
    )
    timed("idiom/torch", _idiom_run, rank, world, "torch", "max", None)
    timed("idiom/torch_without", _idiom_run, rank, world, "torch", None, None)
    timed("idiom/torch_sum", _idiom_run, rank, world, "torch", "sum", None)
    timed("idiom/lossscale", _idiom_run, rank, world, "lossscale", "max", None)
    timed("idiom/lossscale_without", _idiom_run, rank, world, "lossscale", None, None)
    timed("idiom/lossscale_sum", _idiom_run, rank, world, "lossscale", "sum", None)
    timed("idiom/lossscale_isolated", _idiom_run, rank, world, "lossscale", "max", isolated[rank])
    for kind in ("torch", "lossscale"):
        timed(f"flags_sharded/{kind}", _flags_run, rank, world, kind, True, False)
        timed(f"flags_sharded_max/{kind}", _flags_run, rank, world, kind, True, True)
        timed(f"flags_plain/{kind}", _flags_run, rank, world, kind, False, False)
    if world == 2:  # the empty shard: ranks 1.. hold none of the head at any world size
        for kind in ("torch", "lossscale"):
            for layout in ("two", "head"):
                timed(f"empty_{layout}/{kind}", _empty_shard_run, rank, kind, layout)
    return out


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return gloo_job_once(_suite, request.param, JOB_TIMEOUT_S, tmp_path_factory)


@pytest.fixture
def job2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return gloo_job_once(_suite, 2, JOB_TIMEOUT_S, tmp_path_factory)


# -- checks (in the pytest process) ----------------------------------------------------------------
def _same_as_torch(job: list[dict[str, Any]], name: str) -> None:
    """Every rank: the same scale and growth tracker after every update, and bit-identical
    parameters after every step, as torch's run; every rank the same full parameters."""
    for rank, r in enumerate(job):
        ours, theirs = r[f"{name}/lossscale"], r[f"{name}/torch"]
        assert ours["trajectory"] == theirs["trajectory"], f"rank {rank}"
        for step, (a, b) in enumerate(zip(ours["params"], theirs["params"], strict=True)):
            assert tensors_equal(a, b), f"rank {rank}, step {step}"
        assert tensors_equal(ours["full"], job[0][f"{name}/lossscale"]["full"]), f"rank {rank}"
        assert ours["trajectory"] == job[0][f"{name}/lossscale"]["trajectory"]


def _expected_scales(overflows: set[int]) -> list[tuple[float, int]]:
    return expected_scales(overflows, STEPS, INIT_SCALE, GROWTH_INTERVAL)


def test_fsdp1_matches_torchs_sharded_grad_scaler(job: list[dict[str, Any]]) -> None:
    _same_as_torch(job, "fsdp1")
    expected = _expected_scales(set(_overflows(len(job))))
    assert job[0]["fsdp1/lossscale"]["trajectory"] == expected  # every overflow backed off


def test_fsdp1_cpu_offload_float16_matches_torch(job: list[dict[str, Any]]) -> None:
    _same_as_torch(job, "offload16")
    assert job[0]["offload16/lossscale"]["grads"] == {"torch.float16"}
    expected = _expected_scales(set(_overflows(len(job))))
    assert job[0]["offload16/lossscale"]["trajectory"] == expected


def test_two_ranks_overflowing_with_fused_sgd_sum_applies_the_inf_max_skips(
    job: list[dict[str, Any]],
) -> None:
    """torch's flag is the SUM over ranks (2.0): the fused kernel, which skips only on 1.0,
    takes the inf step. lossscale's MAX keeps the flag at 1.0 and skips, also when the fused
    kernel is given the flag (device_side_skip, forced on the CPU)."""
    for rank, r in enumerate(job):
        theirs, ours = r["fused_two/torch"], r["fused_two/lossscale"]
        on_device = r["fused_two/lossscale_device"]  # the kernel reads the flag itself
        assert on_device["trajectory"] == ours["trajectory"], rank
        assert tensors_equal(on_device["params"][4], on_device["params"][3]), rank
        assert all(bool(torch.isfinite(p).all()) for p in on_device["params"][-1]), rank
        assert not tensors_equal(theirs["params"][4], theirs["params"][3])  # applied: should skip
        finite = all(bool(torch.isfinite(p).all()) for p in theirs["params"][4])
        assert finite is (rank not in (0, len(job) - 1))  # the inf where it overflowed
        assert all(bool(torch.isfinite(p).all()) for p in ours["params"][-1])
        assert tensors_equal(ours["params"][4], ours["params"][3])  # the step was skipped
        assert ours["trajectory"] == _expected_scales({4})


def test_fused_sgd_without_unscale_torch_does_not_agree_lossscale_does(
    job: list[dict[str, Any]],
) -> None:
    """torch's ShardedGradScaler all-reduces its flag in ``unscale_`` only; a fused optimizer
    stepped without ``unscale_`` gets each rank's own flag, so the ranks diverge at a one-rank
    overflow. lossscale agrees there too (and matches its unfused run's decisions)."""
    theirs = [r["fused_one/torch"] for r in job]
    assert len({tuple(t["trajectory"]) for t in theirs}) > 1  # torch's scales diverged
    expected = _expected_scales(set(_overflows(len(job))))
    for rank, r in enumerate(job):
        ours = r["fused_one/lossscale"]
        assert ours["trajectory"] == expected, rank
        assert tensors_equal(ours["full"], job[0]["fused_one/lossscale"]["full"]), rank
        assert all(bool(torch.isfinite(p).all()) for p in ours["full"]), rank


def test_found_inf_per_device_idiom(job: list[dict[str, Any]]) -> None:
    """torch's GradScaler + the idiom == lossscale's GradScaler + the idiom (both agreements in
    one step, S1) == lossscale's alone == lossscale's with a one-rank group + the idiom (the
    in-place all-reduce of ``_found_inf_per_device`` decides ``step``), bit for bit; and each
    rank reads the flag torch's reads: its own without the idiom (so which rank overflowed can be
    logged), the number of ranks that overflowed after a SUM, 1.0 everywhere after a MAX."""
    world = len(job)
    overflows = _overflows(world)
    for rank, r in enumerate(job):
        reference = r["idiom/torch"]
        assert [t[2] for t in reference["trajectory"]] == [
            float(s in overflows) for s in range(STEPS)
        ]
        own = [float(overflows.get(s) == rank) for s in range(STEPS)]
        assert [t[2] for t in r["idiom/torch_without"]["trajectory"]] == own
        assert r["idiom/torch_sum"]["trajectory"] == reference["trajectory"]  # one rank each
        for name in ("lossscale", "lossscale_without", "lossscale_sum", "lossscale_isolated"):
            ours = r[f"idiom/{name}"]
            reads = "torch_without" if name == "lossscale_without" else "torch"
            assert [t[2] for t in ours["trajectory"]] == [
                t[2] for t in r[f"idiom/{reads}"]["trajectory"]
            ], (rank, name)
            assert [t[:2] for t in ours["trajectory"]] == [
                t[:2] for t in reference["trajectory"]
            ], (rank, name)
            assert tensors_equal(ours["params"], reference["params"]), (rank, name)
            assert all(ours["stages"]), (rank, name)  # UNSCALED after unscale_, STEPPED after step
        assert tensors_equal(reference["params"], job[0]["idiom/torch"]["params"])
    # the control: without the idiom torch's ranks decide alone and diverge
    without = [r["idiom/torch_without"] for r in job]
    assert not all(tensors_equal(w["params"], without[0]["params"]) for w in without)
    assert len({tuple(w["trajectory"]) for w in without}) > 1


def test_sharded_flags_read_the_sum_over_ranks_as_torchs_grad_scaler_each_rank_its_own(
    job: list[dict[str, Any]],
) -> None:
    """After ``unscale_``, ``ShardedGradScaler._found_inf_per_device`` reads on every rank the
    number of ranks that overflowed, as torch's (its ``unscale_`` SUM-all-reduces in place);
    ``GradScaler``'s reads each rank's own flag, as torch's. torch's and lossscale's sharded
    scalers take the same decisions, bit for bit, also when the user MAX-all-reduces the sums
    before ``step`` (MAX of equal values changes nothing)."""
    world = len(job)
    overflows = _flag_overflows(world)
    count = [float(len(overflows.get(s, ()))) for s in range(STEPS)]
    assert max(count) == 2.0  # a step where two ranks overflow
    expected = _expected_scales(set(overflows))
    for rank, r in enumerate(job):
        own = [float(rank in overflows.get(s, ())) for s in range(STEPS)]
        for name, reads in (("flags_sharded", count), ("flags_plain", own)):
            for kind in ("torch", "lossscale"):
                got = [t[2] for t in r[f"{name}/{kind}"]["trajectory"]]
                assert got == reads, (rank, name, kind)
        for name in ("flags_sharded", "flags_sharded_max"):
            ours, theirs = r[f"{name}/lossscale"], r[f"{name}/torch"]
            assert ours["trajectory"] == theirs["trajectory"], (rank, name)
            assert [t[:2] for t in ours["trajectory"]] == expected, (rank, name)
            assert tensors_equal(ours["params"], theirs["params"]), (rank, name)
            assert tensors_equal(ours["params"], job[0][f"{name}/lossscale"]["params"]), rank
        maxed = r["flags_sharded_max/lossscale"]["trajectory"]
        assert [t[3] for t in maxed] == count  # the sums, after the user's MAX all-reduce
        # lossscale's GradScaler agrees over the default group: the same decisions as sharded
        plain = r["flags_plain/lossscale"]
        assert [t[:2] for t in plain["trajectory"]] == expected, rank


def test_forced_overflows_torch_reaches_zero_lossscale_stops_at_the_floor(
    job2: list[dict[str, Any]],
) -> None:
    """Run in the 2-rank job only (the floor does not depend on the world size)."""
    job = job2
    for rank, r in enumerate(job):
        theirs, ours = r["stall/torch"], r["stall/lossscale"]
        assert theirs["scales"][FORCED - 1] == 0.0, rank
        assert not theirs["finite"], rank  # 0 x inf: the clean step wrote NaN
        assert theirs["stall_warnings"] == 0
        assert min(ours["scales"]) == 1.0 and ours["scales"][FORCED - 1] == 1.0, rank
        assert ours["finite"], rank
        assert ours["stall_warnings"] == 1, rank  # once per stall
        assert ours["skipped"] == FORCED, rank
        assert ours["scales"] == job[0]["stall/lossscale"]["scales"]


@pytest.mark.parametrize("layout", ["two", "head"])
def test_fsdp1_a_rank_with_an_empty_shard_agrees_as_with_torch(
    job2: list[dict[str, Any]], layout: str
) -> None:
    """Ranks with no gradient for an optimizer's parameters (FSDP1, ``use_orig_params=True``)
    take part in the agreement and skip or apply with the others, step for step as torch's
    ShardedGradScaler: the same scales and bit-identical parameters on every rank."""
    job = job2
    name = f"empty_{layout}"
    assert not any(job[0][f"{name}/lossscale"]["empty"])
    assert all(job[1][f"{name}/lossscale"]["empty"])  # rank 1 never holds the head's gradient
    _same_as_torch(job, name)
    expected = _expected_scales({2, 5} if layout == "two" else {2})
    assert job[0][f"{name}/lossscale"]["trajectory"] == expected
