"""``install(trainer, plan=...)`` with TRL 1.16's SFT (LoRA), DPO and GRPO trainers on the CPU,
side by side with the plan applied by hand (the documented way before ``plan=``) and with no
plan: a tiny Llama whose layer-1 MLP and logits overflow float16 (``_testing.planted_llama``).

* TRL's fused lm_head computes the log-probabilities from ``lm_head.weight`` without calling
  ``lm_head``: a plan applied by hand leaves it in float16 and every loss is NaN; with
  ``install(plan=...)`` (TRL's ``cast_lm_head_to_fp32`` turned on there) the losses are finite.
* The reference model (DPO, prepared in the constructor as on a GPU, where Accelerate's
  autocast is on by then; GRPO, which computes it inside ``accelerator.autocast()``) runs the
  plan: its kept MLP computes in float32 and its log-probabilities are finite.
* With GRPO's own ``cast_lm_head_to_fp32=True`` the fused head is float32 already; the rest of
  the plan (the reference model's MLP) still needs ``install(plan=...)``.
* The first step's check: a path that bypasses a kept module (an MLP "kernel" that reads
  ``down_proj.weight`` itself) is refused before the first optimizer step when the module
  gets gradients, and warned about when it does not (LoRA: frozen).
* Refusals, each leaving the trainer and its models as they were.

Each trainer runs 2-3 steps of batches of 4, sequences up to 16 tokens: about a second.
"""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

import trl  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from lossscale._testing import one_torch_thread  # noqa: E402
from lossscale.accelerate import PlanBypassWarning, install  # noqa: E402
from lossscale.accelerate._plan import fused_forward  # noqa: E402
from lossscale.accelerate._testing import (  # noqa: E402
    audit_llama,
    char_tokenizer,
    grpo_trainer,
    planted_llama,
)
from lossscale.accelerate.hf import PlanCheckCallback  # noqa: E402

_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)

TEXTS = ["abcabc", "defdef", "ghighi", "jajaja"] * 2
PREFERENCES = {
    "prompt": ["ab", "cd", "ef", "gh"],
    "chosen": ["aa", "ca", "ea", "ga"],
    "rejected": ["bb", "db", "fb", "hb"],
}
DOWN_PROJ = "model.layers.1.mlp.down_proj"
COMMON = {
    "fp16": True,
    "use_cpu": True,
    "max_steps": 3,
    "per_device_train_batch_size": 4,
    "learning_rate": 1e-3,
    "logging_steps": 1,
    "logging_nan_inf_filter": False,  # a NaN loss is logged as NaN
    "report_to": [],
    "disable_tqdm": True,
    "save_strategy": "no",
    "seed": 0,
    "dataloader_num_workers": 0,
}


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The audit of the planted model, its plan saved, and the model saved (TRL builds the
    reference model from ``config._name_or_path``)."""
    tmp = tmp_path_factory.mktemp("plan")
    result = audit_llama(planted_llama())
    result.save(tmp / "plan.json")
    planted_llama().save_pretrained(tmp / "model")
    return {"audit": result, "plan": result.plan, "path": tmp / "plan.json", "model": tmp / "model"}


def _policy(audited: dict[str, Any]) -> Any:
    return LlamaForCausalLM.from_pretrained(audited["model"])


def _sft(model: Any, out: Path, lora: bool = True, **config: Any) -> Any:
    peft = LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if lora else None
    return trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(output_dir=str(out), max_length=16, **{**COMMON, **config}),
        train_dataset=Dataset.from_dict({"text": TEXTS}),
        processing_class=char_tokenizer(),
        peft_config=peft,
    )


def _dpo(model: Any, out: Path, trainer: type = trl.DPOTrainer, **config: Any) -> Any:
    return trainer(
        model=model,
        args=trl.DPOConfig(output_dir=str(out), max_length=16, **{**COMMON, **config}),
        train_dataset=Dataset.from_dict(PREFERENCES),
        processing_class=char_tokenizer(),
    )


class _DPOPreparedAsOnAGPU(trl.DPOTrainer):  # type: ignore[misc]
    """TRL's DPOTrainer with Accelerate's float16 autocast on from the start, as on a GPU: the
    reference model it prepares in its constructor runs under autocast. On the CPU Accelerate
    turns it on only at ``install``, after the constructor: the reference stays float32."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        install(self.accelerator)


def _losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _option(model: Any) -> bool:
    """The ``cast_lm_head_to_fp32`` of TRL's fused forward on ``model``."""
    fused = fused_forward(model)
    assert fused is not None
    return bool(inspect.getclosurevars(fused).nonlocals["cast_lm_head_to_fp32"])


def _record(model: Any) -> dict[str, Any]:
    """Hooks on ``model``: the dtype its layer-1 ``down_proj`` computed in, whether its fused
    log-probabilities were finite, and how often ``lm_head``'s forward ran."""
    seen: dict[str, Any] = {"dtypes": set(), "finite": [], "head_calls": 0}
    mlp = model.get_submodule(DOWN_PROJ)
    mlp.register_forward_hook(lambda m, i, out: seen["dtypes"].add(out.dtype))

    def logprobs(module: Any, args: Any, out: Any) -> None:
        if getattr(out, "log_probs", None) is not None:
            seen["finite"].append(bool(out.log_probs.isfinite().all()))

    def head(module: Any, args: Any, out: Any) -> None:
        seen["head_calls"] += 1

    model.register_forward_hook(logprobs)
    model.get_output_embeddings().register_forward_hook(head)
    return seen


def _base(trainer: Any) -> Any:
    model = trainer.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _run(mode: str, build: Any, audited: dict[str, Any], plan: Any, out: Path) -> dict[str, Any]:
    """``mode``: ``alone`` (install, no plan), ``by_hand`` (the plan applied to the model
    before the trainer is built, then install) or ``plan`` (``install(trainer, plan=plan)``)."""
    model = _policy(audited)
    if mode == "by_hand":
        audited["plan"].apply(model)
    trainer = build(model, out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install(trainer, plan=plan if mode == "plan" else None)
        policy = _record(_base(trainer))
        ref = getattr(trainer, "ref_model", None)
        reference = _record(ref) if ref is not None else None
        trainer.train()
    bypass = [w for w in caught if issubclass(w.category, PlanBypassWarning)]
    return {
        "trainer": trainer,
        "losses": _losses(trainer),
        "policy": policy,
        "ref": reference,
        "bypass": bypass,
    }


def _all_nan(losses: list[float]) -> bool:
    return bool(losses) and all(math.isnan(x) for x in losses)


def _all_finite(losses: list[float]) -> bool:
    return bool(losses) and all(math.isfinite(x) for x in losses)


def test_the_audit_keeps_the_mlp_and_the_head(audited: dict[str, Any]) -> None:
    assert audited["plan"].float32_modules == (DOWN_PROJ, "lm_head")
    assert audited["plan"].verified


def test_sft_lora_the_fused_head_holds_the_plan_only_with_install(
    audited: dict[str, Any], tmp_path: Path
) -> None:
    runs = {
        mode: _run(mode, _sft, audited, audited["path"], tmp_path / mode)
        for mode in ("alone", "by_hand", "plan")
    }
    assert _all_nan(runs["alone"]["losses"])
    assert _all_nan(runs["by_hand"]["losses"])  # lm_head kept, yet bypassed: NaN as without
    assert _all_finite(runs["plan"]["losses"]) and len(runs["plan"]["losses"]) == 3
    for run in runs.values():
        assert run["policy"]["head_calls"] == 0  # the fused head never calls lm_head
        assert not run["bypass"]
    assert not _option(_base(runs["by_hand"]["trainer"]))
    assert _option(_base(runs["plan"]["trainer"]))  # TRL's own option, on for this model
    assert runs["plan"]["policy"]["dtypes"] == {torch.float32}
    assert runs["by_hand"]["policy"]["dtypes"] == {torch.float32}  # the MLP holds either way


def test_dpo_the_fused_head_holds_the_plan_only_with_install(
    audited: dict[str, Any], tmp_path: Path
) -> None:
    runs = {
        mode: _run(mode, _dpo, audited, audited["audit"], tmp_path / mode)
        for mode in ("alone", "by_hand", "plan")
    }
    assert _all_nan(runs["alone"]["losses"]) and _all_nan(runs["by_hand"]["losses"])
    assert _all_finite(runs["plan"]["losses"])
    # on the CPU TRL prepared the reference model before install: it runs in float32
    assert runs["alone"]["ref"]["dtypes"] == {torch.float32}
    assert all(runs["alone"]["ref"]["finite"])


def _reference_runs_the_plan_only_with_install(
    by_hand: dict[str, Any], ours: dict[str, Any]
) -> None:
    """The reference model's kept module computed in float16 with non-finite log-probabilities
    and NaN losses when the plan was applied by hand to the policy; in float32, finite, with
    finite losses and no bypass with ``install(plan=)``."""
    assert by_hand["ref"]["dtypes"] == {torch.float16}
    assert by_hand["ref"]["finite"] and not any(by_hand["ref"]["finite"])
    assert ours["ref"]["dtypes"] == {torch.float32}
    assert ours["ref"]["finite"] and all(ours["ref"]["finite"])
    assert _all_nan(by_hand["losses"]) and _all_finite(ours["losses"])
    assert not ours["bypass"]


def test_dpo_reference_model_prepared_as_on_a_gpu_runs_the_plan(
    audited: dict[str, Any], tmp_path: Path
) -> None:
    def build(model: Any, out: Path) -> Any:
        return _dpo(model, out, trainer=_DPOPreparedAsOnAGPU)

    by_hand = _run("by_hand", build, audited, None, tmp_path / "by_hand")
    ours = _run("plan", build, audited, audited["plan"], tmp_path / "plan")
    # the policy's plan does not reach the reference model TRL built from the same weights
    _reference_runs_the_plan_only_with_install(by_hand, ours)
    assert _option(ours["trainer"].ref_model)  # found through Accelerate's autocast wrapper


def test_dpo_reference_log_probs_precomputed_before_the_plan(
    audited: dict[str, Any], tmp_path: Path
) -> None:
    """With ``precompute_ref_log_probs=True`` TRL computes them in the constructor, before
    ``install``: where that ran in float16 without the plan (as on a GPU) they are NaN, and
    ``install(plan=)`` refuses; where they are finite (the CPU's float32) it trains."""
    gpu_like = _dpo(
        _policy(audited), tmp_path / "gpu", _DPOPreparedAsOnAGPU, precompute_ref_log_probs=True
    )
    assert not all(math.isfinite(x) for x in gpu_like.train_dataset["ref_chosen_logps"])
    with pytest.raises(ValueError, match=r"precomputed .*not finite.*precompute_ref_log_probs"):
        install(gpu_like, plan=audited["plan"])
    assert not _option(_base(gpu_like))
    audited["plan"].apply(_base(gpu_like)).remove()  # nothing kept
    cpu = _dpo(_policy(audited), tmp_path / "cpu", precompute_ref_log_probs=True)
    install(cpu, plan=audited["plan"])
    cpu.train()
    assert _all_finite(_losses(cpu))


def test_grpo_reference_model_runs_the_plan(audited: dict[str, Any], tmp_path: Path) -> None:
    def build(model: Any, out: Path) -> Any:
        return grpo_trainer(
            model, str(out), beta=0.1, max_steps=2, learning_rate=1e-3, logging_nan_inf_filter=False
        )

    by_hand = _run("by_hand", build, audited, None, tmp_path / "by_hand")
    ours = _run("plan", build, audited, audited["plan"], tmp_path / "plan")
    # GRPO computes the reference inside accelerator.autocast(): float16 on the CPU too
    _reference_runs_the_plan_only_with_install(by_hand, ours)


def _bypass_down_proj(model: Any) -> None:
    """A fused MLP "kernel" (as a kernel library would put in): reads ``down_proj.weight``
    itself, never calling ``down_proj``."""
    mlp = model.get_submodule(DOWN_PROJ.rsplit(".", 1)[0])

    def forward(x: Any) -> Any:
        hidden = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        return torch.nn.functional.linear(hidden, mlp.down_proj.weight)

    mlp.forward = forward


def test_a_bypassed_module_with_gradients_is_refused_at_the_first_step(
    audited: dict[str, Any], tmp_path: Path
) -> None:
    trainer = _sft(_policy(audited), tmp_path, lora=False)
    install(trainer, plan=audited["plan"])
    _bypass_down_proj(trainer.model)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    refused = rf"parameters of '{DOWN_PROJ}' in the policy .*got gradients.*bypasses"
    with pytest.raises(ValueError, match=refused):
        trainer.train()
    after = list(trainer.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert trainer.state.global_step == 0


def test_a_bypassed_module_without_gradients_warns(audited: dict[str, Any], tmp_path: Path) -> None:
    trainer = _sft(_policy(audited), tmp_path)  # LoRA on q_proj, v_proj: down_proj frozen
    install(trainer, plan=audited["plan"])
    _bypass_down_proj(_base(trainer))
    with pytest.warns(PlanBypassWarning, match=rf"module '{DOWN_PROJ}'.*cannot tell") as caught:
        trainer.train()
    assert len([w for w in caught if issubclass(w.category, PlanBypassWarning)]) == 1
    assert trainer.state.global_step == 3  # a warning: training goes on


def test_a_plan_applied_by_hand_too_is_applied_once(
    audited: dict[str, Any], tmp_path: Path
) -> None:
    plan = audited["plan"]
    model = _policy(audited)
    by_hand = plan.apply(model)
    trainer = _dpo(model, tmp_path)
    scaler = install(trainer, plan=plan)
    assert install(trainer, plan=plan) is scaler  # again: nothing more applied
    checks = [c for c in trainer.callback_handler.callbacks if isinstance(c, PlanCheckCallback)]
    assert len(checks) == 1
    with pytest.raises(ValueError, match="already kept"):
        plan.apply(trainer.ref_model)  # install applied it to the reference model
    by_hand.remove()
    plan.apply(model).remove()  # install added nothing on the policy's modules
    assert _option(model) and _option(trainer.ref_model)


def _unchanged(trainer: Any, before: tuple[Any, ...], plan: Any) -> None:
    accelerator = trainer.accelerator
    assert (accelerator.scaler, accelerator.native_amp) == before[:2]
    assert trainer.callback_handler.callbacks == before[2]
    assert not _option(_base(trainer))
    plan.apply(_base(trainer)).remove()  # no module kept


@pytest.mark.parametrize(
    ("argument", "config", "error", "match"),
    [
        # SFTConfig without fp16 trains in bfloat16 (TRL's default)
        ("float16 plan", {"fp16": False}, ValueError, r"mixed_precision is 'bf16', not 'fp16'"),
        (42, {}, TypeError, r"plan must be a path, .*Float16Audit, got builtins\.int"),
        ("missing", {}, ValueError, r"the policy.*keeps module 'model\.layers\.9\.mlp', which"),
        ("no file", {}, FileNotFoundError, r"nothing-here\.json"),
    ],
    ids=["not float16", "not a plan", "a module the model lacks", "no file"],
)
def test_refusals_leave_the_trainer_unchanged(
    audited: dict[str, Any], tmp_path: Path, argument: Any, config: Any, error: type, match: str
) -> None:
    plan = audited["plan"]
    trainer = _sft(_policy(audited), tmp_path, lora=False, **config)
    accelerator = trainer.accelerator
    before = (accelerator.scaler, accelerator.native_amp, list(trainer.callback_handler.callbacks))
    given = {
        "float16 plan": plan,
        "missing": plan._replace(float32_modules=("lm_head", "model.layers.9.mlp")),
        "no file": tmp_path / "nothing-here.json",
    }.get(argument, argument)
    with pytest.raises(error, match=match):
        install(trainer, plan=given)
    _unchanged(trainer, before, plan)


def test_a_plan_with_an_accelerator_is_refused(audited: dict[str, Any]) -> None:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(ValueError, match=r"plan needs a transformers\.Trainer.*plan\.apply"):
        install(accelerator, plan=audited["plan"])
    assert accelerator.scaler is None and not accelerator.native_amp


def test_grpo_with_trls_own_option_on_needs_no_more(
    audited: dict[str, Any], tmp_path: Path
) -> None:
    """``GRPOConfig(cast_lm_head_to_fp32=True)``: TRL computes the fused head in float32
    already; install applies the rest of the plan, and the check counts no bypass."""

    def build(model: Any, out: Path) -> Any:
        return grpo_trainer(
            model,
            str(out),
            beta=0.1,
            max_steps=2,
            learning_rate=1e-3,
            logging_nan_inf_filter=False,
            cast_lm_head_to_fp32=True,
        )

    by_hand = _run("by_hand", build, audited, None, tmp_path / "by_hand")
    ours = _run("plan", build, audited, audited["plan"], tmp_path / "plan")
    # TRL's option holds the reference model's head, not its MLP
    assert by_hand["ref"]["dtypes"] == {torch.float16} and not any(by_hand["ref"]["finite"])
    assert _all_nan(by_hand["losses"])
    assert _option(_base(ours["trainer"])) and _option(ours["trainer"].ref_model)
    assert ours["ref"]["dtypes"] == {torch.float32} and all(ours["ref"]["finite"])
    assert _all_finite(ours["losses"]) and not ours["bypass"]
