"""``Float16Plan.apply`` on the models trainers actually hold: through PEFT's wrappers both
ways (a plan audited on the base model on the PEFT model around it, and back), refusing a
module the model truly lacks (naming the closest it has) and a model whose parameters are not
of the plan's mode, the model untouched each time."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lossscale import _testing
from lossscale.torch import Float16Plan, audit
from lossscale.torch._audit import _testing as models

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

one_torch_thread = pytest.fixture(autouse=True, scope="module")(_testing.one_torch_thread)
BATCHES = models.batches(2)
KEPT = "model.layers.1.mlp.down_proj"


def _lora(model: torch.nn.Module) -> Any:
    """``model`` inside PEFT's LoRA (``get_peft_model``), the planted ``down_proj`` adapted."""
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.get_peft_model(model, config)


def _planted() -> torch.nn.Module:
    return models.massive_activation_failure(models.llama())


@pytest.fixture(scope="module")
def base_plan() -> Float16Plan:
    result = audit(_planted(), models.token_sum_loss, BATCHES)
    assert result.float32_modules == (KEPT,) and result.verified
    return result.plan


@pytest.fixture(scope="module")
def peft_plan() -> Float16Plan:
    result = audit(_lora(_planted()), models.token_sum_loss, BATCHES)
    assert result.verified
    return result.plan


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _finite(model: torch.nn.Module) -> bool:
    return models.float16_step_is_finite(model, BATCHES[0])


def test_a_plan_audited_on_the_base_model_holds_on_the_peft_model(base_plan: Float16Plan) -> None:
    wrapped = _lora(_planted())
    assert not _finite(wrapped)  # the planted overflow, LoRA or not
    seen: list[torch.dtype] = []
    adapter = wrapped.base_model.model.model.layers[1].mlp.down_proj  # LoRA's layer around it
    adapter.base_layer.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with base_plan.apply(wrapped):
        assert _finite(wrapped)
    # the adapter layer is kept, the base Linear inside it computes in float32
    assert seen[-1] == torch.float32 and _hooks(wrapped) == 1


def test_a_plan_audited_on_the_peft_model_holds_on_the_base_model_and_on_itself(
    peft_plan: Float16Plan,
) -> None:
    assert all(n.startswith("base_model.model.") for n in peft_plan.float32_modules)
    base = _planted()
    with peft_plan.apply(base):
        assert _finite(base)
    wrapped = _lora(_planted())
    with peft_plan.apply(wrapped):
        assert _finite(wrapped)
    assert _hooks(base) == 0 and _hooks(wrapped) == 0


def test_a_plan_naming_a_module_and_its_peft_twin_keeps_it_once(base_plan: Float16Plan) -> None:
    twins = base_plan._replace(float32_modules=(KEPT, f"base_model.model.{KEPT}.base_layer"))
    base = _planted()
    with twins.apply(base):
        assert _hooks(base) == 2  # one pre-hook and one hook: kept once
        assert _finite(base)


def test_a_module_the_model_lacks_is_refused_naming_the_closest(base_plan: Float16Plan) -> None:
    wrapped = _lora(_planted())
    missing = base_plan._replace(float32_modules=("model.layers.1.mlp.down_prj",))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.down_prj'.*closest.*down_proj"):
        missing.apply(wrapped)
    assert _hooks(wrapped) == 0
    with pytest.raises(ValueError, match=r"'model\.layers\.7\.mlp\.down_proj'"):
        base_plan._replace(float32_modules=(KEPT, "model.layers.7.mlp.down_proj")).apply(wrapped)
    assert _hooks(wrapped) == 0


def test_fully_shard_and_fsdp1_policy_find_the_modules_through_peft(
    peft_plan: Float16Plan,
) -> None:
    from torch.distributed.fsdp.wrap import CustomPolicy

    base = _planted()
    policy = peft_plan.fsdp1_policy(base)
    assert isinstance(policy, CustomPolicy)
    kept = dict(base.named_modules())[KEPT]
    assert policy._lambda_fn(kept) and not policy._lambda_fn(base.model.layers[0])


@pytest.mark.parametrize(
    ("mode", "make", "dtype"),
    [
        ("autocast", lambda m: m.half(), "torch.float16"),
        ("half", lambda m: m, "torch.float32"),
        ("autocast", lambda m: _lora(m.half()), "torch.float16"),  # float32 adapters, float16 base
    ],
)
def test_a_plan_of_the_other_mode_is_refused_and_the_model_untouched(
    base_plan: Float16Plan, mode: str, make: Any, dtype: str
) -> None:
    model = make(_planted())
    before = {n: (p.dtype, p.clone()) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"mode is '{mode}'.*parameters are {dtype}"):
        base_plan._replace(mode=mode).apply(model)
    assert _hooks(model) == 0
    assert all(
        p.dtype == before[n][0] and torch.equal(p, before[n][1])
        for n, p in model.named_parameters()
    )


def test_a_half_plan_applies_to_a_half_model_and_with_output_dtype_to_a_float32_one(
    base_plan: Float16Plan,
) -> None:
    half = base_plan._replace(mode="half")
    model = _planted().half()
    with half.apply(model):
        assert dict(model.named_modules())[KEPT].weight.dtype == torch.float32
    assert dict(model.named_modules())[KEPT].weight.dtype == torch.float16
    # FSDP's float16 holds the parameters: a float32 model, not checked
    fsdp = copy.deepcopy(_planted())
    half.apply(fsdp, output_dtype=torch.float16).remove()
