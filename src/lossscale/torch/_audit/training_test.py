"""The float16 audit of a model as it trains: under gradient checkpointing (transformers'
``gradient_checkpointing_enable()``, reentrant or not, and ``torch.utils.checkpoint`` called
directly), turned off for the audit's runs and on again after, with the findings of the model
without it; and in ``DistributedDataParallel`` and under FSDP2's ``fully_shard`` on 2 gloo
ranks with different batches, where every rank ends with the same result: the union of the
findings and the intersection of the ranges that each rank's batches give alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

from lossscale._testing import one_torch_thread, run_gloo_job
from lossscale.torch import Float16Audit, audit
from lossscale.torch._audit import _testing as models

pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)
BATCHES = models.batches(2)
JOB_TIMEOUT_S = 300.0


def _summary(result: Float16Audit) -> tuple[Any, ...]:
    """What the audit found: the findings, the plan, the range, the start, verified."""
    return (
        result.findings,
        result.float32_modules,
        result.scale_range,
        result.initial_scale,
        result.verified,
    )


def _layer_calls(model: Any) -> int:
    """How many times the decoder layers' MLPs run in one forward and backward in float32
    (2 per layer under checkpointing: the recomputation)."""
    calls = [0]
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for layer in model.model.layers
    ]
    try:
        models.token_sum_loss(model, BATCHES[0]).backward()
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    return calls[0]


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_is_off_for_the_audit_and_on_again_after(reentrant: bool) -> None:
    plain = models.massive_activation_failure(models.llama())
    expected = audit(plain, models.token_sum_loss, BATCHES, report=False)
    assert expected.float32_modules and expected.checkpointing == ()
    model = models.massive_activation_failure(models.llama())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    layers = len(model.model.layers)
    assert _layer_calls(model) == 2 * layers  # checkpointing: each layer runs again
    flagged = tuple(n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", 0))
    result = audit(model, models.token_sum_loss, BATCHES, report=False)
    assert _summary(result) == _summary(expected)
    assert result.checkpointing == flagged
    assert {f"model.layers.{i}" for i in range(layers)} <= set(flagged)
    line = f"gradient checkpointing: off for the audit's runs, on again after ({len(flagged)}"
    assert line in str(result)
    assert model.is_gradient_checkpointing
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert _layer_calls(model) == 2 * layers  # on again


class _Checkpointed(torch.nn.Module):
    """A block whose first layer overflows float16 (its outputs reach 1.2e5), run through
    ``torch.utils.checkpoint.checkpoint`` (reentrant: ``torch.autograd.grad`` cannot run
    through it)."""

    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 1)
        with torch.no_grad():
            self.block[0].weight.fill_(300.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
        else:
            h = self.block(x)
        return self.head(h)


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def test_torch_utils_checkpoint_runs_through_during_the_audit() -> None:
    x = [torch.full((8, 4), 100.0).requires_grad_()]
    torch.manual_seed(0)
    expected = audit(_Checkpointed(False), _loss, x, report=False)
    torch.manual_seed(0)
    model = _Checkpointed(True)
    original = torch.utils.checkpoint.checkpoint
    result = audit(model, _loss, x, report=False)
    assert _summary(result) == _summary(expected)
    assert result.float32_modules == ("block.0",)
    assert result.checkpointing == ("torch.utils.checkpoint.checkpoint",)
    assert torch.utils.checkpoint.checkpoint is original


# -- DistributedDataParallel on 2 gloo ranks ---------------------------------------------------
def _rank_batches(rank: int) -> list[torch.Tensor]:
    return models.batches(2, seed=10 + rank)


def _ddp_job(rank: int, world: int) -> dict[str, Any]:
    """On each rank: the audit of the model in DDP on this rank's batches, and (for the
    oracle) the audit of the plain model on each rank's batches alone."""
    from torch.nn.parallel import DistributedDataParallel

    model = models.massive_activation_failure(models.llama())
    ddp = DistributedDataParallel(model)
    result = audit(ddp, models.token_sum_loss, _rank_batches(rank), report=False)
    alone = [
        audit(
            models.massive_activation_failure(models.llama()),
            models.token_sum_loss,
            _rank_batches(r),
            report=False,
        )
        for r in range(world)
    ]
    down = model.model.layers[1].mlp.down_proj
    with result.apply(ddp), torch.autocast("cpu", dtype=torch.float16):
        kept = down(torch.randn(2, down.in_features)).dtype == torch.float32
    return {
        "summary": _summary(result),
        "text": str(result),
        "batches": result.batches,
        "ranks": result.ranks,
        "alone": [_summary(a) for a in alone],
        "kept": kept,
    }


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("ddp_audit")
    return run_gloo_job(_ddp_job, 2, JOB_TIMEOUT_S, out)


def test_every_rank_ends_with_the_same_result(ddp: list[dict[str, Any]]) -> None:
    assert ddp[0]["summary"] == ddp[1]["summary"]
    assert ddp[0]["text"] == ddp[1]["text"]
    assert all(r["batches"] == 4 and r["ranks"] == 2 for r in ddp)
    assert "(autocast, 4 batches on 2 ranks)" in ddp[0]["text"]
    assert all(r["kept"] for r in ddp)  # apply on the DDP model keeps its module's layer


def test_the_findings_are_the_union_and_the_range_the_intersection(
    ddp: list[dict[str, Any]],
) -> None:
    findings, plan, scale_range, initial, verified = ddp[0]["summary"]
    alone = ddp[0]["alone"]
    assert alone == ddp[1]["alone"]  # the oracle, computed on both ranks alike
    assert alone[0][2] != alone[1][2] or alone[0][0] != alone[1][0]  # the batches differ
    assert plan == alone[0][1] == alone[1][1]
    places: dict[tuple[str, str, str], float] = {}
    for their_findings, *_ in alone:
        for f in their_findings:
            if f.intrinsic:
                place = (f.module, f.phase, f.op)
                places[place] = max(places.get(place, 0.0), f.amax)
    assert {(f.module, f.phase, f.op): f.amax for f in findings if f.intrinsic} == places
    lows, highs = zip(*(a[2] for a in alone), strict=True)
    assert scale_range == (max(lows), min(highs))
    assert initial == max(max(lows), min(highs) / 8)
    bounds = [f for f in findings if not f.intrinsic]
    assert bounds and all(f.scale == 2 * min(highs) for f in bounds)
    assert verified is True


def _fsdp_job(rank: int, world: int) -> dict[str, Any]:
    """On each rank: the model sharded by FSDP2's ``fully_shard`` (each decoder layer, then
    the root), audited on this rank's batches; then the model as it was (its classes, its
    sharded parameters) and a training step through FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = models.massive_activation_failure(models.llama())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    classes = [type(m) for m in model.modules()]
    shards = [p.to_local().clone() for p in model.parameters()]
    result = audit(model, models.token_sum_loss, _rank_batches(rank), report=False)
    unchanged = classes == [type(m) for m in model.modules()] and all(
        isinstance(p, DTensor) and torch.equal(p.to_local(), s)
        for p, s in zip(model.parameters(), shards, strict=True)
    )
    loss = models.token_sum_loss(model, _rank_batches(rank)[0])
    loss.backward()
    return {
        "summary": _summary(result),
        "text": str(result),
        "ranks": result.ranks,
        "unchanged": unchanged,
        "trains": bool(torch.isfinite(loss))
        and all(p.grad is not None for p in model.parameters()),
    }


def test_fsdp2_gives_what_ddp_gives(ddp: list[dict[str, Any]], tmp_path: Path) -> None:
    """The same model and batches sharded by ``fully_shard``: each rank audits an unsharded
    replica (its parameters all-gathered), and every rank ends with DDP's result; the sharded
    model is left as it was and trains on."""
    fsdp = run_gloo_job(_fsdp_job, 2, JOB_TIMEOUT_S, tmp_path)
    assert fsdp[0]["summary"] == fsdp[1]["summary"] == ddp[0]["summary"]
    assert fsdp[0]["text"] == ddp[0]["text"]
    assert all(r["ranks"] == 2 and r["unchanged"] and r["trains"] for r in fsdp)
