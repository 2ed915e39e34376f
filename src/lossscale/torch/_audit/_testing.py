"""Small Hugging Face models built from a config (no download) with weights set to fail in
float16 the way bfloat16-pretrained models do: the float16 audit's test cases, shared by its
tests and its benchmark (the test suite's toolbox: not in the wheel).

Each ``*_failure`` function edits a model's weights in place (``torch.no_grad``) and returns
the model; ``token_sum_loss`` is the loss they are audited with (a token-summed loss, as RL
fine-tuning uses: gradients about ``tokens`` times a mean loss's).
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB, WIDTH, LENGTH, BATCH = 64, 32, 16, 2


def llama(
    layers: int = 2,
    *,
    seed: int = 0,
    width: int = WIDTH,
    vocab: int = VOCAB,
    length: int = LENGTH,
    heads: int | None = None,
) -> Any:
    """A ``LlamaForCausalLM`` (eager attention: the explicit ``q @ k^T``, RMSNorm) with
    ``heads`` attention heads (None: one per 32 of ``width``, at least 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads or max(2, width // 32),
        num_key_value_heads=heads or max(2, width // 32),
        max_position_embeddings=length,
    )
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def _small_decoder(config: Any, model: Any, layers: int, seed: int, **extra: Any) -> Any:
    """A small ``model(config(...))`` of ``layers`` layers, eager attention (2 heads)."""
    torch.manual_seed(seed)
    cfg = config(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        **extra,
    )
    cfg._attn_implementation = "eager"
    return model(cfg)


def qwen3(layers: int = 2, *, seed: int = 0) -> Any:
    """A ``Qwen3ForCausalLM``: QK-norm (an RMSNorm over each head's q and k), eps 1e-12."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _small_decoder(
        Qwen3Config, Qwen3ForCausalLM, layers, seed, head_dim=WIDTH // 2, rms_norm_eps=1e-12
    )


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


def massive_activation_failure(
    model: Any, layer: int = 1, *, weight: float = 200.0, gain: float = 1.0
) -> Any:
    """A massive activation (Sun et al., 2024: a few channels of an MLP's down projection,
    thousands of times the median) at layer ``layer``: four gate/up channels share one weight
    row (the sign pattern of the first one, times ``gain``), and one output row of the down
    projection reads them with ``weight``, so that channel 7 of the down projection's output
    passes 65504 on some tokens (Llama at the defaults: about 1.8e5)."""
    mlp = model.model.layers[layer].mlp
    with torch.no_grad():
        row = mlp.gate_proj.weight[0].sign() * gain
        mlp.gate_proj.weight[:4] = row
        mlp.up_proj.weight[:4] = row
        mlp.down_proj.weight[7, :4] = weight
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


#: aten ops that read a device value to the host: ``item()``, ``bool()``, ``float()`` and
#: ``int()`` of a tensor dispatch ``_local_scalar_dense``; the others' output size depends on
#: the values (boolean-mask indexing is ``index`` or ``index_put`` with a bool index).
_READING_OPS = frozenset(
    ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim")
)
_READING_METHODS = frozenset(("tolist", "numpy", "cpu"))


def _boolean_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _ReadingOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, counter: collections.Counter[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _READING_OPS:
            self.counter[name] += 1
        elif name in ("index", "index_put", "index_put_") and _boolean_index(args):
            self.counter["boolean mask"] += 1
        return func(*args, **(kwargs or {}))


class _ReadingMethods(TorchFunctionMode):
    def __init__(self, counter: collections.Counter[str]) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _READING_METHODS:
            self.counter[name] += 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """Counts host reads inside it (a context manager; ``count`` is the total, ``by_kind``
    per kind): ``item()``, ``bool()``/``float()``/``int()`` of a tensor, ``tolist()``,
    ``.numpy()``, ``.cpu()``, and the ops whose output size depends on the values
    (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``). A torch function
    mode sees the methods (they dispatch no aten op), a dispatch mode the aten ops."""

    def __init__(self) -> None:
        self.by_kind: collections.Counter[str] = collections.Counter()
        self._modes: list[Any] = []

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def __enter__(self) -> HostReads:
        self._modes = [_ReadingMethods(self.by_kind), _ReadingOps(self.by_kind)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


class CudaSyncs:
    """Counts the host syncs CUDA makes inside it (a context manager; ``count`` is set on
    exit): the warnings of torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``:
    ``item()``, device-to-host copies, ``nonzero``...), the mode it found put back. Needs CUDA."""

    def __init__(self) -> None:
        self.count = 0
        self._caught: Any = None
        self._warnings: list[warnings.WarningMessage] = []
        self._mode = 0

    def __enter__(self) -> CudaSyncs:
        torch.cuda.synchronize()
        self._caught = warnings.catch_warnings(record=True)
        self._warnings = self._caught.__enter__()
        warnings.simplefilter("always")
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode(self._mode)
        self._caught.__exit__(*exc)
        self.count = sum("synchroniz" in str(w.message) for w in self._warnings)


def bert(layers: int = 2, *, seed: int = 0, width: int = 64) -> Any:
    """A ``BertForMaskedLM`` (eager attention, key biases: their exact gradient is zero)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=LENGTH,
    )
    cfg._attn_implementation = "eager"
    return BertForMaskedLM(cfg)


def gpt2(layers: int = 2, *, seed: int = 0, width: int = 64) -> Any:
    """A ``GPT2LMHeadModel`` (eager attention; ``c_attn``'s bias holds the key bias)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        n_positions=LENGTH,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


def t5(layers: int = 2, *, seed: int = 0, width: int = 64) -> Any:
    """A ``T5ForConditionalGeneration`` (its ``wo`` kept in float32 by transformers)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(  # type: ignore[call-arg]
        vocab_size=VOCAB,
        d_model=width,
        d_kv=width // 2,
        d_ff=2 * width,
        num_layers=layers,
        num_heads=2,
        decoder_start_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return T5ForConditionalGeneration(cfg)


def gpt2_massive_activation(model: Any, layer: int = 1) -> Any:
    """A massive activation in GPT-2's MLP at ``layer``: four ``c_fc`` channels read the
    sign pattern of one input direction, scaled up, and ``mlp.c_proj`` adds them with weight
    1000 into channel 7 of the residual stream, past 65504 on some tokens."""
    mlp = model.transformer.h[layer].mlp
    with torch.no_grad():
        column = mlp.c_fc.weight[:, 0].sign() * 1.5
        mlp.c_fc.weight[:, :4] = column[:, None]
        mlp.c_proj.weight[:4, 7] = 1000.0
    return model


def logits_sum_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each token's logits against the token itself, summed (a masked
    language model's or an encoder-decoder's loss, without masking: ``labels=ids`` gives T5
    its decoder inputs)."""
    ids = ids.to(next(model.parameters()).device)
    extra = {"labels": ids} if model.config.is_encoder_decoder else {}
    logits = model(input_ids=ids, **extra).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="sum")


def olmo2(layers: int = 2, *, seed: int = 0) -> Any:
    """An ``Olmo2ForCausalLM``: post-norm blocks (the MLP's output normalised by
    ``post_feedforward_layernorm`` before it reaches the residual stream)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return _small_decoder(Olmo2Config, Olmo2ForCausalLM, layers, seed)


def gemma2(layers: int = 2, *, seed: int = 0) -> Any:
    """A ``Gemma2ForCausalLM``: sandwich norms (the MLP's output normalised by
    ``post_feedforward_layernorm`` before it reaches the residual stream)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _small_decoder(
        Gemma2Config, Gemma2ForCausalLM, layers, seed, head_dim=WIDTH // 2, sliding_window=LENGTH
    )


def bert_massive_activation(
    model: Any, layer: int = 1, *, weight: float = 200.0, gain: float = 1.0
) -> Any:
    """A massive activation in BERT's feed-forward at ``layer``: four ``intermediate.dense``
    channels read the sign pattern of one input direction (times ``gain``) and
    ``output.dense`` adds them with ``weight`` into channel 7, past 65504 on some tokens,
    before ``output.LayerNorm`` normalises it (a post-norm block)."""
    block = model.bert.encoder.layer[layer]
    with torch.no_grad():
        row = block.intermediate.dense.weight[0].sign() * gain
        block.intermediate.dense.weight[:4] = row
        block.output.dense.weight[7, :4] = weight
    return model


class PostNorm(torch.nn.Module):
    """``LayerNorm(Linear(x))``: a linear layer whose output is normalised in the same module."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.linear(x))
        return out


def post_norm(width: int = 8, *, seed: int = 0) -> torch.nn.Sequential:
    """``Sequential(PostNorm(Linear -> LayerNorm), Linear)`` whose first linear layer's output
    reaches up to 3e4 x 100 = 3e6 on inputs of size 100 (:func:`post_norm_batches`): past
    float16's 65504, and back in range after the LayerNorm."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(PostNorm(width), torch.nn.Linear(width, 1))
    with torch.no_grad():
        block = model[0]
        assert isinstance(block, PostNorm)
        block.linear.weight.copy_(torch.randn(width, width).sign() * 3e4 / width)
    return model


def post_norm_batches(n: int, *, width: int = 8, seed: int = 1) -> list[torch.Tensor]:
    """``n`` batches for :func:`post_norm`: entries of magnitude 100, random signs."""
    g = torch.Generator().manual_seed(seed)
    return [100.0 * torch.randn(4, width, generator=g).sign() for _ in range(n)]


def squared_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The mean squared output, ``x`` cast to the dtype of the model's last parameter (a
    ``.half()`` model's float16, whatever a plan keeps in float32 in front of it)."""
    last = list(model.parameters())[-1]
    out: torch.Tensor = model(x.to(last.device, last.dtype))
    return out.float().pow(2).mean()
