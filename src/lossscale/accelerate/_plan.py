"""The float16 audit's plan on a Trainer's own code paths: ``install(trainer, plan=...)``.

A plan (:class:`lossscale.torch.Float16Plan`) keeps modules in float32 through forward hooks, so
it holds wherever the model runs those modules' forwards. TRL's trainers also run the model on
paths that do not: ``trl.trainer.utils.add_fused_lm_head`` (TRL 1.16; the SFT, DPO, GRPO, RLOO
and KTO trainers patch their models with it) replaces the model's ``forward`` with one that, for
``fused_lm_head=True``, runs the backbone and then computes the log-probabilities from
``lm_head.weight`` itself, in the autocast dtype, without calling ``lm_head``. TRL's own option
``cast_lm_head_to_fp32`` (a ``GRPOConfig`` field, an argument of ``add_fused_lm_head``) makes
that projection float32 (outside autocast, float32 hidden states and weight); here it is turned
on for each fused head that a plan keeps, in the patched forward of that model only.

What cannot be foreseen is checked: during the first training step, each kept module's
forward calls are counted, and a module the model bypassed is refused (its parameters got
gradients: the trainer computed with them outside its forward) or warned about
(:class:`PlanBypassWarning`: it may also have been unneeded this step).

Imports torch only (the Trainer's callback that runs the check is
:class:`lossscale.accelerate.hf.PlanCheckCallback`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import FunctionType
from typing import Any

import torch

from lossscale.torch import Float16Audit, Float16Plan, PlanHandle, kept_by, load_plan

__all__ = [
    "FirstStepCheck",
    "PlanBypassWarning",
    "TrainerPlan",
    "as_plan",
    "fused_forward",
    "place",
]

#: The columns TRL's DPOTrainer (1.16) adds to the data with ``precompute_ref_log_probs=True``.
_PRECOMPUTED = ("ref_chosen_logps", "ref_rejected_logps")
#: The name of the forward ``add_fused_lm_head`` (TRL 1.16) patches in, and of its option.
_FUSED_FORWARD = "_fused_forward"
_FUSED_OPTION = "cast_lm_head_to_fp32"


class PlanBypassWarning(UserWarning):
    """A module that the float16 plan keeps in float32 did not run its forward in the first
    training step, though its model ran: the trainer either did not need it in that step (an
    MoE expert no token was routed to) or computed with its weights on a path that bypasses
    its forward (a fused kernel), where it ran in float16. Warned by the check that
    :func:`lossscale.accelerate.install` adds with ``plan=``; the message names the module.

    Example (an error instead, which stops training before the first optimizer step):

      >>> import warnings
      >>> from lossscale.accelerate import PlanBypassWarning
      >>> issubclass(PlanBypassWarning, UserWarning)
      True
      >>> warnings.filterwarnings("error", category=PlanBypassWarning)
      >>> warnings.resetwarnings()
    """


def as_plan(plan: Any) -> Float16Plan:
    """The :class:`Float16Plan` of ``install``'s ``plan`` argument: a path (``str`` or
    ``os.PathLike``, read with :func:`lossscale.torch.load_plan`), a ``Float16Plan``, or a
    :class:`lossscale.torch.Float16Audit` (its ``plan``).

    Raises:
      TypeError: ``plan`` is none of those (naming its type).
      FileNotFoundError, ValueError: from ``load_plan`` (no file there; not a plan).
    """
    if isinstance(plan, Float16Plan):
        return plan
    if isinstance(plan, Float16Audit):
        return plan.plan
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    kind = type(plan)
    raise TypeError(
        "install(target, plan=...): plan must be a path, a lossscale.torch.Float16Plan or a "
        f"lossscale.torch.Float16Audit, got {kind.__module__}.{kind.__qualname__}"
    )


@dataclass
class _Model:
    """One model a trainer runs in float16, with the plan's modules in it."""

    role: str  # "the policy (trainer.model)", "the reference model (trainer.ref_model)"
    root: torch.nn.Module  # what the trainer calls
    kept: dict[str, torch.nn.Module]  # the plan's names -> the modules
    covered: set[str] = field(default_factory=set)  # names made float32 on TRL's fused path


@dataclass
class TrainerPlan:
    """What ``place`` did: the handles it made (none for modules a live plan kept already;
    they stay on the models for the trainer's life), and per model the kept modules, for the
    first step's check."""

    handles: list[PlanHandle]
    models: list[_Model]


def place(trainer: Any, plan: Float16Plan) -> TrainerPlan:
    """Apply ``plan`` to every model ``trainer`` runs in float16 — ``trainer.model`` and,
    when the trainer has one, ``trainer.ref_model`` (TRL's reference model) — once: a module
    a live plan keeps already (the same plan applied by hand) is left as it is. Where TRL's
    fused lm_head runs a kept output embedding, its ``cast_lm_head_to_fp32`` is turned on.

    Raises:
      ValueError: a model lacks one of the plan's modules (naming it and the model),
        :meth:`Float16Plan.apply` refuses (its message), or the reference log-probabilities
        TRL precomputed in the trainer's constructor (``precompute_ref_log_probs=True``),
        before the plan, are not finite. Nothing is changed then.
    """
    _check_precomputed(trainer)
    models = [(role, model, _resolve(model, plan, role)) for role, model in _models_of(trainer)]
    handles: list[PlanHandle] = []
    try:
        for _, model, kept in models:
            handles.extend(_apply_once(model, plan, kept))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    placed = TrainerPlan(handles, [])
    for role, model, kept in models:
        entry = _Model(role, model, kept)
        heads = {id(module): name for name, module in kept.items()}
        for module in model.modules():
            fused = fused_forward(module)
            output_embeddings = getattr(module, "get_output_embeddings", None)
            if fused is None or not callable(output_embeddings):
                continue
            head = output_embeddings()
            if id(head) in heads and _cast_lm_head_to_fp32(fused):
                entry.covered.add(heads[id(head)])
        placed.models.append(entry)
    return placed


def _check_precomputed(trainer: Any) -> None:
    """ValueError when ``trainer``'s training data holds reference log-probabilities that are
    not all finite: TRL's DPOTrainer computes them in its constructor with
    ``precompute_ref_log_probs=True``, before ``install``, so without the plan (under
    autocast where Accelerate set it up there: on a GPU). Host work: one read of those
    columns."""
    dataset: Any = getattr(trainer, "train_dataset", None)
    names = getattr(dataset, "column_names", None) or ()
    columns = [c for c in _PRECOMPUTED if c in names]
    if not columns:
        return
    values = torch.tensor([v for c in columns for v in dataset[c]], dtype=torch.float64)
    bad = int((~values.isfinite()).sum())
    if bad:
        raise ValueError(
            f"install(trainer, plan=...): {bad} of the {values.numel()} reference "
            "log-probabilities TRL precomputed in the trainer's constructor "
            "(precompute_ref_log_probs=True) are not finite: they were computed before "
            "install, without the plan, and training on them is training on NaN; set "
            "precompute_ref_log_probs=False (the reference then runs in each step, with the "
            "plan); nothing was applied"
        )


def _models_of(trainer: Any) -> list[tuple[str, torch.nn.Module]]:
    models = [("the policy (trainer.model)", trainer.model)]
    reference = getattr(trainer, "ref_model", None)
    if isinstance(reference, torch.nn.Module) and reference is not trainer.model:
        reference = trainer.accelerator.unwrap_model(reference)
        models.append(("the reference model (trainer.ref_model)", reference))
    return models


def _resolve(model: torch.nn.Module, plan: Float16Plan, role: str) -> dict[str, torch.nn.Module]:
    """``model``'s modules of the plan's names (found as ``apply`` finds them: through
    ``torch.compile``, DDP and PEFT, both ways)."""
    try:
        return plan.modules_in(model)
    except ValueError as error:
        raise ValueError(
            f"install(trainer, plan=...): {role}: {error}; nothing was applied"
        ) from None


def _apply_once(
    model: torch.nn.Module, plan: Float16Plan, kept: dict[str, torch.nn.Module]
) -> list[PlanHandle]:
    """``plan.apply(model)`` for the modules (``kept``: the plan's, in ``model``) no live
    plan keeps already (the same plan applied by hand is left as it is); the handle made, if
    any."""
    rest = tuple(n for n, m in kept.items() if kept_by(m) is None)
    if not rest:
        return []
    return [plan._replace(float32_modules=rest).apply(model)]


def fused_forward(module: torch.nn.Module) -> FunctionType | None:
    """The forward that TRL's ``add_fused_lm_head`` put on ``module``, seen through the
    wrappers Accelerate's ``prepare`` adds (its autocast and float32-output wrappers, each
    with ``__wrapped__``); None when ``module`` has none."""
    forward = module.__dict__.get("forward")
    for _ in range(8):
        function = getattr(forward, "__func__", forward)
        code = getattr(function, "__code__", None)
        if (
            isinstance(function, FunctionType)
            and code is not None
            and code.co_name == _FUSED_FORWARD
            and "trl" in Path(code.co_filename).parts
        ):
            return function
        forward = getattr(function, "__wrapped__", None)
        if forward is None:
            return None
    return None


def _cast_lm_head_to_fp32(fused: FunctionType) -> bool:
    """Turn on ``cast_lm_head_to_fp32`` in one fused forward (its closure: that model only);
    False where it has no such option (then the first step's check sees the head bypassed)."""
    names = fused.__code__.co_freevars
    if _FUSED_OPTION not in names or fused.__closure__ is None:
        return False
    fused.__closure__[names.index(_FUSED_OPTION)].cell_contents = True
    return True


class FirstStepCheck:
    """Counts, from :meth:`start` to :meth:`finish` (the first training step, up to its
    optimizer step), each kept module's forward calls, with and without gradient mode, and
    each model's; then refuses or warns about the kept modules the models bypassed."""

    def __init__(self) -> None:
        self.models: list[_Model] = []
        self._hooks: list[Any] = []
        self._calls: dict[int, list[int]] = {}
        self.done = False

    def add(self, placed: TrainerPlan) -> None:
        """Check ``placed``'s models too (a model checked already: its modules, once)."""
        for model in placed.models:
            same = next((m for m in self.models if m.root is model.root), None)
            if same is None:
                self.models.append(model)
            else:
                same.kept.update(model.kept)
                same.covered |= model.covered

    def _count(self, module: torch.nn.Module, args: Any) -> None:
        del args
        self._calls[id(module)][0 if torch.is_grad_enabled() else 1] += 1

    def start(self) -> None:
        """Begin counting (the Trainer's ``on_train_begin``); again after a check, nothing."""
        if self.done or self._hooks:
            return
        for model in self.models:
            for module in (model.root, *model.kept.values()):
                self._calls.setdefault(id(module), [0, 0])
                self._hooks.append(module.register_forward_pre_hook(self._count))

    def stop(self) -> None:
        """Stop counting (the hooks go)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def finish(self) -> None:
        """At the first optimizer step (the Trainer's ``on_pre_optimizer_step``): stop counting
        and judge each kept module. One whose parameters got gradients while its forward never
        ran with gradients was bypassed: the trainer computed with its weights outside its
        forward, where the plan cannot hold, and this raises. One without gradients whose
        forward did not run in a mode its model ran in (a forward with gradients; for a model
        run only without, such as a reference model, any forward) warns: bypassed, or not
        needed in that step. A model that did not run at all (a reference model whose
        log-probabilities were computed before training) is not judged; nor are heads made
        float32 on TRL's fused lm_head (that path runs no forward of theirs). Later calls do
        nothing.

        Raises:
          ValueError: a bypassed kept module with gradients, naming it and its model (before
            the optimizer step: the weights are as they were).

        Warns:
          PlanBypassWarning: a kept module without gradients that did not run, naming it.
        """
        if self.done:
            return
        self.done = True
        if not self._hooks:
            return
        self.stop()
        for model in self.models:
            with_grad, without = self._calls[id(model.root)]
            for name, module in model.kept.items():
                if name in model.covered:
                    continue
                calls = self._calls[id(module)]
                if not calls[0] and any(p.grad is not None for p in module.parameters()):
                    raise ValueError(
                        f"install(trainer, plan=...): in the first training step, the "
                        f"parameters of {name!r} in {model.role}, a module the plan keeps in "
                        "float32, got gradients while its forward never ran with gradients: "
                        "the trainer computes with its weights on a path that bypasses its "
                        "forward (a fused kernel), in float16, where the plan cannot hold. "
                        "Training stopped before the first optimizer step; turn that path off "
                        "(the trainer's or the model's option for its fused kernels) to train "
                        "with the plan"
                    )
                ran = calls[0] if with_grad else sum(calls)
                if (with_grad or without) and not ran:
                    mode = "a forward with gradients" if with_grad else "a forward"
                    warnings.warn(
                        f"in the first training step, {model.role} ran {mode} but not the "
                        f"forward of its module {name!r}, which the float16 plan keeps in "
                        "float32, and the module got no gradients: either the step did not "
                        "need it (an MoE expert no token was routed to) or the trainer "
                        "computes with its weights on a path that bypasses its forward (a "
                        "fused kernel), in float16; lossscale cannot tell which",
                        PlanBypassWarning,
                        stacklevel=2,
                    )
