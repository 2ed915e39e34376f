"""The float16 audit's plan on a vLLM model, as ``torch.autocast`` computes the model with the
plan applied: the plan's modules (or the fused module holding one) with float32 parameters
computing in float32, every other matmul in float16, the residual stream (from a float32
embedding lookup) and the norms (their weights too) in float32, the rotary embedding in float32;
attention and its KV cache in the model's float16. One layout per family (:data:`LAYOUTS`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

_log = logging.getLogger("lossscale.vllm")


class Layout(NamedTuple):
    """Where a vLLM decoder's norms and linears are, per layer.

    Attributes:
      feeding: ``(norm, consumer)`` pairs: each norm adds the sublayer's output to the
        residual stream (vLLM's fused add) and hands ``consumer`` its input.
      post: the norms applied to a sublayer's output before the residual adds it (Gemma's
        post-norms): they keep their input's dtype.
      scaled_embedding: the embedding's output is multiplied by the model's ``normalizer``
        (Gemma's ``sqrt(hidden)``) before the first layer.
    """

    feeding: tuple[tuple[str, str], ...]
    post: tuple[str, ...] = ()
    scaled_embedding: bool = False


#: The Llama family: ``input_layernorm -> self_attn.qkv_proj``,
#: ``post_attention_layernorm -> mlp.gate_up_proj``.
_PRE_NORM = Layout(
    (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"))
)
#: Gemma 2 and 3: a norm before and after each sublayer, the embedding scaled by sqrt(hidden).
_GEMMA = Layout(
    (("input_layernorm", "self_attn.qkv_proj"), ("pre_feedforward_layernorm", "mlp.gate_up_proj")),
    ("post_attention_layernorm", "post_feedforward_layernorm"),
    scaled_embedding=True,
)

#: The vLLM model classes whose decoder this module knows, and their layouts
#: (``model.layers[i]`` with ``self_attn.{qkv_proj, o_proj}``, ``mlp.{gate_up_proj, down_proj}``
#: and the layout's norms; ``model.norm``; ``lm_head``, or the tied ``model.embed_tokens``).
LAYOUTS: dict[str, Layout] = {
    "LlamaForCausalLM": _PRE_NORM,
    "Qwen2ForCausalLM": _PRE_NORM,
    "Qwen3ForCausalLM": _PRE_NORM,
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
}
ARCHITECTURES: tuple[str, ...] = tuple(LAYOUTS)

#: The model types whose float16 vLLM refuses (its ``_FLOAT16_NOT_SUPPORTED_MODELS``) and this
#: module computes with a float32 residual stream (Gemma2ForCausalLM, Gemma3ForCausalLM): a
#: planned engine lifts that refusal.
FLOAT16_LIFTED: tuple[str, ...] = ("gemma2", "gemma3_text")

#: The linear layers of one decoder layer, in the order a token goes through them.
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class Planned(NamedTuple):
    """What :func:`apply_plan` did to a model.

    Attributes:
      float32_modules: the vLLM modules whose parameters are float32 and compute in float32
        (fused modules under their vLLM names, e.g. ``model.layers.0.mlp.gate_up_proj``).
      held: ``plan name -> vLLM module`` for each plan module that vLLM holds in another:
        fused with others (the whole fused module is kept), or a head tied to the embedding
        (``lm_head -> model.embed_tokens``).
    """

    float32_modules: tuple[str, ...]
    held: dict[str, str]


def _packed(model: torch.nn.Module) -> dict[str, str]:
    """A fused member's last name -> its fused module's (``q_proj -> qkv_proj``)."""
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    return {member: fused for fused, members in mapping.items() for member in members}


def _head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module vLLM computes the logits with: ``lm_head``, or (Gemma, whose head is tied)
    ``model.embed_tokens``; None when the model has neither."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, torch.nn.Module):
        return head
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    return embedding if isinstance(embedding, torch.nn.Module) else None


def _tied(embedding: torch.nn.Module, head: torch.nn.Module) -> bool:
    """Whether the head is the embedding, or shares its weight (vLLM's ``tie_weights``)."""
    return head is embedding or getattr(head, "weight", None) is getattr(embedding, "weight", 0)


def resolve(model: torch.nn.Module, names: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM modules that keep the plan modules ``names`` in float32 (in order, once
    each), and ``plan name -> vLLM module`` for those vLLM holds in another module.

    A name vLLM has is its own module; a member vLLM fuses (``q_proj``, ``gate_proj``) is its
    fused module (``qkv_proj``, ``gate_up_proj``); ``lm_head``, where vLLM ties it to the
    embedding (Gemma), is ``model.embed_tokens``.

    Raises:
      ValueError: ``model`` has no module of that name, fused or not (naming it).

    Example:
      >>> import torch
      >>> from lossscale.vllm import resolve
      >>> layer = torch.nn.Module()
      >>> layer.qkv_proj = torch.nn.Linear(4, 12)
      >>> model = torch.nn.ModuleDict({"attn": layer})
      >>> model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
      >>> resolve(model, ["attn.k_proj"])
      (['attn.qkv_proj'], {'attn.k_proj': 'attn.qkv_proj'})
    """
    modules = dict(model.named_modules())
    names_of = {id(module): name for name, module in modules.items()}
    packed = _packed(model)
    found: list[str] = []
    held: dict[str, str] = {}
    for name in names:
        target = name
        if target not in modules:
            parent, _, last = name.rpartition(".")
            head = _head(model) if name == "lm_head" else None
            if last in packed:
                target = f"{parent}.{packed[last]}" if parent else packed[last]
            elif head is not None and id(head) in names_of:
                target = names_of[id(head)]
            held[name] = target
        if target not in modules:
            raise ValueError(
                f"the plan keeps {name!r} in float32, and this vLLM model "
                f"({type(model).__name__}) has no such module"
            )
        if target not in found:
            found.append(target)
    return found, held


def check_architecture(name: str) -> Layout:
    """The layout of the vLLM model class ``name``.

    Raises:
      ValueError: naming ``name`` when it is not one of :data:`ARCHITECTURES`.
    """
    if name not in LAYOUTS:
        raise ValueError(
            f"lossscale.vllm keeps the plan in {', '.join(ARCHITECTURES)}; this model is "
            f"{name}, whose layout it does not know (it would compute it wrong): run it "
            "without LOSSSCALE_PLAN"
        )
    return LAYOUTS[name]


def _layers(model: torch.nn.Module, layout: Layout) -> list[torch.nn.Module]:
    """The decoder layers, each checked to hold the layout's norms and linears."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "norm", None) is None or _head(model) is None:
        raise ValueError(
            f"lossscale.vllm does not know the layout of {type(model).__name__} "
            f"(it knows {', '.join(ARCHITECTURES)})"
        )
    wanted = [name for pair in layout.feeding for name in pair] + list(layout.post)
    for layer in layers:
        for name in (*wanted, *_LINEARS):
            try:
                layer.get_submodule(name)
            except AttributeError:
                raise ValueError(
                    f"lossscale.vllm does not know the layout of {type(model).__name__}: "
                    f"its decoder layers lack {name}"
                ) from None
    return list(layers)


def _to_float32(module: torch.nn.Module) -> None:
    for parameter in module.parameters(recurse=True):
        if parameter.is_floating_point() and parameter.dtype != torch.float32:
            parameter.data = parameter.data.to(torch.float32)


def _cast_input(dtype: torch.dtype) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        return (x.to(dtype), *args[1:]) if x.dtype != dtype else args

    return hook


def _cast_output(dtype: torch.dtype) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0].to(dtype), *output[1:])
        return output.to(dtype)

    return hook


def _weight_dtype(module: torch.nn.Module) -> torch.dtype:
    weight = getattr(module, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else torch.get_default_dtype()


def _float32_norm(norm: torch.nn.Module, out_dtype: torch.dtype | None, offset: float) -> None:
    """``norm`` (vLLM's ``RMSNorm``, or ``GemmaRMSNorm`` with ``offset`` 1: ``x * (1 + w)``)
    computes in float32 over a float32 weight: with a residual, ``residual = x + residual`` in
    float32, returned float32; its output in ``out_dtype`` (None: ``x``'s dtype)."""
    _to_float32(norm)
    eps = float(norm.variance_epsilon)  # type: ignore[arg-type]

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        dtype = out_dtype or x.dtype
        stream = x.to(torch.float32)
        if residual is not None:
            stream = stream + residual.to(torch.float32)
        normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + eps)
        if getattr(norm, "has_weight", True):
            weight: torch.Tensor = norm.weight  # type: ignore[assignment]
            normed = normed * (weight + offset if offset else weight)
        out = normed.to(dtype)
        return out if residual is None else (out, stream)

    norm.forward = forward


class _Float32Rope(torch.nn.Module):
    """vLLM's rotary embedding ``rope`` computed as transformers computes it under autocast:
    float16 ``q`` and ``k`` rotated in float32 by a float32 cos/sin table, rounded to float16
    once, for attention. A module of its own, because vLLM shares one rotary embedding among
    the engines of a process (its ``get_rope`` cache)."""

    def __init__(self, rope: torch.nn.Module) -> None:
        super().__init__()
        self.rope = rope
        cache: torch.Tensor = rope._compute_cos_sin_cache()  # type: ignore[operator]
        table: torch.Tensor = rope.cos_sin_cache  # type: ignore[assignment]
        self.register_buffer(
            "cos_sin_cache", cache.to(table.device, torch.float32), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rope: Any = self.rope
        q, k = rope.forward_static(
            positions,
            query.to(torch.float32),
            None if key is None else key.to(torch.float32),
            rope.head_size,
            rope.rotary_dim,
            self.cos_sin_cache,
            rope.is_neox_style,
        )
        return q.to(query.dtype), None if k is None or key is None else k.to(key.dtype)


def _float32_ropes(layers: list[torch.nn.Module]) -> None:
    """Each layer's ``self_attn.rotary_emb`` computed by :class:`_Float32Rope`, where it is
    vLLM's plain ``RotaryEmbedding`` or a subclass that changes only its cos/sin table (Llama 3's
    scaling, linear scaling); other kinds (multimodal, dual-chunk) are left in float16."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    for layer in layers:
        attention = layer.get_submodule("self_attn")
        rope = getattr(attention, "rotary_emb", None)
        if (
            isinstance(rope, RotaryEmbedding)
            and type(rope).forward_native is RotaryEmbedding.forward_native
            and type(rope).forward_static is RotaryEmbedding.forward_static
            and getattr(rope, "cos_sin_cache", None) is not None
        ):
            attention.rotary_emb = _Float32Rope(rope)


def _norm_offsets() -> dict[type, float]:
    """vLLM's norm classes this module computes in float32, and the offset of their weight."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    return {RMSNorm: 0.0, GemmaRMSNorm: 1.0}


def apply_plan(
    model: torch.nn.Module, float32_modules: Iterable[str], dtype: torch.dtype = torch.float16
) -> Planned:
    """Put the plan on a vLLM model built in ``dtype`` (float16), before its weights load.

    The modules named (resolved by :func:`resolve`) get float32 parameters, so that the
    checkpoint loads into them unrounded, take float32 inputs and give float32 outputs
    (a fused ``qkv_proj``'s output goes to attention in float16). The residual stream is
    float32 from the embedding on: an embedding that is not also the head gets float32
    weights (autocast looks up float32 weights; this costs its size once more in memory); a
    tied one (Gemma's, Llama 3.2's) stays float16 as the head, its output cast to float32
    (and, for Gemma, times ``sqrt(hidden)`` in float32). Every norm gets a float32 weight and
    computes in float32; each norm that adds a sublayer to the stream hands its consumer
    (``qkv_proj``, ``gate_up_proj``, the head) its own dtype; other norms (Gemma's post-norms,
    Qwen3's and Gemma 3's q/k norms) keep their input's dtype unless the plan keeps them.
    The rotary embedding rotates float16 ``q`` and ``k`` in float32 by a float32 table and
    rounds them once. vLLM's record of each layer for ``reload_weights`` is taken again, so
    that a reload keeps these dtypes. Host syncs: none.

    Raises:
      ValueError: the model is not one of :data:`ARCHITECTURES`, is not laid out as its
        layout says, or lacks a plan module (naming it); the model is left as it was.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    layout = check_architecture(type(model).__name__)
    layers = _layers(model, layout)
    names, held = resolve(model, float32_modules)
    modules = dict(model.named_modules())
    offsets = _norm_offsets()
    norm_types: tuple[type, ...] = tuple(offsets)
    for name, module in modules.items():
        if isinstance(module, norm_types) and (
            type(module) not in offsets or getattr(module, "variance_size_override", None)
        ):
            raise ValueError(
                f"lossscale.vllm computes vLLM's RMSNorm and GemmaRMSNorm in float32; {name} "
                f"is a {type(module).__name__} it does not know"
            )
    kept: set[str] = set()
    for name in names:
        prefix = f"{name}."
        for sub, module in modules.items():
            if (sub == name or sub.startswith(prefix)) and any(
                True for _ in module.parameters(recurse=False)
            ):
                kept.add(sub)
    # the kept modules: float32 parameters, float32 in and out
    for name in sorted(kept):
        module = modules[name]
        if isinstance(module, norm_types):
            continue  # every norm is float32 below
        _to_float32(module)
        if isinstance(module, LinearBase):
            module.register_forward_pre_hook(_cast_input(torch.float32))
            if name.endswith("self_attn.qkv_proj"):  # attention computes in ``dtype``
                module.register_forward_hook(_cast_output(dtype))
    names_of = {id(module): name for name, module in modules.items()}
    for layer in layers:
        layer_name = names_of[id(layer)]
        if f"{layer_name}.mlp.gate_up_proj" in kept and f"{layer_name}.mlp.down_proj" not in kept:
            down = layer.get_submodule("mlp.down_proj")
            down.register_forward_pre_hook(_cast_input(_weight_dtype(down)))
    head = _head(model)
    assert head is not None  # _layers checked
    _float32_ropes(layers)
    # the stream starts float32: an embedding that is not the head looks up float32 weights
    # (autocast's lookup); a tied one (Gemma's) stays the float16 head, its lookup cast
    inner: Any = model.get_submodule("model")
    if not _tied(inner.embed_tokens, head):
        _to_float32(inner.embed_tokens)
    if layout.scaled_embedding:  # times sqrt(hidden), in float32
        inner.normalizer = inner.normalizer.to(torch.float32)
        inner.embed_tokens.register_forward_hook(_cast_output(torch.float32))
    # the norms: float32; the feeding norms hand their consumer its dtype
    consumers: dict[int, torch.nn.Module] = {}
    for layer in layers:
        for norm_name, consumer_name in layout.feeding:
            consumers[id(layer.get_submodule(norm_name))] = layer.get_submodule(consumer_name)
    consumers[id(model.get_submodule("model.norm"))] = head
    for name, module in modules.items():
        offset = offsets.get(type(module))
        if offset is None:
            continue
        consumer = consumers.get(id(module))
        if name in kept:
            out_dtype: torch.dtype | None = torch.float32
        else:
            out_dtype = None if consumer is None else _weight_dtype(consumer)
        _float32_norm(module, out_dtype, offset)
    record_metadata_for_reloading(model)
    for name, target in held.items():
        _log.warning(
            "lossscale.vllm: the plan keeps %s in float32; vLLM %s %s, kept whole",
            name,
            "fuses it into" if name != "lm_head" else "computes it with the tied",
            target,
        )
    return Planned(tuple(sorted(kept)), held)
