"""The float16 audit's plan on its own, and what makes it hold: put on a model
(:meth:`Float16Plan.apply`), also one that FSDP shards (:meth:`Float16Plan.fully_shard`,
:meth:`Float16Plan.fsdp1_policy`); saved and loaded as a file (:mod:`.file`) in any process."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from lossscale._version import __version__
from lossscale.torch._audit import file
from lossscale.torch._audit.finding import Finding
from lossscale.torch._audit.handle import PlanHandle, find_modules, keep_float32

__all__ = ["Float16Plan", "load_plan", "plan_of"]


class Float16Plan(NamedTuple):
    """The float16 audit's plan and what it measured, without the model or the batches: what
    :meth:`lossscale.torch.Float16Audit.save` writes and :func:`load_plan` returns.

    Attributes:
      mode: ``"autocast"`` or ``"half"``, as audited.
      float32_modules: the names (as in ``model.named_modules()`` of the audited model) of
        the modules to run in float32.
      scale_range: ``(low, high)`` or None (see :class:`~lossscale.torch.Float16Audit`).
      initial_scale: where a dynamic loss scale should start, or None.
      underflow: the underflow threshold the range was found with.
      reason: why there is no range (``""`` when there is one).
      verified: the audit's verification (None when it did not verify).
      modules: how many modules the audited model has.
      findings: the audit's :class:`~lossscale.torch.Finding` s.
      versions: ``{"lossscale": ..., "torch": ...}`` of the process that audited.

    Example:
      >>> import torch
      >>> from lossscale.torch import audit, load_plan
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
      >>> with torch.no_grad():
      ...     _ = model[0].weight.fill_(300.0)
      >>> result = audit(model, lambda m, x: m(x).float().sum(), [torch.full((2, 4), 100.0)])
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
      >>> result.save(path)
      >>> plan = load_plan(path)
      >>> plan.float32_modules, plan.initial_scale == result.initial_scale
      (('0',), True)
      >>> with plan.apply(model), torch.autocast("cpu", dtype=torch.float16):
      ...     model[0](torch.full((2, 4), 100.0)).dtype
      torch.float32
    """

    mode: str
    float32_modules: tuple[str, ...]
    scale_range: tuple[float, float] | None
    initial_scale: float | None
    underflow: float
    reason: str
    verified: bool | None
    modules: int
    findings: tuple[Finding, ...]
    versions: dict[str, str]

    def apply(
        self, model: torch.nn.Module, *, output_dtype: torch.dtype | None = None
    ) -> PlanHandle:
        """Put the plan on ``model``: each module of :attr:`float32_modules` runs in float32
        until the handle's ``remove()`` (see :class:`~lossscale.torch.PlanHandle`); the same
        handle as :meth:`lossscale.torch.Float16Audit.apply`.

        Call it on the model as the audit saw it, before ``accelerator.prepare``, DDP,
        ``torch.compile`` or FSDP wrap it (the names are the unwrapped model's); it keeps
        working through those wrappers, gradient checkpointing's recomputed forward, and
        ``save_pretrained`` (parameter names and ``state_dict`` keys are unchanged). A model
        wrapped in ``DistributedDataParallel``, ``DataParallel``, ``torch.compile`` or PEFT
        (``PeftModel``, ``LoraModel``) is unwrapped to find the names, and PEFT's own parts
        of a name are seen through both ways: a plan audited on the base model applies to
        the PEFT model around it (a kept ``Linear`` that LoRA adapts keeps its adapter
        layer, the adapters included), and one audited on the PEFT model applies to the base
        model.

        The model must be of the plan's mode: float32 parameters for an ``"autocast"`` plan,
        float16 ones (after ``model.half()``) for a ``"half"`` plan, counted over the
        parameters' elements (float32 LoRA adapters on a float16 base are a float16 model).
        With ``output_dtype`` the parameters' dtype is FSDP's to set and is not checked.

        Args:
          model: the model.
          output_dtype: where something other than autocast runs the model in a half dtype
            (FSDP's mixed precision: ``torch.float16``), the dtype the kept modules' floating
            outputs are cast back to; their parameters are left as they are (FSDP holds
            them, see :meth:`fully_shard` and :meth:`fsdp1_policy`). None: as audited.

        Returns:
          the live :class:`~lossscale.torch.PlanHandle`.

        Raises:
          TypeError: ``model`` is not a ``torch.nn.Module``; ``output_dtype`` is not a
            floating ``torch.dtype``.
          ValueError: the model has no module of one of the names (naming the closest one
            it has), another live plan keeps one, or the model's parameters are not of the
            plan's mode (naming the mode and the dtype); the model is left untouched.

        Costs: per kept module and call, casts of its floating inputs (and outputs, in
        ``"half"`` mode or with ``output_dtype``); no host sync.
        """
        return keep_float32(model, self.float32_modules, self.mode, output_dtype=output_dtype)

    def fully_shard(
        self, model: torch.nn.Module, *, output_dtype: torch.dtype = torch.float16, **kwargs: Any
    ) -> None:
        """FSDP2: shard each kept module as a unit of its own whose parameters are gathered
        and computed in float32 and whose gradients are reduced in float32
        (``MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
        output_dtype=output_dtype)``), so that a ``fully_shard`` of the layers and the root
        with ``param_dtype=torch.float16`` does not cast them. Call it after
        :meth:`apply` (with ``output_dtype``) and before sharding the rest::

            handle = plan.apply(model, output_dtype=torch.float16)
            plan.fully_shard(model, mesh=mesh)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=fp16_policy)
            fully_shard(model, mesh=mesh, mp_policy=fp16_policy)

        Args:
          model: the model, not yet sharded, with the plan's names.
          output_dtype: the dtype the kept modules hand their outputs back in (the policy's
            ``output_dtype``): the rest of the model's ``param_dtype``.
          **kwargs: passed to each ``torch.distributed.fsdp.fully_shard`` call (``mesh``,
            ``reshard_after_forward``, ``offload_policy``); not ``mp_policy``.

        Raises:
          TypeError: ``model`` is not a ``torch.nn.Module``, or ``mp_policy`` is given.
          ValueError: the model has no module of one of the names (nothing is sharded).

        Costs: none per step beyond FSDP's own (a float32 all-gather of the kept modules'
        parameters instead of a float16 one).
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as shard

        if "mp_policy" in kwargs:
            raise TypeError("fully_shard() sets mp_policy itself (float32); do not pass one")
        policy = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=output_dtype
        )
        for module in self.modules_in(model).values():
            shard(module, mp_policy=policy, **kwargs)

    def fsdp1_policy(self, model: torch.nn.Module, auto_wrap_policy: Any = None) -> Any:
        """FSDP1: an ``auto_wrap_policy`` that wraps each kept module as a unit of its own
        with float32 parameters, computation and gradient reduction
        (``MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32,
        buffer_dtype=torch.float32)``) and leaves every other module to ``auto_wrap_policy``,
        so that the root's ``mixed_precision=MixedPrecision(param_dtype=torch.float16)`` does
        not cast them::

            handle = plan.apply(model, output_dtype=torch.float16)
            policy = plan.fsdp1_policy(model, transformer_auto_wrap_policy_partial)
            model = FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                             mixed_precision=fp16_mixed_precision)

        Args:
          model: the model, not yet wrapped, with the plan's names.
          auto_wrap_policy: what wraps the other modules: None (nothing: they stay in the
            root unit), an FSDP1 callable policy ``(module, recurse, nonwrapped_numel)``
            (``functools.partial(transformer_auto_wrap_policy, ...)``), or a
            ``ModuleWrapPolicy``.

        Returns:
          a ``torch.distributed.fsdp.wrap.CustomPolicy``.

        Raises:
          TypeError: ``model`` is not a ``torch.nn.Module``; ``auto_wrap_policy`` is none
            of those.
          ValueError: the model has no module of one of the names.

        Costs: none per step beyond FSDP's own.
        """
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

        kept = {id(m) for m in self.modules_in(model).values()}
        float32 = MixedPrecision(
            param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32
        )
        if auto_wrap_policy is None:

            def other(module: torch.nn.Module) -> bool:
                return False
        elif isinstance(auto_wrap_policy, ModuleWrapPolicy):
            classes = tuple(auto_wrap_policy._module_classes)

            def other(module: torch.nn.Module) -> bool:
                return isinstance(module, classes)
        elif callable(auto_wrap_policy):

            def other(module: torch.nn.Module) -> bool:
                numel = sum(p.numel() for p in module.parameters())
                return bool(auto_wrap_policy(module=module, recurse=False, nonwrapped_numel=numel))
        else:
            raise TypeError(
                "auto_wrap_policy must be None, an FSDP1 callable policy or a ModuleWrapPolicy, "
                f"got {type(auto_wrap_policy).__name__}"
            )

        def decide(module: torch.nn.Module) -> bool | dict[str, Any]:
            if id(module) in kept:
                return {"mixed_precision": float32}
            return other(module)

        return CustomPolicy(decide)

    def modules_in(self, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The modules of ``model`` that the plan keeps, by the plan's names, found as
        :meth:`apply` finds them (through DDP, ``torch.compile`` and PEFT); host work only.

        Raises:
          TypeError: ``model`` is not a ``torch.nn.Module``.
          ValueError: the model has no module of one of the names (naming the closest one it
            has).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        names = self.float32_modules
        return dict(zip(names, find_modules(model, names), strict=True))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan to ``path`` as JSON (format version :data:`VERSION`; see the module
        docstring), replacing a file there.

        Raises:
          TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        """
        file.write(self._asdict(), path)


def plan_of(result: Any) -> Float16Plan:
    """The :class:`Float16Plan` of a :class:`~lossscale.torch.Float16Audit` ``result``."""
    return Float16Plan(
        mode=result.mode,
        float32_modules=tuple(result.float32_modules),
        scale_range=result.scale_range,
        initial_scale=result.initial_scale,
        underflow=result.underflow,
        reason=result.reason,
        verified=result.verified,
        modules=result.modules,
        findings=tuple(result.findings),
        versions={"lossscale": __version__, "torch": torch.__version__},
    )


def load_plan(path: str | os.PathLike[str]) -> Float16Plan:
    """Read a plan written by :meth:`lossscale.torch.Float16Audit.save` (in this or another
    process, on this or another machine). Audit once; apply in every worker::

        plan = lossscale.torch.load_plan("plan.json")
        handle = plan.apply(model)
        scaler = lossscale.torch.GradScaler(init_scale=plan.initial_scale)

    Returns:
      the :class:`Float16Plan`, its findings as :class:`~lossscale.torch.Finding` s.

    Raises:
      TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
      FileNotFoundError: there is no file at ``path``.
      ValueError: the file is not a plan (not JSON, another ``"format"``, a missing or
        ill-typed entry), or of a newer format version than this lossscale reads (the message
        names both versions).

    Example:
      >>> import json, os, tempfile
      >>> from lossscale.torch import load_plan
      >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
      >>> with open(path, "w") as f:
      ...     json.dump({"format": "lossscale.float16-plan", "version": 2}, f)
      >>> load_plan(path)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: '...plan.json' is a float16 plan of format version 2; ...: upgrade lossscale
    """
    return Float16Plan(**file.read(path))
