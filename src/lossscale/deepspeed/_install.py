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
from typing import Any

import torch

from lossscale.core import DEFAULT_STALL_STEPS
from lossscale.deepspeed._scaler import DeepSpeedLossScaler
from lossscale.torch import GradScaler

#: The key of the scaler's state in the torch optimizer's first parameter group (ZeRO 0).
GROUP_KEY = "lossscale"
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

    Returns:
      The scaler now in the engine: a :class:`DeepSpeedLossScaler`, or on the ZeRO-0
      ``torch_autocast`` path a :class:`lossscale.torch.GradScaler` (the engine's GradScaler
      slot). Both have ``get_scale``-style reads (``cur_scale`` / ``get_scale()``) and
      ``skipped_steps``.

    Raises:
      ValueError: the engine trains in neither float16 path (bfloat16, float32), has no
        optimizer, or a carried-over state does not fit the settings (a scale above
        ``max_loss_scale``); the engine is unchanged.
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
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        raise ValueError("install(engine): the engine has no optimizer to scale for")
    stage = engine.zero_optimization_stage()
    alarm = {"stall_steps": stall_steps, "on_stall": on_stall}
    if engine.fp16_enabled():
        scaler = DeepSpeedLossScaler(**_fp16_settings(engine, overrides), **alarm)
        if stage == 0:
            _carry_zero0_fp16(engine, optimizer, scaler)
            _install_zero0_fp16(engine, optimizer, scaler)
        else:
            _carry_zero(engine, optimizer.loss_scaler, scaler)
            optimizer.loss_scaler = scaler
            optimizer.dynamic_loss_scale = True  # the engine's check that the loss was scaled
        return scaler
    if not (engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.float16):
        raise ValueError(
            "install(engine): the engine trains neither with fp16 nor with torch_autocast in "
            "float16 (bfloat16 and float32 need no loss scaling)"
        )
    settings = {**AUTOCAST_DEFAULTS, **overrides}
    if stage == 0:
        if settings.pop("dynamic", True) is not True:
            raise ValueError(
                "install(engine, dynamic=False): the ZeRO-0 torch_autocast path keeps a "
                "GradScaler, whose scale is dynamic"
            )
        grad_scaler = EngineGradScaler(
            engine.device,
            settings.pop("initial_scale"),
            growth_interval=settings.pop("dynamic_growth_steps"),
            **settings,
            **alarm,
        )
        _carry_zero0_autocast(optimizer, grad_scaler)
        _hook_group_state(optimizer, grad_scaler)
        engine.torch_autocast_z0_gradscaler = grad_scaler
        return grad_scaler
    scaler = DeepSpeedLossScaler(**settings, **alarm)
    _carry_zero(engine, optimizer.loss_scaler, scaler)
    optimizer.torch_autocast_gradscaler = None
    optimizer.loss_scaler = scaler
    optimizer.dynamic_loss_scale = True  # the engine's check that the loss was scaled
    optimizer.check_grad_overflow = True  # ZeRO 1/2 check first; ZeRO 3 has its norm check
    return scaler


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


def _load_converted(
    scaler: DeepSpeedLossScaler, scale: Any, stable: int, spent: int, skipped: int
) -> None:
    """Load a state kept under other settings: ``stable`` finite steps since the last change
    (or DeepSpeed's last overflow), ``spent`` of the hysteresis allowance, both reduced to this
    scaler's ranges; the scale checked against its settings. A fixed scaler keeps its scale."""
    rule = scaler.rule
    loss_scale = scaler.state_dict()["loss_scale"]
    if rule is not None:
        loss_scale.update(
            current_loss_scale=float(scale),
            num_good_steps=max(int(stable), 0) % rule.increment_period,
            num_nonfinite_steps=min(max(int(spent), 0), rule.hysteresis - 1),
        )
    scaler.load_state_dict({"loss_scale": loss_scale, "skipped_steps": int(skipped)})


def _carry_state(scaler: DeepSpeedLossScaler, state: Any) -> None:
    """Carry a :meth:`DeepSpeedLossScaler.state_dict` written under any settings."""
    if not isinstance(state, dict) or set(state) != {"loss_scale", "skipped_steps"}:
        scaler.load_state_dict(state)  # raises, naming what is wrong
    ls = state["loss_scale"]
    if isinstance(ls, dict) and ls.get("class_name") == "DynamicLossScale":
        stable, spent = ls.get("num_good_steps", 0), ls.get("num_nonfinite_steps", 0)
        _load_converted(scaler, ls.get("current_loss_scale"), stable, spent, state["skipped_steps"])
    else:
        _load_converted(scaler, scaler.cur_scale, 0, 0, state["skipped_steps"])


def _carry_zero(engine: Any, old: Any, scaler: DeepSpeedLossScaler) -> None:
    """ZeRO 1-3: carry the state of the scaler found in the slot."""
    if isinstance(old, DeepSpeedLossScaler):
        _carry_state(scaler, old.state_dict())
    elif getattr(old, "dynamic", False) and getattr(old, "cur_iter", 0) > 0:
        _load_converted(  # DeepSpeed's DynamicLossScaler, after steps (a loaded checkpoint)
            scaler,
            old.cur_scale,
            old.cur_iter - old.last_overflow_iter - 1,
            old.delayed_shift - old.cur_hysteresis,
            int(engine.skipped_steps),
        )


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ZeRO-0 fp16 optimizer (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    assert isinstance(inner, torch.optim.Optimizer)
    return inner


def _group_state(optimizer: torch.optim.Optimizer) -> Any:
    """The scaler state DeepSpeed restored into the first parameter group (None: none)."""
    return optimizer.param_groups[0].get(GROUP_KEY)


#: The checkpoint hooks ``install`` put on a torch optimizer (ZeRO 0), replaced by the next.
_HOOKS: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = weakref.WeakKeyDictionary()


def _hook_group_state(optimizer: Any, scaler: DeepSpeedLossScaler | GradScaler) -> None:
    """Save the scaler's state with the torch optimizer's (ZeRO 0), and load it back when the
    optimizer loads after ``install``; the hooks of an earlier ``install`` are removed."""
    inner = _torch_optimizer(optimizer)
    for handle in _HOOKS.pop(inner, []):
        handle.remove()

    def save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        del opt
        state_dict["param_groups"][0][GROUP_KEY] = scaler.state_dict()
        return state_dict

    def load(opt: torch.optim.Optimizer) -> None:
        state = opt.param_groups[0].pop(GROUP_KEY, None)
        if state is not None:
            scaler.load_state_dict(state)

    inner.param_groups[0].pop(GROUP_KEY, None)  # carried over by install: not left behind
    _HOOKS[inner] = [
        inner.register_state_dict_post_hook(save),
        inner.register_load_state_dict_post_hook(load),
    ]


def _carry_zero0_fp16(engine: Any, optimizer: Any, scaler: DeepSpeedLossScaler) -> None:
    """ZeRO-0 fp16: lossscale's state from the parameter group, else DeepSpeed's fields."""
    state = _group_state(_torch_optimizer(optimizer))
    if state is not None:
        _carry_state(scaler, state)
        return
    config = optimizer.loss_scale_config
    if config.dynamic_loss_scale and config.cur_iter > 0:
        stable = config.cur_iter - config.last_overflow_iter - 1
        _load_converted(scaler, config.cur_scale, stable, 0, int(engine.skipped_steps))


def _install_zero0_fp16(engine: Any, optimizer: Any, scaler: DeepSpeedLossScaler) -> None:
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
    _hook_group_state(optimizer, scaler)
    engine.torch_autocast_z0_gradscaler = _ZeroStageZeroSlot(scaler)


def _carry_zero0_autocast(optimizer: Any, grad_scaler: GradScaler) -> None:
    """ZeRO-0 torch_autocast: the GradScaler state DeepSpeed restored into the parameter group."""
    state = _group_state(_torch_optimizer(optimizer))
    if state is not None:
        grad_scaler.load_state_dict(state)
