"""What lossscale.vllm's tests share: a tiny Llama saved from a config with a massive
activation planted in one layer's ``down_proj``, a plan file, and per-token log-probabilities
of the same tokens from vLLM and from transformers."""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lossscale.torch import Float16Plan

#: ``family -> (transformers config class, model class)`` for :func:`tiny_llama`.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}

#: The planted channel's largest value: beyond float16's 65504.
PLANTED = 2.0e5
VOCAB = 128


def tiny_llama(
    path: str,
    *,
    plant_layer: int | None = 1,
    hidden: int = 64,
    layers: int = 3,
    init: float = 0.2,
    planted: float = PLANTED,
    seed: int = 0,
    family: str = "llama",
) -> str:
    """A Llama (or, by ``family``, one of :data:`FAMILIES`) built from
    a config (head_dim 32: vLLM's CPU attention refuses 16; Gemma's sliding window 16, shorter
    than :func:`prompts`), float32, saved with ``save_pretrained`` in ``path``; with
    ``plant_layer``, one output channel of that layer's ``down_proj`` scaled so that its
    largest value over :func:`prompts` is ``planted``."""
    import transformers

    torch.manual_seed(seed)
    config_class, model_class = FAMILIES[family]
    extra: dict[str, Any] = {"head_dim": 32} if family != "llama" else {}
    if family.startswith("gemma"):
        extra |= {"sliding_window": 16, "query_pre_attn_scalar": 32}
    else:
        extra |= {"tie_word_embeddings": False}
    config = getattr(transformers, config_class)(
        **extra,
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=init,
    )
    model = getattr(transformers, model_class)(config)
    if plant_layer is not None:
        down = model.model.layers[plant_layer].mlp.down_proj
        seen: list[torch.Tensor] = []
        handle = down.register_forward_hook(lambda m, a, out: seen.append(out[..., 3].abs().max()))
        with torch.no_grad():
            model(torch.tensor(prompts()))
            handle.remove()
            down.weight[3] *= planted / float(seen[0])
    model.save_pretrained(path)
    return path


def prompts(count: int = 5, length: int = 21, seed: int = 1) -> list[list[int]]:
    """``count`` token sequences of ``length`` (tokens 3 and up, no special token)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count, length), generator=generator).tolist()


def plan_file(path: str, modules: Sequence[str], *, mode: str = "autocast") -> str:
    """A plan keeping ``modules`` in float32, saved at ``path`` (as ``Float16Audit.save``
    writes one)."""
    plan = Float16Plan(
        mode=mode,
        float32_modules=tuple(modules),
        scale_range=None,
        initial_scale=None,
        underflow=2.0**-24,
        reason="written by lossscale.vllm's tests",
        verified=None,
        modules=0,
        findings=(),
        versions={"lossscale": "test", "torch": torch.__version__},
    )
    plan.save(path)
    return path


def vllm_logprobs(llm: Any, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """The log-probability vLLM gives each token of ``sequences`` after the first,
    teacher-forced (``prompt_logprobs``): a float64 tensor ``(count, length - 1)``, NaN where
    vLLM's is not finite."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False
    )
    rows = []
    for sequence, output in zip(sequences, outputs, strict=True):
        row = []
        for token, entry in zip(sequence[1:], output.prompt_logprobs[1:], strict=True):
            value = entry[token].logprob
            row.append(value if math.isfinite(value) else math.nan)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def trainer_logprobs(
    path: str,
    sequences: Sequence[Sequence[int]],
    *,
    dtype: torch.dtype | None,
    plan: Sequence[str] = (),
    device: str = "cpu",
) -> torch.Tensor:
    """The same from transformers' forward on ``device``: float32 (``dtype`` None), under
    ``torch.autocast(dtype)`` (float16, with ``plan`` applied by ``Float16Plan.apply``), or
    the model cast to ``dtype`` (bfloat16, ``half=True``); the result on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # Gemma 2's attention logit soft-capping is computed by eager attention alone
    softcap = getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None)
    attention = {"attn_implementation": "eager"} if softcap else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **attention)
    model.to(device).eval()  # type: ignore[no-untyped-call, arg-type]
    tokens = torch.tensor([list(s) for s in sequences], device=device)
    handle = None
    if plan:
        handle = plan_of(plan).apply(model)
    with torch.no_grad():
        if dtype == torch.bfloat16:
            logits = model.to(torch.bfloat16)(tokens).logits  # type: ignore[arg-type]
        elif dtype is None:
            logits = model(tokens).logits
        else:
            with torch.autocast(torch.device(device).type, dtype=dtype):
                logits = model(tokens).logits
    if handle is not None:
        handle.remove()
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    return logp.gather(-1, tokens[:, 1:, None])[..., 0].cpu()


def plan_of(modules: Sequence[str]) -> Float16Plan:
    """A plan keeping ``modules`` (no file)."""
    return Float16Plan("autocast", tuple(modules), None, None, 2.0**-24, "", None, 0, (), {})


def mean_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """mean |a - b| (NaN when either has a NaN)."""
    return float((a - b).abs().mean())


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (or, for None, unset) environment variables while the block runs."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


#: What every engine of the tests is built with: eager (no torch.compile), a short context.
ENGINE = {"enforce_eager": True, "max_model_len": 128, "skip_tokenizer_init": True, "seed": 0}


@contextlib.contextmanager
def engine(path: str, dtype: str, plan: str | None = None, **kwargs: Any) -> Iterator[Any]:
    """A ``vllm.LLM`` of the model in ``path``, in this process, built with
    ``LOSSSCALE_PLAN=plan`` (unset for None); shut down after the block."""
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with environ(LOSSSCALE_PLAN=plan):
        llm = LLM(model=path, dtype=dtype, **(ENGINE | kwargs))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
