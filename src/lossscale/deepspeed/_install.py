"""``install(engine)``: lossscale's rule in a DeepSpeed engine, on every ZeRO stage and path.

Where each path calls its scaler (tested against deepspeed 0.19.8):

* ``fp16``, ZeRO 1-3: the ZeRO optimizer's ``loss_scaler`` slot. DeepSpeed itself scales the
  loss with it, reduces the overflow flag over the data- and model-parallel groups, calls
  ``update_scale`` once per step, skips, counts ``engine.skipped_steps`` and holds the LR
  schedule back. Swapped, not patched.
* ``torch_autocast`` float16, ZeRO 1-3: DeepSpeed keeps a ``torch.amp.GradScaler`` there that
  its gradient-norm check bypasses, that agrees with no other rank and that it updates once per
  parameter group. ``install`` removes it (``optimizer.torch_autocast_gradscaler = None``),
  puts the same scaler as above in ``loss_scaler`` and turns the ZeRO optimizer's own overflow
  check on (``check_grad_overflow = True``, which its ``fp16`` path sets), so that the step
  runs exactly as the ``fp16`` path does.
* ``fp16``, ZeRO 0 (``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``): these keep a second,
  inline rule with no slot, and deepspeed 0.19.8's ``engine.backward`` never scales their loss
  although their step divides the gradients by the scale. ``install`` replaces the bound
  ``_update_scale`` of the optimizer instance (an internal: replaced, not swapped) and fills
  the engine's ZeRO-0 scaler slot (``engine.torch_autocast_z0_gradscaler``, which
  ``engine.backward``/``engine.scale`` and ``_take_model_step`` call) with an object that scales
  the loss and leaves the step to the optimizer.
* ``torch_autocast`` float16, ZeRO 0: that slot holds a ``torch.amp.GradScaler``; ``install``
  puts a :class:`lossscale.torch.GradScaler` there that agrees over the default process group
  and marks skipped steps on the optimizer (``optimizer.overflow``), which the engine reads for
  ``skipped_steps``, ``was_step_applied()`` and the LR scheduler.

Checkpoints: ZeRO 1-3 pickle the ``loss_scaler`` object into their optimizer states;
:class:`DeepSpeedLossScaler` pickles as plain values and is registered with
``torch.serialization.add_safe_globals``. ZeRO 0 saves only DeepSpeed's own fields, so the scaler's
state also rides in the torch optimizer's first parameter group (key ``"lossscale"``, written by
a ``state_dict`` post-hook), which DeepSpeed saves and restores verbatim; ``install`` reads it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from lossscale._extras import check_version
from lossscale.core import DEFAULT_STALL_STEPS
from lossscale.deepspeed._carry import (
    carry_zero,
    carry_zero0_autocast,
    carry_zero0_fp16,
    hook_group_state,
)
from lossscale.deepspeed._cuda_arch import set_cuda_arch_list
from lossscale.deepspeed._scaler import DeepSpeedLossScaler
from lossscale.torch import GradScaler

#: torch's GradScaler defaults, which the ``torch_autocast`` path (no fp16 config) keeps.
AUTOCAST_DEFAULTS = {"initial_scale": 2.0**16, "dynamic_growth_steps": 2000}


class EngineGradScaler(GradScaler):
    """:class:`lossscale.torch.GradScaler` in the ZeRO-0 ``torch_autocast`` slot: ``update()``
    also marks the step as skipped or applied in ``optimizer.overflow`` on each optimizer it
    stepped, which the engine reads next (``skipped_steps``, ``was_step_applied()``, the LR
    scheduler). The decision is already on the host then (one sync per step, as
    :class:`GradScaler`'s default)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._engine_optimizers: list[torch.optim.Optimizer] = []

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._engine_optimizers.append(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(new_scale)
        skipped = not self.read_last_step_applied()
        for optimizer in self._engine_optimizers:
            optimizer.overflow = skipped  # type: ignore[attr-defined]
        self._engine_optimizers.clear()


class _ZeroStageZeroSlot:
    """Fills ``engine.torch_autocast_z0_gradscaler`` for the ZeRO-0 fp16 optimizers: the engine
    scales the loss through it; the optimizer checks, unscales (and clips) and updates in its own
    ``step``, so ``unscale_`` and ``update`` have nothing to do."""

    def __init__(self, scaler: DeepSpeedLossScaler) -> None:
        self.scaler = scaler

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss)

    def unscale_(self, optimizer: Any) -> None:
        del optimizer

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        pass


def install(
    engine: Any,
    *,
    dynamic: bool | None = None,
    initial_scale: float | None = None,
    dynamic_growth_steps: int | None = None,
    min_loss_scale: float | None = None,
    max_loss_scale: float | None = None,
    hysteresis: int | None = None,
    hysteresis_refill: str | None = None,
    stall_steps: int | None = DEFAULT_STALL_STEPS,
    on_stall: str = "warn",
) -> DeepSpeedLossScaler | GradScaler:
    """Put lossscale's rule into a DeepSpeed engine, in place, and return the installed scaler.

    Call it after ``deepspeed.initialize`` and after ``engine.load_checkpoint`` (a load puts back
    whatever scaler the checkpoint holds). Works on ZeRO stages 0-3 with ``fp16`` and with
    ``torch_autocast`` in float16; see the module's documentation for what it replaces where.

    Settings: with no override, those of the engine's ``fp16`` config — ``loss_scale`` (0:
    dynamic, else a fixed scale, never changed, whose overflowing steps are still skipped),
    ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``
    (``hysteresis_refill="on_finite_step"``, else ``"on_growth"``, DeepSpeed's) and
    ``min_loss_scale``; on the ``torch_autocast`` path, which has no such config, torch's
    GradScaler defaults (2**16, 2000 steps, factor 2, ``hysteresis=1``). Each keyword overrides
    one, in lossscale's names (:class:`DeepSpeedLossScaler`): ``min_loss_scale`` may be any
    float > 0, ``max_loss_scale`` caps growth, ``stall_steps``/``on_stall`` set the stall alarm
    that replaces DeepSpeed's exception at the floor. The scale grows on the
    ``dynamic_growth_steps``-th finite step in a row, as TensorFlow's and Megatron's (DeepSpeed's
    own grows one step later).

    State: the scale and counters the engine's scaler holds carry over: lossscale's exactly (a
    checkpoint written with lossscale installed), DeepSpeed's converted (its scale; finite steps
    since its last overflow, modulo the window; the hysteresis allowance spent;
    ``engine.skipped_steps``). A scaler that has not stepped yet starts from the settings.

    On a CUDA device it sets ``TORCH_CUDA_ARCH_LIST`` from the devices when unset
    (:func:`~lossscale.deepspeed.set_cuda_arch_list`), for the ops DeepSpeed builds later.

    Called again on the same engine with the same keywords, it returns the scaler already in
    place, with its state (nothing is rebuilt, nothing forgotten); with other keywords it
    refuses. After ``engine.load_checkpoint`` (ZeRO 1-3 put the checkpoint's scaler back) it
    installs again, carrying the loaded state.

    Returns:
      The scaler now in the engine: a :class:`DeepSpeedLossScaler` on every path but one; on
      the ZeRO-0 ``torch_autocast`` path, whose engine slot holds a GradScaler, a
      :class:`lossscale.torch.GradScaler`. Both satisfy :class:`lossscale.torch.ScaleReader`
      (``current_loss_scale()``, ``read_last_step_applied()``), which is what lossscale's
      tools (``NumericsMonitor``, the callbacks) read; otherwise they keep their own names
      (``cur_scale`` / ``get_scale()``; both have ``skipped_steps``).

    Raises:
      TypeError: ``engine`` is not a DeepSpeed engine (a module, an optimizer, or the tuple
        ``deepspeed.initialize`` returns, not unpacked), naming what was passed.
      ValueError: the engine trains in neither float16 path (bfloat16, float32), has no
        optimizer, already holds a scaler installed with other keywords, or a carried-over
        state does not fit the settings (a scale above ``max_loss_scale``); the engine is
        unchanged.
      RuntimeError: the installed DeepSpeed is older than the supported versions
        (:data:`SUPPORTED_DEEPSPEED`), naming both; a newer one gets a warning naming them.
      TypeError, ValueError: an override of the wrong type or out of range, naming it.

    Example (in a training script; the DeepSpeed page of the documentation runs one whole)::

        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        engine.load_checkpoint(path)  # when resuming
        scaler = lossscale.deepspeed.install(engine, min_loss_scale=2**-10)

    An engine that needs no loss scaling is refused, and left as it was:

      >>> from types import SimpleNamespace
      >>> from lossscale.deepspeed import install
      >>> bf16 = SimpleNamespace(
      ...     optimizer=object(), zero_optimization_stage=lambda: 2, fp16_enabled=lambda: False,
      ...     torch_autocast_enabled=lambda: False)
      >>> install(bf16)
      Traceback (most recent call last):
      ...
      ValueError: install(engine): the engine trains neither with fp16 nor with torch_autocast ...
    """
    check_engine(engine, "install(engine)")
    check_deepspeed_version()
    set_cuda_arch_list()  # for the ops DeepSpeed builds from now on (no-op without CUDA)
    overrides = {
        key: value
        for key, value in {
            "dynamic": dynamic,
            "initial_scale": initial_scale,
            "dynamic_growth_steps": dynamic_growth_steps,
            "min_loss_scale": min_loss_scale,
            "max_loss_scale": max_loss_scale,
            "hysteresis": hysteresis,
            "hysteresis_refill": hysteresis_refill,
        }.items()
        if value is not None
    }
    alarm = {"stall_steps": stall_steps, "on_stall": on_stall}
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        raise ValueError("install(engine): the engine has no optimizer to scale for")
    asked = {**overrides, **alarm}
    in_place = _installed(engine, optimizer)
    if in_place is not None:
        earlier = _INSTALLED[in_place]
        if earlier != asked:
            raise ValueError(
                f"install(engine, **{asked}): this engine already holds the scaler installed "
                f"with install(engine, **{earlier}); call install once per engine (after "
                "load_checkpoint), or again with the same keywords to get that scaler back"
            )
        return in_place
    stage = engine.zero_optimization_stage()
    path: Callable[[Any, Any, dict[str, Any], dict[str, Any]], DeepSpeedLossScaler | GradScaler]
    if engine.fp16_enabled():
        path = _install_zero0_fp16 if stage == 0 else _install_zero_fp16
    elif engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.float16:
        path = _install_zero0_autocast if stage == 0 else _install_zero_autocast
    else:
        raise ValueError(
            "install(engine): the engine trains neither with fp16 nor with torch_autocast in "
            "float16 (bfloat16 and float32 need no loss scaling)"
        )
    scaler = path(engine, optimizer, overrides, alarm)
    _INSTALLED[scaler] = asked
    return scaler


#: The DeepSpeed versions ``install`` supports: from the first, below the second. It replaces
#: DeepSpeed internals (slots and a bound method) whose names and calls these versions share.
SUPPORTED_DEEPSPEED = ("0.19.8", "0.20")

#: The scalers ``install`` put in place, with the keywords it was called with.
_INSTALLED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def check_deepspeed_version(version: str | None = None) -> None:
    """Check DeepSpeed's version (default: the installed one) against
    :data:`SUPPORTED_DEEPSPEED`.

    Raises:
      RuntimeError: older than the first supported version (or unreadable), naming both.

    Warns:
      UserWarning: at or above the first unsupported version, naming the supported ones.
    """
    if version is None:
        import deepspeed

        version = str(deepspeed.__version__)
    low = SUPPORTED_DEEPSPEED[0]
    check_version(
        "lossscale.deepspeed.install",
        "DeepSpeed",
        version,
        SUPPORTED_DEEPSPEED,
        span=f"DeepSpeed {low} and later {low.rsplit('.', 1)[0]}.x releases",
        why=": it replaces DeepSpeed internals that may have changed",
    )


def check_engine(engine: Any, call: str) -> None:
    """TypeError unless ``engine`` is a DeepSpeed engine (what ``deepspeed.initialize``
    returns first), naming ``call``, what was passed and what to pass."""
    if isinstance(engine, tuple):
        raise TypeError(
            f"{call} got a tuple of {len(engine)} items, what deepspeed.initialize "
            "returns: unpack it and pass the engine (engine, *_ = deepspeed.initialize(...))"
        )
    needs = ("zero_optimization_stage", "fp16_enabled", "torch_autocast_enabled")
    if not all(callable(getattr(engine, name, None)) for name in needs):
        kind = type(engine)
        raise TypeError(
            f"{call} needs the DeepSpeed engine that deepspeed.initialize returns (a "
            f"deepspeed.DeepSpeedEngine), got {kind.__module__}.{kind.__qualname__}"
        )


def _installed(engine: Any, optimizer: Any) -> DeepSpeedLossScaler | GradScaler | None:
    """The scaler an earlier ``install`` put in this engine and that is still in place, else
    None (also after ``load_checkpoint`` put a checkpoint's scaler in its slot)."""
    slot = getattr(engine, "torch_autocast_z0_gradscaler", None)
    candidates = [slot, getattr(slot, "scaler", None), getattr(optimizer, "loss_scaler", None)]
    for candidate in candidates:
        if isinstance(candidate, DeepSpeedLossScaler | GradScaler) and candidate in _INSTALLED:
            return candidate
    return None


def _install_zero_fp16(
    engine: Any, optimizer: Any, overrides: dict[str, Any], alarm: dict[str, Any]
) -> DeepSpeedLossScaler:
    """``fp16``, ZeRO 1-3: a :class:`DeepSpeedLossScaler` from the engine's ``fp16`` config,
    carrying the state of the scaler in the ZeRO optimizer's ``loss_scaler`` slot, swapped in
    there. DeepSpeed does the rest."""
    scaler = DeepSpeedLossScaler(**_fp16_settings(engine, overrides), **alarm)
    carry_zero(engine, optimizer.loss_scaler, scaler)
    optimizer.loss_scaler = scaler
    optimizer.dynamic_loss_scale = True  # the engine's check that the loss was scaled
    return scaler


def _install_zero_autocast(
    engine: Any, optimizer: Any, overrides: dict[str, Any], alarm: dict[str, Any]
) -> DeepSpeedLossScaler:
    """``torch_autocast`` float16, ZeRO 1-3: a :class:`DeepSpeedLossScaler` with torch's
    GradScaler defaults in ``loss_scaler``; the ZeRO optimizer's own GradScaler removed and its
    overflow check turned on, so the step runs as on the ``fp16`` path."""
    scaler = DeepSpeedLossScaler(**{**AUTOCAST_DEFAULTS, **overrides}, **alarm)
    carry_zero(engine, optimizer.loss_scaler, scaler)
    optimizer.torch_autocast_gradscaler = None
    optimizer.loss_scaler = scaler
    optimizer.dynamic_loss_scale = True  # the engine's check that the loss was scaled
    optimizer.check_grad_overflow = True  # ZeRO 1/2 check first; ZeRO 3 has its norm check
    return scaler


def _install_zero0_autocast(
    engine: Any, optimizer: Any, overrides: dict[str, Any], alarm: dict[str, Any]
) -> GradScaler:
    """``torch_autocast`` float16, ZeRO 0: an :class:`EngineGradScaler` (torch's names, torch's
    defaults) in the engine's GradScaler slot, carrying the state saved with the torch
    optimizer; a fixed scale is refused (the slot's scaler is dynamic)."""
    if overrides.get("dynamic", True) is not True:
        raise ValueError(
            "install(engine, dynamic=False): the ZeRO-0 torch_autocast path keeps a "
            "GradScaler, whose scale is dynamic"
        )
    rule = {k: v for k, v in overrides.items() if k in _GRAD_SCALER_KEYWORDS}
    grad_scaler = EngineGradScaler(
        engine.device,
        overrides.get("initial_scale", AUTOCAST_DEFAULTS["initial_scale"]),
        growth_interval=overrides.get(
            "dynamic_growth_steps", AUTOCAST_DEFAULTS["dynamic_growth_steps"]
        ),
        **rule,
        **alarm,
    )
    carry_zero0_autocast(optimizer, grad_scaler)
    hook_group_state(optimizer, grad_scaler)
    engine.torch_autocast_z0_gradscaler = grad_scaler
    return grad_scaler


#: The overrides that :class:`lossscale.torch.GradScaler` takes under the same names.
_GRAD_SCALER_KEYWORDS = ("min_loss_scale", "max_loss_scale", "hysteresis", "hysteresis_refill")


def _fp16_settings(engine: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """The engine's ``fp16`` config in lossscale's names, under ``overrides``. A fixed scale is
    the config's ``loss_scale``, or ``2**initial_scale_power`` when only ``dynamic=False`` asks
    for one."""
    args = engine.dynamic_loss_scale_args()
    if not overrides.get("dynamic", bool(engine.dynamic_loss_scale())):
        static = float(engine.loss_scale()) or float(args["init_scale"])
        return {"dynamic": False, "initial_scale": static, **overrides}
    return {
        "initial_scale": float(args["init_scale"]),
        "dynamic_growth_steps": int(args["scale_window"]),
        "hysteresis": int(args["delayed_shift"]),
        "hysteresis_refill": "on_finite_step" if args["consecutive_hysteresis"] else "on_growth",
        "min_loss_scale": float(args["min_scale"]),
        **overrides,
    }


def _install_zero0_fp16(
    engine: Any, optimizer: Any, overrides: dict[str, Any], alarm: dict[str, Any]
) -> DeepSpeedLossScaler:
    """``fp16``, ZeRO 0 (``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``): a
    :class:`DeepSpeedLossScaler` from the ``fp16`` config, carrying lossscale's state saved
    with the torch optimizer (else DeepSpeed's fields). These optimizers keep an inline rule
    with no slot: the instance's ``_update_scale`` is replaced by one that steps the scaler and
    keeps DeepSpeed's fields in step (it divides by ``cur_scale``), and the engine's ZeRO-0
    scaler slot gets an object that scales the loss (deepspeed 0.19.8's ``engine.backward``
    never scales theirs)."""
    scaler = DeepSpeedLossScaler(**_fp16_settings(engine, overrides), **alarm)
    carry_zero0_fp16(engine, optimizer, scaler)
    config = optimizer.loss_scale_config

    def sync_config() -> None:
        # DeepSpeed's fields stay meaningful: it divides by cur_scale, and a checkpoint read
        # without lossscale finds the finite steps since the last change in its own fields.
        config.cur_scale = scaler.cur_scale
        config.last_overflow_iter = config.cur_iter - 1 - scaler.num_good_steps

    def update_scale(skip: bool) -> None:
        scaler.update_scale(bool(skip))
        config.cur_iter += 1
        sync_config()

    sync_config()
    optimizer._update_scale = update_scale
    hook_group_state(optimizer, scaler)
    engine.torch_autocast_z0_gradscaler = _ZeroStageZeroSlot(scaler)
    return scaler
