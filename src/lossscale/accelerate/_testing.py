"""A tiny TRL ``GRPOTrainer`` on the CPU, built from configs (nothing downloaded): a
Llama-style model, a character tokenizer built with ``tokenizers``, prompts and a reward in
Python. Shared by the GRPO tests and the benchmark (the test suite's toolbox).

torch, transformers, tokenizers, datasets and trl are imported inside the functions only.
"""

from __future__ import annotations

from typing import Any

#: The characters of the tokenizer (after ``<pad>`` and ``<eos>``, ids 0 and 1).
CHARACTERS = "abcdefghij "
PROMPTS = ("ab", "cd", "ef", "gh", "ij", "ba", "dc", "fe")


def char_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character of :data:`CHARACTERS`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>"
    )


def tiny_llama(seed: int = 0, layers: int = 1, width: int = 16) -> Any:
    """A ``LlamaForCausalLM`` over :func:`char_tokenizer`'s vocabulary, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(CHARACTERS) + 2,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config)


def planted_llama(seed: int = 0) -> Any:
    """A 2-layer, width-32 :func:`tiny_llama` that float16 breaks in two places, as
    bfloat16-pretrained models do: a massive activation in layer 1's MLP (one channel of
    ``model.layers.1.mlp.down_proj``'s output reaches about 2e5) and logits beyond 65504 (every
    row of ``lm_head`` carries 2e4 in that channel: a shift of all logits, which float32's
    softmax ignores and float16 turns into inf)."""
    import torch

    model = tiny_llama(seed, layers=2, width=32)
    with torch.no_grad():
        mlp = model.model.layers[1].mlp
        row = mlp.gate_proj.weight[0].sign()
        mlp.gate_proj.weight[:4] = row
        mlp.up_proj.weight[:4] = row
        mlp.down_proj.weight[7, :4] = 200.0
        model.lm_head.weight[:, 7] += 2e4
    return model


def audit_llama(model: Any) -> Any:
    """:func:`lossscale.torch.audit` of a :func:`tiny_llama` on two batches of 16 random
    tokens, next-token cross-entropy as the loss."""
    import torch
    import torch.nn.functional as F

    from lossscale.torch import audit

    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(2, len(CHARACTERS) + 2, (2, 16), generator=generator) for _ in "ab"]

    def loss_fn(model: Any, ids: Any) -> Any:
        logits = model(input_ids=ids).logits[:, :-1].float()
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")

    return audit(model, loss_fn, batches, underflow=0.01)


def reward_a(completions: list[str], **kwargs: Any) -> list[float | None]:
    """The reward: how many ``a`` a completion has."""
    del kwargs
    return [float(text.count("a")) for text in completions]


def grpo_trainer(model: Any, output_dir: str, **config: Any) -> Any:
    """A ``trl.GRPOTrainer`` of ``model`` with ``fp16=True`` on the CPU: 4 prompts a step, 4
    completions of up to 6 characters each, AdamW (torch's, not fused) at 1e-2 with a linear
    schedule, a log every step, no checkpoints; ``config`` overrides ``GRPOConfig``'s."""
    import importlib

    from datasets import Dataset

    trl: Any = importlib.import_module("trl")

    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "linear",
        "optim": "adamw_torch",
        "fp16": True,
        "use_cpu": True,
        "report_to": [],
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
        **config,
    }
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_a,
        args=trl.GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}),
        processing_class=char_tokenizer(),
    )
