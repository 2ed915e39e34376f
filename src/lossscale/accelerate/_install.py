"""``install(target)``: lossscale's scaler as the ``accelerator.scaler`` of an Accelerator or of
a Hugging Face ``Trainer`` (TRL's trainers subclass it).

What Accelerate does with float16 (``mixed_precision="fp16"``; tested against accelerate
1.15.0): ``Accelerator.__init__`` builds ``torch.amp.GradScaler`` (torch's
``ShardedGradScaler`` under FSDP1) and sets ``native_amp = True`` — on a GPU; on the CPU it
builds no scaler and leaves ``native_amp`` False, so nothing runs in float16 there. ``prepare``
hands ``accelerator.scaler`` to every optimizer it prepares (``AcceleratedOptimizer``) and,
with ``native_amp``, wraps every model's ``forward`` in the autocast of
``accelerate.utils.get_mixed_precision_context_manager`` (``torch.autocast(device_type,
dtype=torch.float16)``, with ``AutocastKwargs`` if given) and its outputs in a float32 cast;
``accelerator.autocast()`` returns the same context. ``install`` sets both attributes before
``prepare``: the same code path on a GPU and on the CPU.
"""

from __future__ import annotations

import weakref
from typing import Any

from lossscale._extras import check_version
from lossscale.accelerate._plan import FirstStepCheck, as_plan, place
from lossscale.accelerate._scalers import AcceleratorGradScaler, AcceleratorShardedGradScaler
from lossscale.torch import Float16Plan, GradScaler

#: The Accelerate versions ``install`` supports: from the first, below the second. It sets the
#: public ``accelerator.scaler`` and ``native_amp`` and reads ``accelerator._optimizers``.
SUPPORTED_ACCELERATE = ("1.0", "2.0")

#: The keywords ``install`` passes to the scaler: :class:`lossscale.torch.GradScaler`'s, less
#: ``device`` (the accelerator's) and ``enabled`` (always on).
SETTINGS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_loss_scale",
    "max_loss_scale",
    "hysteresis",
    "hysteresis_refill",
    "stall_steps",
    "on_stall",
    "process_group",
    "device_side_skip",
)

#: The scalers ``install`` put in place, with the settings it was called with.
_INSTALLED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def install(target: Any, *, plan: Any = None, **settings: Any) -> GradScaler:
    """Make lossscale's scaler the loss scaler of ``target``, in place, and return it.

    ``target`` is an ``accelerate.Accelerator`` in float16 (``mixed_precision="fp16"``), or a
    ``transformers.Trainer`` with ``fp16=True`` (TRL's ``GRPOTrainer``, ``DPOTrainer``,
    ``SFTTrainer``, ... subclass it). Call it after the trainer (or accelerator) is built and
    before training: before ``trainer.train()``, or before ``accelerator.prepare(...)`` of the
    optimizer. A Trainer then loads ``resume_from_checkpoint``'s ``scaler.pt`` (torch's format
    or lossscale's) into it inside ``train()``.

    What it sets: ``accelerator.scaler`` to an :class:`AcceleratorGradScaler` (an
    :class:`AcceleratorShardedGradScaler` under FSDP1, where Accelerate builds torch's
    ``ShardedGradScaler``) on the accelerator's device, and ``accelerator.native_amp = True``.
    On a GPU that replaces the ``torch.amp.GradScaler`` Accelerate built. On the CPU, where
    Accelerate builds no scaler and no autocast for float16 (a ``fp16=True`` run trains in
    float32 there), it also turns on the float16 autocast that ``fp16=True`` asked for: the
    models ``prepare`` wraps from then on run their forward under
    ``torch.autocast("cpu", dtype=torch.float16)`` (Accelerate's
    ``get_mixed_precision_context_manager``), as on a GPU. Models prepared before ``install``
    (TRL prepares its reference model in the trainer's constructor) keep their forward as it
    was: float32 on the CPU, unless the trainer calls them inside ``accelerator.autocast()``
    (GRPO's reference log-probabilities).

    With ``plan`` (a Trainer only), the float16 audit's plan holds on the trainer's own code
    paths: it is applied (:meth:`lossscale.torch.Float16Plan.apply`) to ``trainer.model`` (under
    PEFT, with the names of the wrapped or of the base model) and to TRL's reference model
    ``trainer.ref_model`` when the trainer has one, once: modules that a live plan keeps
    already (the plan applied by hand before) are left as they are. Where TRL's fused lm_head
    (``add_fused_lm_head``, which computes the log-probabilities from ``lm_head.weight``
    without calling ``lm_head``) runs a head the plan keeps, TRL's own ``cast_lm_head_to_fp32``
    is turned on for that model: the head computes in float32 there too. In the first
    training step a :class:`lossscale.accelerate.hf.PlanCheckCallback` counts the kept
    modules' forward calls: a module its model bypassed while its parameters got gradients
    stops training before the first optimizer step (``ValueError``); one without gradients
    warns (:class:`lossscale.accelerate.PlanBypassWarning`).

    With a Trainer, it also adds a callback (:class:`lossscale.accelerate.hf.LossScaleLogCallback`)
    that puts ``loss_scale``, ``skipped_steps`` and ``skipped_since_last_log`` into every
    training log. A skipped step (a non-finite gradient) calls no ``optimizer.step``: weights and
    optimizer state are unchanged, Accelerate reports ``optimizer_step_was_skipped`` and the
    Trainer does not step its LR schedule.

    Args:
      target: an ``accelerate.Accelerator`` or a ``transformers.Trainer``.
      plan: None, or the float16 plan to hold on a Trainer's models: a path (read with
        :func:`lossscale.torch.load_plan`), a :class:`lossscale.torch.Float16Plan` or a
        :class:`lossscale.torch.Float16Audit`.
      **settings: :class:`lossscale.torch.GradScaler`'s keywords (``init_scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``min_loss_scale``,
        ``max_loss_scale``, ``hysteresis``, ``hysteresis_refill``, ``stall_steps``,
        ``on_stall``, ``process_group``, ``device_side_skip``). Unset ones come from the
        accelerator's ``GradScalerKwargs`` handler when it has one, else GradScaler's defaults.

    Returns:
      The scaler now in ``accelerator.scaler``. Called again on the same target with the same
      settings, the scaler already installed (with its state); nothing is rebuilt.

    Raises:
      TypeError: ``target`` is neither an Accelerator nor a Trainer (naming its type); an
        unknown setting (naming it); a setting of the wrong type (from GradScaler); ``plan``
        of none of its types (naming it).
      FileNotFoundError: ``plan`` is a path with no file.
      ValueError: the target does not train in float16 (naming its ``mixed_precision``), runs
        DeepSpeed (pointing to :func:`lossscale.deepspeed.install`) or Megatron-LM, has prepared
        its optimizer already (training has started: call ``install`` before), or holds a
        scaler installed with other settings; a setting out of range (from GradScaler);
        ``plan`` with an Accelerator, a plan file that is not a plan, a plan naming a module
        a model lacks (naming both), or a plan :meth:`~lossscale.torch.Float16Plan.apply`
        refuses. In every case the target and its models are unchanged.
      RuntimeError: an Accelerate older than :data:`SUPPORTED_ACCELERATE` (a newer one warns).

    Syncs, allocations: none beyond building the scaler (its state tensors on the device).

    Example (the float16 RL page of the documentation runs a whole GRPO run)::

        trainer = trl.GRPOTrainer(model=model, args=trl.GRPOConfig(fp16=True, ...), ...)
        scaler = lossscale.accelerate.install(trainer, init_scale=2**12)
        trainer.train()

    On the CPU, where Accelerate sets up nothing for float16:

    >>> from accelerate import Accelerator
    >>> from lossscale.accelerate import install
    >>> accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    >>> accelerator.scaler, accelerator.native_amp
    (None, False)
    >>> scaler = install(accelerator, init_scale=2**12)
    >>> accelerator.scaler is scaler, accelerator.native_amp, scaler.get_scale()
    (True, True, 4096.0)
    >>> install(accelerator, init_scale=2**10)
    Traceback (most recent call last):
    ...
    ValueError: install(target, **{'init_scale': 1024}): this accelerator already holds ...
    """
    accelerator, trainer = _accelerator_of(target)
    check_accelerate_version()
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(
            f"install(target, {unknown[0]}=...): not a setting; the settings are GradScaler's: "
            f"{', '.join(SETTINGS)}"
        )
    wanted = None if plan is None else _plan_for(trainer, plan)
    _check_precision(accelerator, trainer)
    current = getattr(accelerator, "scaler", None)
    if current is not None and current in _INSTALLED:
        earlier = _INSTALLED[current]
        if earlier != settings:
            raise ValueError(
                f"install(target, **{settings}): this accelerator already holds the scaler "
                f"installed with install(target, **{earlier}); call install once, or again with "
                "the same settings to get that scaler back"
            )
        if wanted is not None:
            _check_not_started(accelerator)
            _place_plan(trainer, wanted)
        if trainer is not None:
            _add_log_callback(trainer, current)
        return current  # type: ignore[no-any-return]
    _check_not_started(accelerator)
    scaler = _build_scaler(accelerator, settings)
    if wanted is not None:
        _place_plan(trainer, wanted)
    if trainer is not None:
        _add_log_callback(trainer, scaler)
    accelerator.scaler = scaler
    accelerator.native_amp = True
    _INSTALLED[scaler] = dict(settings)
    return scaler


def _plan_for(trainer: Any, plan: Any) -> Float16Plan:
    """The plan of ``install``'s ``plan`` argument; ValueError without a Trainer."""
    if trainer is None:
        raise ValueError(
            "install(target, plan=...): plan needs a transformers.Trainer (it applies the plan to "
            "the trainer's models); with an Accelerator, apply it to the model before "
            "accelerator.prepare: plan.apply(model)"
        )
    return as_plan(plan)


def _check_not_started(accelerator: Any) -> None:
    """ValueError when ``accelerator`` has prepared an optimizer (training has started)."""
    if getattr(accelerator, "_optimizers", None):
        raise ValueError(
            "install(target): the accelerator has prepared its optimizer already (training has "
            "started), which keeps the scaler it had; call install after building the trainer "
            "(or Accelerator) and before trainer.train() (or accelerator.prepare(optimizer))"
        )


def _place_plan(trainer: Any, plan: Float16Plan) -> None:
    """Apply ``plan`` to ``trainer``'s models (see :func:`lossscale.accelerate._plan.place`)
    and check its modules in the first training step (one check callback per trainer)."""
    from lossscale.accelerate.hf import PlanCheckCallback

    placed = place(trainer, plan)
    callbacks = trainer.callback_handler.callbacks
    check = next((c for c in callbacks if isinstance(c, PlanCheckCallback)), None)
    if check is None:
        check = PlanCheckCallback(FirstStepCheck())
        callbacks.append(check)
    check.check.add(placed)


def _accelerator_of(target: Any) -> tuple[Any, Any]:
    """``(accelerator, trainer)`` of ``target`` (trainer None for an Accelerator); TypeError
    naming ``target``'s type otherwise."""
    import accelerate

    if isinstance(target, accelerate.Accelerator):
        return target, None
    trainer_class = _trainer_class()
    if trainer_class is not None and isinstance(target, trainer_class):
        return target.accelerator, target
    kind = type(target)
    raise TypeError(
        "install(target) needs an accelerate.Accelerator or a transformers.Trainer (TRL's "
        f"trainers included), got {kind.__module__}.{kind.__qualname__}"
    )


def _trainer_class() -> Any:
    """``transformers.Trainer``, or None when transformers is not installed."""
    try:
        from transformers import Trainer
    except ImportError:
        return None
    return Trainer


def _check_precision(accelerator: Any, trainer: Any) -> None:
    """ValueError unless ``accelerator`` trains in float16 with Accelerate's own scaler slot
    (not DeepSpeed, not Megatron-LM)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        where = (
            "lossscale.deepspeed.hf.LossScaleCallback(trainer) in the Trainer's callbacks"
            if trainer is not None
            else "lossscale.deepspeed.install(engine) after accelerator.prepare"
        )
        raise ValueError(
            "install(target): the accelerator runs DeepSpeed, which keeps its own loss scaler "
            f"(accelerator.scaler is not used); use {where} (lossscale.deepspeed.install)"
        )
    if kind == DistributedType.MEGATRON_LM:
        raise ValueError(
            "install(target): the accelerator runs Megatron-LM, which keeps its own loss scaler "
            "(accelerator.scaler is not used); see lossscale.megatron"
        )
    precision = accelerator.mixed_precision
    if precision != "fp16":
        asked = "fp16=True (TrainingArguments)" if trainer is not None else 'mixed_precision="fp16"'
        raise ValueError(
            f"install(target): the accelerator's mixed_precision is {precision!r}, not 'fp16': "
            f"only float16 needs loss scaling, and install does not turn it on; ask for {asked}"
        )


def _build_scaler(accelerator: Any, settings: dict[str, Any]) -> GradScaler:
    """The scaler Accelerate would build, lossscale's: sharded under FSDP1, on the
    accelerator's device type, with the ``GradScalerKwargs`` handler's keywords under
    ``settings``."""
    from accelerate.utils import DistributedType

    handler = getattr(accelerator, "scaler_handler", None)
    keywords = {**(handler.to_kwargs() if handler is not None else {}), **settings}
    keywords.pop("enabled", None)
    device = accelerator.device.type
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        return AcceleratorShardedGradScaler(device, **keywords)
    return AcceleratorGradScaler(device, **keywords)


def _add_log_callback(trainer: Any, scaler: Any) -> None:
    """Add the logging callback of ``scaler`` to ``trainer`` (once)."""
    from lossscale.accelerate.hf import LossScaleLogCallback

    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(c, LossScaleLogCallback) and c.scaler is scaler for c in callbacks):
        return
    # first, so that the reporting integrations' on_log sees the keys it adds
    callbacks[:] = [
        LossScaleLogCallback(scaler),
        *(c for c in callbacks if not isinstance(c, LossScaleLogCallback)),
    ]


def check_accelerate_version(version: str | None = None) -> None:
    """Check Accelerate's version (default: the installed one) against
    :data:`SUPPORTED_ACCELERATE`.

    Raises:
      RuntimeError: older than the first supported version (or unreadable), naming both.

    Warns:
      UserWarning: at or above the first unsupported version, naming the supported ones.
    """
    if version is None:
        import accelerate

        version = str(accelerate.__version__)
    check_version("lossscale.accelerate.install", "Accelerate", version, SUPPORTED_ACCELERATE)
