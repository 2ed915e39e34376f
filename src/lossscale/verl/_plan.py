"""The float16 audit's plan in verl's FSDP engines (``LOSSSCALE_PLAN``): the plan's modules
keep float32 parameters and compute under verl's float16 ``MixedPrecision``, sharded as units
of their own (:meth:`lossscale.torch.Float16Plan.fsdp1_policy` under FSDP1,
:meth:`~lossscale.torch.Float16Plan.fully_shard` under FSDP2)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from lossscale.torch import Float16Plan, load_plan
from lossscale.verl._settings import PLAN_VARIABLE


@functools.lru_cache(maxsize=4)
def _read(path: str) -> Float16Plan:
    return load_plan(path)


def load(path: str) -> Float16Plan:
    """The plan in ``path`` (read once per process); ``ValueError`` naming
    ``LOSSSCALE_PLAN`` when it is not one (a missing file included)."""
    try:
        return _read(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{PLAN_VARIABLE}={path!r}: {error}") from None


def param_dtype(engine: Any) -> torch.dtype:
    """The ``param_dtype`` verl's ``_build_fsdp_module`` gives FSDP (bfloat16 by default)."""
    from verl.utils.torch_dtypes import PrecisionType

    config = engine.engine_config.mixed_precision
    name = "bf16" if config is None else config.get("param_dtype", "bf16")
    return PrecisionType.to_dtype(name)  # type: ignore[no-any-return]


def for_engine(engine: Any, path: str | None) -> Float16Plan | None:
    """The plan an engine's model gets: the file's when one is named, the engine runs in
    float16 and it is a language model (the actor, and the reference policy, which verl
    builds from the same model); None for a value model (the critic: another model), for
    bfloat16 and float32 engines, and without a file."""
    from verl.workers.engine.fsdp.transformer_impl import (
        FSDPEngineWithLMHead,
        FSDPEngineWithValueHead,
    )

    if path is None or param_dtype(engine) != torch.float16:
        return None
    if not isinstance(engine, FSDPEngineWithLMHead) or isinstance(engine, FSDPEngineWithValueHead):
        return None
    return load(path)


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def sharded(engine: Any, model: torch.nn.Module, plan: Float16Plan | None) -> Iterator[None]:
    """While verl's ``_build_fsdp_module`` wraps ``model``: the plan applied to it
    (``plan.apply(model, output_dtype=torch.float16)``: the kept modules' inputs cast up,
    their outputs back to float16) and its modules sharded as float32 units: under FSDP1,
    verl's ``get_fsdp_wrap_policy`` answers ``plan.fsdp1_policy(model, <verl's policy>)``;
    under FSDP2, ``plan.fully_shard(model, mesh=..., ...)`` runs just before verl's
    ``apply_fsdp2`` shards the layers and the root. The plan's handle is kept on the engine
    (``engine.lossscale_plan``). Nothing happens without a plan.

    Raises:
      ValueError: the model lacks one of the plan's modules (the model is left as it was).
    """
    if plan is None:
        yield
        return
    from verl.workers.engine.fsdp import transformer_impl

    handle = plan.apply(model, output_dtype=torch.float16)
    verl_policy = transformer_impl.get_fsdp_wrap_policy
    verl_apply_fsdp2 = transformer_impl.apply_fsdp2

    def get_fsdp_wrap_policy(*args: Any, **kwargs: Any) -> Any:
        return plan.fsdp1_policy(model, verl_policy(*args, **kwargs))

    def apply_fsdp2(root: torch.nn.Module, fsdp_kwargs: dict[str, Any], config: Any) -> Any:
        own = {k: v for k, v in fsdp_kwargs.items() if k != "mp_policy" and v is not None}
        plan.fully_shard(root, output_dtype=fsdp_kwargs["mp_policy"].param_dtype, **own)
        return verl_apply_fsdp2(root, fsdp_kwargs, config)

    try:
        with (
            _swapped(transformer_impl, "get_fsdp_wrap_policy", get_fsdp_wrap_policy),
            _swapped(transformer_impl, "apply_fsdp2", apply_fsdp2),
        ):
            yield
    except BaseException:
        handle.remove()
        raise
    engine.lossscale_plan = handle
