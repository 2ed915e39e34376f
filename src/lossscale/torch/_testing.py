"""Small Hugging Face models built from a config (no download) with weights set to fail in
float16 the way bfloat16-pretrained models do: the float16 audit's test cases, shared by its
tests and its benchmark (the test suite's toolbox: not in the wheel).

Each ``*_failure`` function edits a model's weights in place (``torch.no_grad``) and returns
the model; ``token_sum_loss`` is the loss they are audited with (a token-summed loss, as RL
fine-tuning uses: gradients about ``tokens`` times a mean loss's).
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, WIDTH, LENGTH, BATCH = 64, 32, 16, 2


def llama(
    layers: int = 2, *, seed: int = 0, width: int = WIDTH, vocab: int = VOCAB, length: int = LENGTH
) -> Any:
    """A ``LlamaForCausalLM`` (eager attention: the explicit ``q @ k^T``, RMSNorm)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=max(2, width // 32),
        num_key_value_heads=max(2, width // 32),
        max_position_embeddings=length,
    )
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def qwen3(layers: int = 2, *, seed: int = 0) -> Any:
    """A ``Qwen3ForCausalLM``: QK-norm (an RMSNorm over each head's q and k), eps 1e-12."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=WIDTH // 2,
        max_position_embeddings=LENGTH,
        rms_norm_eps=1e-12,
    )
    cfg._attn_implementation = "eager"
    return Qwen3ForCausalLM(cfg)


def batches(
    n: int, *, seed: int = 1, vocab: int = VOCAB, shape: tuple[int, int] = (BATCH, LENGTH)
) -> list[torch.Tensor]:
    """``n`` batches of token ids, ``shape`` each."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(n)]


def token_sum_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over the tokens (the batch moved to the model)."""
    ids = ids.to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
    )


def massive_activation_failure(model: Any, layer: int = 1) -> Any:
    """A massive activation (Sun et al., 2024: a few channels of an MLP's down projection,
    thousands of times the median) at layer ``layer``: four gate/up channels share one large
    weight row, and one output row of the down projection reads them with weight 500, so that
    channel 7 of the down projection's output passes 65504 on some tokens."""
    mlp = model.model.layers[layer].mlp
    with torch.no_grad():
        row = mlp.gate_proj.weight[0].sign()
        mlp.gate_proj.weight[:4] = row
        mlp.up_proj.weight[:4] = row
        mlp.down_proj.weight[7, :4] = 200.0
    return model


def attention_logits_failure(model: Any, layer: int = 0) -> Any:
    """Attention logits above 65504 inside the attention's own ``forward``: ``q_proj`` scaled
    up and ``k_proj`` equal to it, so that ``q @ k^T`` (taken before the ``1/sqrt(d)``
    factor) is ``|q|^2`` on the diagonal."""
    attn = model.model.layers[layer].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(600.0)
        attn.k_proj.weight.copy_(attn.q_proj.weight)
    return model


def backward_failure(model: Any, layer: int = 0) -> Any:
    """A backward overflow at loss scale 1 with a normal forward (QK-norm over a tiny q, as in
    Qwen3-MoE and Gemma fine-tunes): ``q_proj`` scaled down by 1e-6, so that the RMSNorm over
    it multiplies the incoming gradient by about 1/rms(q)."""
    attn = model.model.layers[layer].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(1e-6)
    return model


def float16_step_is_finite(model: Any, batch: torch.Tensor, scale: float = 1.0) -> bool:
    """Whether one float16 autocast forward and backward at ``scale`` gives a finite loss and
    finite gradients (``.grad`` untouched)."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.float16):
        loss = token_sum_loss(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss * scale, params, allow_unused=True)
    checks = [torch.isfinite(loss)] + [torch.isfinite(g).all() for g in grads if g is not None]
    return bool(torch.stack(checks).all())
