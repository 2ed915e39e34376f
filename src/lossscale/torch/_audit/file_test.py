"""The float16 audit's plan as a file (``Float16Audit.save``, ``load_plan``) and where the
framework sets the precision: through DDP (``accelerator.prepare``), gradient checkpointing
and ``save_pretrained``, and under FSDP1's and FSDP2's own float16 mixed precision (the plan's
modules sharded as float32 units), on 2 gloo ranks that read the plan from the file."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lossscale import _testing
from lossscale._version import __version__
from lossscale.torch import Finding, Float16Plan, audit, load_plan
from lossscale.torch._audit import _testing as models
from lossscale.torch._audit.file import FORMAT, VERSION

pytest.importorskip("transformers")

one_torch_thread = pytest.fixture(autouse=True, scope="module")(_testing.one_torch_thread)
BATCHES = models.batches(2)


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two plans the tests share, audited once and written to files: autocast on the
    massive activation, half on the attention logits."""
    folder = tmp_path_factory.mktemp("plans")
    autocast = audit(
        models.massive_activation_failure(models.llama()), models.token_sum_loss, BATCHES
    )
    half = audit(
        models.attention_logits_failure(models.llama()),
        models.token_sum_loss,
        BATCHES,
        mode="half",
    )
    autocast.save(folder / "autocast.json")
    half.save(folder / "half.json")
    return {"autocast": autocast, "half": half, "folder": folder}


def test_the_file_holds_the_plan_and_load_plan_gives_it_back(plans: dict[str, Any]) -> None:
    result = plans["autocast"]
    data = json.loads((plans["folder"] / "autocast.json").read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION == 1
    assert data["lossscale"] == __version__ and data["torch"] == torch.__version__
    assert data["float32_modules"] == ["model.layers.1.mlp.down_proj"]
    plan = load_plan(plans["folder"] / "autocast.json")
    assert isinstance(plan, Float16Plan)
    assert plan == result.plan
    assert plan.float32_modules == result.float32_modules
    assert plan.initial_scale == result.initial_scale and plan.initial_scale is not None
    assert plan.scale_range == result.scale_range and plan.mode == "autocast"
    assert plan.findings == result.findings and all(isinstance(f, Finding) for f in plan.findings)
    assert plan.verified is True and plan.modules == result.modules
    assert load_plan(str(plans["folder"] / "half.json")).mode == "half"


def test_an_infinite_amax_and_no_range_round_trip(tmp_path: Path) -> None:
    f = Finding("a", "backward", "MmBackward0", math.inf, True, 1.0, False, "why")
    plan = Float16Plan("half", ("a",), None, None, 1e-3, "nothing fits", None, 3, (f,), {})
    plan.save(tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["findings"][0]["amax"] == "inf"
    assert load_plan(tmp_path / "p.json") == plan  # the versions are the auditing process's


def test_the_loaded_plan_applies_as_the_audit_does(plans: dict[str, Any]) -> None:
    plan = load_plan(plans["folder"] / "autocast.json")
    model = models.massive_activation_failure(models.llama())
    assert not models.float16_step_is_finite(model, BATCHES[0])
    with plan.apply(model) as handle:
        assert handle.modules == plan.float32_modules
        assert models.float16_step_is_finite(model, BATCHES[0], plan.initial_scale)
        with torch.autocast("cpu", dtype=torch.float16):
            by_file = models.token_sum_loss(model, BATCHES[1])
    with plans["autocast"].apply(model), torch.autocast("cpu", dtype=torch.float16):
        by_audit = models.token_sum_loss(model, BATCHES[1])
    assert torch.equal(by_file, by_audit)
    assert not models.float16_step_is_finite(model, BATCHES[0])  # removed: as before


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("not json {", "not JSON"),
        ([1, 2], '"format"'),
        ({"format": "something else"}, '"format"'),
        ({"version": "1"}, "'version' must be a positive int"),
        ({"mode": "bfloat16"}, "'mode' must be one of"),
        ({"float32_modules": "model.layers"}, "'float32_modules' must be a list"),
        ({"scale_range": [8.0]}, "'scale_range' must be"),
        ({"scale_range": [16.0, 8.0]}, "low <= high"),
        ({"initial_scale": -1}, "'initial_scale' must be a positive finite"),
        ({"modules": True}, "'modules' must be a count"),
        ({"findings": [{"module": "a"}]}, "a finding must have the entries"),
        ({"verified": "yes"}, "'verified' a bool"),
        ("drop:underflow", "'underflow' is missing"),
    ],
)
def test_a_file_that_is_not_a_plan_is_refused(
    plans: dict[str, Any], tmp_path: Path, edit: Any, match: str
) -> None:
    data = json.loads((plans["folder"] / "autocast.json").read_text())
    if isinstance(edit, dict):
        data.update(edit)
    elif isinstance(edit, str) and edit.startswith("drop:"):
        del data[edit[5:]]
    else:
        data = edit
    with pytest.raises(ValueError, match=match) as error:
        load_plan(_write(tmp_path, data))
    assert "plan.json" in str(error.value)


def test_a_newer_format_is_refused_naming_both_versions(
    plans: dict[str, Any], tmp_path: Path
) -> None:
    data = json.loads((plans["folder"] / "autocast.json").read_text())
    data["version"] = 2
    with pytest.raises(ValueError, match=r"format version 2.*versions up to 1"):
        load_plan(_write(tmp_path, data))


def test_bad_paths_and_missing_files() -> None:
    with pytest.raises(TypeError, match=r"path must be a str or os.PathLike, got int"):
        load_plan(3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        load_plan("/nonexistent/plan.json")
    plan = Float16Plan("autocast", (), None, None, 1e-3, "", None, 1, (), {})
    with pytest.raises(TypeError, match=r"path must be"):
        plan.save(None)  # type: ignore[arg-type]


def test_a_model_without_a_planned_module_is_refused_untouched(plans: dict[str, Any]) -> None:
    plan = load_plan(plans["folder"] / "half.json")
    model = models.llama(layers=1).half()
    plan = plan._replace(float32_modules=(*plan.float32_modules, "model.layers.5.self_attn"))
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"'model.layers.5.self_attn', which the model has not"):
        plan.apply(model)
    for fn in (plan.fully_shard, plan.fsdp1_policy):
        with pytest.raises(ValueError, match=r"which the model has not"):
            fn(model)
    after = model.state_dict()
    assert all(after[k].dtype == d and torch.equal(after[k], v) for k, (d, v) in before.items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(TypeError, match=r"output_dtype must be a floating torch.dtype"):
        plan._replace(float32_modules=()).apply(model, output_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str"):
        plan.apply("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mp_policy"):
        plan._replace(float32_modules=()).fully_shard(model, mp_policy=None)
    with pytest.raises(TypeError, match=r"auto_wrap_policy must be"):
        plan._replace(float32_modules=()).fsdp1_policy(model, 3)


# -- in the processes a framework starts: DDP, checkpointing, save_pretrained, FSDP ----------


def _loss_and_grads(model: Any, batch: torch.Tensor, autocast: bool) -> tuple[Any, list[Any]]:
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = models.token_sum_loss(model, batch)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _finite(loss: Any, grads: list[Any]) -> bool:
    return bool(loss.isfinite()) and all(bool(g.isfinite().all()) for g in grads)


def _dtype_probe(model: Any, names: dict[str, str]) -> dict[str, Any]:
    """Record the dtype of each named module's first output (forward hooks)."""
    seen: dict[str, Any] = {}
    found = dict(model.named_modules())
    for key, name in names.items():

        def hook(m: Any, args: Any, out: Any, key: str = key) -> None:
            seen.setdefault(key, (out[0] if isinstance(out, tuple) else out).dtype)

        found[name].register_forward_hook(hook)
    return seen


def _ddp_part(rank: int, folder: Path) -> dict[str, Any]:
    """accelerate's prepare (DDP over the gloo group) of a model under the autocast plan,
    with gradient checkpointing, then save_pretrained and a reload."""
    import accelerate
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    plan = load_plan(folder / "autocast.json")
    batch = BATCHES[rank]
    out: dict[str, Any] = {}
    plain = models.massive_activation_failure(models.llama())
    out["plain_finite"] = _finite(*_loss_and_grads(plain, batch, True))
    model = models.massive_activation_failure(models.llama())
    handle = plan.apply(model)
    reference = _loss_and_grads(model, batch, True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    prepared = accelerator.prepare(model)
    out["ddp"] = isinstance(prepared, DistributedDataParallel)
    out["distributed_type"] = str(accelerator.distributed_type)
    probe = _dtype_probe(model, {"kept": plan.float32_modules[0], "other": "model.layers.0.mlp"})
    with torch.autocast("cpu", dtype=torch.float16):
        loss = models.token_sum_loss(prepared, batch)
    loss.backward()  # DDP averages the gradients over both ranks
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    out["prepared_finite"] = _finite(loss.detach(), grads)
    out["prepared_loss_equals_unprepared"] = torch.equal(loss.detach(), reference[0])
    out["dtypes"] = dict(probe)
    out["grads"] = grads
    # apply also after the wrapping, through DDP, by the unwrapped model's names
    handle.remove()
    again = plan.apply(prepared)
    with torch.autocast("cpu", dtype=torch.float16):
        out["after_prepare_finite"] = bool(models.token_sum_loss(prepared, batch).isfinite())
    again.remove()
    # the weights saved while the plan is live (a model outside DDP: DDP's gradient hooks
    # would average its gradients), reloaded in a fresh model, planned again
    fresh = models.massive_activation_failure(models.llama())
    with plan.apply(fresh):
        if rank == 0:
            fresh.save_pretrained(folder / "saved")
        torch.distributed.barrier()
        before = _loss_and_grads(fresh, batch, True)
    reloaded = LlamaForCausalLM.from_pretrained(folder / "saved", attn_implementation="eager")
    with plan.apply(reloaded):
        after = _loss_and_grads(reloaded, batch, True)
    out["reload_finite"] = _finite(*after)
    out["reload_equal"] = torch.equal(before[0], after[0]) and all(
        torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True)
    )
    return out


def _fsdp_model(plan: Float16Plan | None, version: int) -> Any:
    from torch.distributed.fsdp import (
        FullyShardedDataParallel,
        MixedPrecision,
        MixedPrecisionPolicy,
        fully_shard,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = models.attention_logits_failure(models.llama())
    if plan is not None:
        plan.apply(model, output_dtype=torch.float16)
    if version == 2:
        fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        if plan is not None:
            plan.fully_shard(model)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=fp16)
        fully_shard(model, mp_policy=fp16)
        return model
    layers = ModuleWrapPolicy({LlamaDecoderLayer})
    policy = layers if plan is None else plan.fsdp1_policy(model, layers)
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )


def _fsdp_part(rank: int, world: int, folder: Path, version: int) -> dict[str, Any]:
    import torch.distributed as dist

    plan = load_plan(folder / "half.json")
    batch = BATCHES[0]  # the same batch on both ranks: their losses must agree
    out: dict[str, Any] = {}
    plain = _fsdp_model(None, version)
    loss, grads = _loss_and_grads(plain, batch, False)
    out["plain_finite"] = _finite(loss, grads)
    model = _fsdp_model(plan, version)
    names = {n.replace("_fsdp_wrapped_module.", ""): n for n, _ in model.named_modules()}
    probe = _dtype_probe(
        model,
        {
            "kept.q_proj": names["model.layers.0.self_attn.q_proj"],
            "kept": names[plan.float32_modules[0]],
            "other.q_proj": names["model.layers.1.self_attn.q_proj"],
            "other.mlp": names["model.layers.0.mlp.down_proj"],
        },
    )
    loss, grads = _loss_and_grads(model, batch, False)
    out["finite"] = _finite(loss, grads)
    out["dtypes"] = dict(probe)
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.float())
    out["losses"] = [float(x) for x in losses]
    return out


def _job(rank: int, world: int, folder: str) -> dict[str, Any]:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    path = Path(folder)
    return {
        "ddp": _ddp_part(rank, path),
        "fsdp1": _fsdp_part(rank, world, path, 1),
        "fsdp2": _fsdp_part(rank, world, path, 2),
    }


@pytest.fixture(scope="module")
def ranks(plans: dict[str, Any]) -> list[dict[str, Any]]:
    folder = plans["folder"]
    return _testing.run_gloo_job(_job, 2, 180, folder / "job", (str(folder),))


def test_through_accelerate_ddp_and_checkpointing_the_plan_keeps_float16_finite(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        d = r["ddp"]
        assert d["ddp"] and d["distributed_type"] == "DistributedType.MULTI_CPU"
        assert not d["plain_finite"]  # without the plan: NaN
        assert d["prepared_finite"] and d["after_prepare_finite"]
        # the checkpointed, DDP-prepared forward computes what the plain planned one does
        assert d["prepared_loss_equals_unprepared"]
        assert d["dtypes"] == {"kept": torch.float32, "other": torch.float16}
    a, b = (r["ddp"]["grads"] for r in ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # DDP: ranks agree


def test_save_pretrained_and_reload_keep_the_plan(ranks: list[dict[str, Any]]) -> None:
    assert all(r["ddp"]["reload_finite"] and r["ddp"]["reload_equal"] for r in ranks)


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_under_fsdp_float16_mixed_precision_the_kept_modules_compute_in_float32(
    ranks: list[dict[str, Any]], version: str
) -> None:
    for r in ranks:
        d = r[version]
        assert not d["plain_finite"]  # FSDP's float16 alone: the attention logits overflow
        assert d["finite"]
        assert d["dtypes"] == {
            "kept.q_proj": torch.float32,  # inside the kept attention: float32
            "kept": torch.float16,  # handed back to the float16 residual stream
            "other.q_proj": torch.float16,
            "other.mlp": torch.float16,
        }
    losses = [r[version]["losses"] for r in ranks]
    assert losses[0] == losses[1] and losses[0][0] == losses[0][1]
    assert math.isfinite(losses[0][0])


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointings_recomputed_forward_keeps_the_plan(
    plans: dict[str, Any], reentrant: bool
) -> None:
    plan = load_plan(plans["folder"] / "autocast.json")
    model = models.massive_activation_failure(models.llama()).train()
    with plan.apply(model):
        reference = _loss_and_grads(model, BATCHES[0], True)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        checkpointed = _loss_and_grads(model, BATCHES[0], True)
    assert _finite(*checkpointed)
    assert torch.equal(reference[0], checkpointed[0])
    assert all(torch.equal(a, b) for a, b in zip(reference[1], checkpointed[1], strict=True))
