"""The float16 audit's plan on a vLLM model, as ``torch.autocast`` computes the model with the
plan applied: the plan's modules (or the fused module holding one) with float32 parameters
computing in float32, every other matmul in float16, the residual stream and the norms (their
weights too) in float32; attention and its KV cache in the model's float16."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

_log = logging.getLogger("lossscale.vllm")

#: The vLLM model classes whose decoder this module knows (the Llama family's layout:
#: ``model.layers[i].{input_layernorm, self_attn.{qkv_proj, o_proj}, post_attention_layernorm,
#: mlp.{gate_up_proj, down_proj}}``, ``model.norm``, ``lm_head``).
#: Qwen2 (biases in qkv_proj) is left out: planned, its test model stayed finite but 2.4x
#: farther from the trainer's forward than vLLM in float32, not understood yet.
ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen3ForCausalLM")

#: The linear layers of one decoder layer, in the order a token goes through them.
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class Planned(NamedTuple):
    """What :func:`apply_plan` did to a model.

    Attributes:
      float32_modules: the vLLM modules whose parameters are float32 and compute in float32
        (fused modules under their vLLM names, e.g. ``model.layers.0.mlp.gate_up_proj``).
      fused: ``plan name -> vLLM module`` for each plan module that vLLM fuses with others
        (the whole fused module is kept).
    """

    float32_modules: tuple[str, ...]
    fused: dict[str, str]


def _packed(model: torch.nn.Module) -> dict[str, str]:
    """A fused member's last name -> its fused module's (``q_proj -> qkv_proj``)."""
    mapping = getattr(model, "packed_modules_mapping", {}) or {}
    return {member: fused for fused, members in mapping.items() for member in members}


def resolve(model: torch.nn.Module, names: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """The vLLM modules that keep the plan modules ``names`` in float32 (in order, once
    each), and ``plan name -> fused module`` for those vLLM fuses.

    A name vLLM has is its own module; a member vLLM fuses (``q_proj``, ``gate_proj``) is its
    fused module (``qkv_proj``, ``gate_up_proj``).

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
    packed = _packed(model)
    found: list[str] = []
    fused: dict[str, str] = {}
    for name in names:
        target = name
        if target not in modules:
            parent, _, last = name.rpartition(".")
            if last in packed:
                target = f"{parent}.{packed[last]}" if parent else packed[last]
                fused[name] = target
        if target not in modules:
            raise ValueError(
                f"the plan keeps {name!r} in float32, and this vLLM model "
                f"({type(model).__name__}) has no such module"
            )
        if target not in found:
            found.append(target)
    return found, fused


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "norm", None) is None or not hasattr(model, "lm_head"):
        raise ValueError(
            f"lossscale.vllm does not know the layout of {type(model).__name__} "
            f"(it knows {', '.join(ARCHITECTURES)})"
        )
    return list(layers)


def check_architecture(name: str) -> None:
    """``ValueError`` naming ``name`` when it is not one of :data:`ARCHITECTURES`."""
    if name not in ARCHITECTURES:
        raise ValueError(
            f"lossscale.vllm keeps the plan in {', '.join(ARCHITECTURES)}; this model is "
            f"{name}, whose layout it does not know (it would compute it wrong): run it "
            "without LOSSSCALE_PLAN"
        )


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


def _float32_norm(norm: torch.nn.Module, out_dtype: torch.dtype | None) -> None:
    """``norm`` (vLLM's ``RMSNorm``) computes in float32 over a float32 weight: with a
    residual, ``residual = x + residual`` in float32, returned float32; its output in
    ``out_dtype`` (None: ``x``'s dtype)."""
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
            normed = normed * weight
        out = normed.to(dtype)
        return out if residual is None else (out, stream)

    norm.forward = forward


def apply_plan(
    model: torch.nn.Module, float32_modules: Iterable[str], dtype: torch.dtype = torch.float16
) -> Planned:
    """Put the plan on a vLLM model built in ``dtype`` (float16), before its weights load.

    The modules named (resolved by :func:`resolve`) get float32 parameters, so that the
    checkpoint loads into them unrounded, take float32 inputs and give float32 outputs
    (a fused ``qkv_proj``'s output goes to attention in float16); every ``RMSNorm`` gets a
    float32 weight and computes in float32; the residual stream (what the layers' norms add)
    is float32, and each of those norms hands its consumer (``qkv_proj``, ``gate_up_proj``,
    ``lm_head``) its own dtype. vLLM's record of each layer for ``reload_weights`` is taken
    again, so that a reload keeps these dtypes. Host syncs: none.

    Raises:
      ValueError: the model is not laid out as :data:`ARCHITECTURES`, or lacks a plan
        module (naming it); the model is left as it was.
    """
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    layers = _layers(model)
    for layer in layers:
        for name in ("input_layernorm", "post_attention_layernorm", *_LINEARS):
            try:
                layer.get_submodule(name)
            except AttributeError:
                raise ValueError(
                    f"lossscale.vllm does not know the layout of {type(model).__name__}: "
                    f"its decoder layers lack {name}"
                ) from None
    names, fused = resolve(model, float32_modules)
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, RMSNorm) and (
            type(module) is not RMSNorm or module.variance_size_override is not None
        ):
            raise ValueError(
                f"lossscale.vllm computes vLLM's plain RMSNorm in float32; {name} is a "
                f"{type(module).__name__} it does not know"
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
        if isinstance(module, RMSNorm):
            continue  # every norm is float32 below
        _to_float32(module)
        if isinstance(module, LinearBase):
            module.register_forward_pre_hook(_cast_input(torch.float32))
            if name.endswith("self_attn.qkv_proj"):  # attention computes in ``dtype``
                module.register_forward_hook(_cast_output(dtype))
    names_of = {id(layer): name for name, layer in modules.items()}
    for layer in layers:
        layer_name = names_of[id(layer)]
        if f"{layer_name}.mlp.gate_up_proj" in kept and f"{layer_name}.mlp.down_proj" not in kept:
            down = layer.get_submodule("mlp.down_proj")
            down.register_forward_pre_hook(_cast_input(_weight_dtype(down)))
    # the norms: float32, the stream's handing their consumer its dtype
    consumers: dict[int, torch.nn.Module] = {}
    for layer in layers:
        consumers[id(layer.input_layernorm)] = layer.get_submodule("self_attn.qkv_proj")
        consumers[id(layer.post_attention_layernorm)] = layer.get_submodule("mlp.gate_up_proj")
    consumers[id(model.get_submodule("model.norm"))] = model.get_submodule("lm_head")
    for module in modules.values():
        if isinstance(module, RMSNorm):
            consumer = consumers.get(id(module))
            _float32_norm(module, None if consumer is None else _weight_dtype(consumer))
    record_metadata_for_reloading(model)
    for name, target in fused.items():
        _log.warning(
            "lossscale.vllm: the plan keeps %s in float32; vLLM fuses it into %s, kept whole",
            name,
            target,
        )
    return Planned(tuple(sorted(kept)), fused)
