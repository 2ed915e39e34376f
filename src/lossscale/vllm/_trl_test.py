"""TRL's GRPO with vLLM, end to end on the CPU: ``GRPOTrainer(use_vllm=True,
vllm_mode="colocate", fp16=True)`` with lossscale's scaler and the plan in the trainer, on a
Llama with a massive activation planted in layer 0, two steps each, side by side:

* ``LOSSSCALE_PLAN`` in vLLM too: rewards and losses non-zero and finite;
* the same run without it in vLLM: silently dead (NaN logits sample pad tokens, whose
  completions are masked: reward 0, loss 0), and TRL raises nothing.

Test shim (what a GPU user would not need): TRL's weight sync calls the model's
``load_weights`` parameter by parameter, which fails on vLLM's CPU build (its weights are
packed for oneDNN); :func:`cpu_weight_sync_shim` replaces that one call with the engine's
``reload_weights`` (through ``collective_rpc``). Everything else is TRL's own code.

The checkpoint is saved in float16, so that vLLM's ``dtype="auto"`` (TRL passes no dtype) is
float16 in both runs; with the variable set, ``auto`` is float16 whatever the checkpoint.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from lossscale.vllm import _testing as T

CHARACTERS = "abcdefghij "
PROMPTS = ("ab", "cd", "ef", "gh", "ij", "ba", "dc", "fe")
KEPT = "model.layers.0.mlp.down_proj"


def char_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def planted_policy(path: str) -> str:
    """A 2-layer Llama (hidden 64, head_dim 32) over the character tokenizer, layer 0's
    down_proj channel 3 up to 2e5 on the prompts, saved in float16 with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(CHARACTERS) + 2,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config)
    tokenizer = char_tokenizer()
    down = model.get_submodule(KEPT)
    seen: list[torch.Tensor] = []
    handle = down.register_forward_hook(lambda m, a, out: seen.append(out[..., 3].abs().max()))
    with torch.no_grad():
        model(torch.tensor([tokenizer.encode(p) for p in PROMPTS]))
        handle.remove()
        down.weight[3] *= T.PLANTED / float(seen[0])
    model.to(torch.float16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reward_length(completions: list[str], **kwargs: Any) -> list[float]:
    """How many characters a completion has (pad tokens decode to nothing)."""
    del kwargs
    return [float(len(text)) for text in completions]


def cpu_weight_sync_shim(generation: Any) -> None:
    """Test shim: TRL's colocated weight sync through the engine's ``reload_weights`` (vLLM's
    CPU build packs its weights, and the model's ``load_weights`` fails there)."""

    def sync_weights() -> None:
        weights = [(name, p.detach().clone()) for name, p in generation._iter_named_params()]
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


def grpo_run(
    path: str,
    output_dir: str,
    plan_in_vllm: str | None,
    plan: str,
    rollout_dtype: torch.dtype = torch.float16,
) -> list[dict]:
    """Two GRPO steps of the policy in ``path`` with the plan in the trainer and
    ``LOSSSCALE_PLAN=plan_in_vllm`` (None: unset) while TRL builds vLLM; the logged steps."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import lossscale.accelerate
    from lossscale.torch import load_plan

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    handle = load_plan(plan).apply(model)
    config = trl.GRPOConfig(
        output_dir=output_dir,
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=8,
        learning_rate=1e-4,
        optim="adamw_torch",
        fp16=True,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        vllm_enable_sleep_mode=False,
    )
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with T.environ(LOSSSCALE_PLAN=plan_in_vllm):
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=reward_length,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}),
            processing_class=char_tokenizer(),
        )
    try:
        llm = trainer.vllm_generation.llm
        assert llm.llm_engine.model_config.dtype == rollout_dtype
        cpu_weight_sync_shim(trainer.vllm_generation)
        lossscale.accelerate.install(trainer)
        trainer.train()
        return [entry for entry in trainer.state.log_history if "loss" in entry]
    finally:
        trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()
        handle.remove()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("grpo")
    path = planted_policy(str(folder / "policy"))
    plan = T.plan_file(str(folder / "plan.json"), [KEPT])
    return {
        "plan in vLLM": grpo_run(path, str(folder / "a"), plan, plan),
        "vLLM alone": grpo_run(path, str(folder / "b"), None, plan),
    }


def test_grpo_with_the_plan_in_vllm_trains(runs: dict[str, list[dict]]) -> None:
    logs = runs["plan in vLLM"]
    assert len(logs) == 2
    for entry in logs:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["reward"])
    assert all(entry["reward"] > 0 for entry in logs)
    assert all(entry["loss"] != 0 for entry in logs)
    assert all(math.isfinite(e["sampling/sampling_logp_difference/mean"]) for e in logs)


def test_the_same_run_without_the_plan_in_vllm_is_silently_dead(
    runs: dict[str, list[dict]],
) -> None:
    logs = runs["vLLM alone"]
    assert len(logs) == 2  # TRL raised nothing
    assert all(entry["reward"] == 0 and entry["loss"] == 0 for entry in logs), logs
