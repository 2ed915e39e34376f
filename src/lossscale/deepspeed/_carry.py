"""What ``install`` carries over into the scaler it installs: the state of the scaler found in
the engine (lossscale's exactly, DeepSpeed's converted) and, on ZeRO 0, whose checkpoints keep
only DeepSpeed's fields, the scaler's state saved with the torch optimizer's first parameter
group (key ``"lossscale"``) by a ``state_dict`` post-hook."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lossscale.deepspeed._scaler import DeepSpeedLossScaler
from lossscale.torch import GradScaler

#: The key of the scaler's state in the torch optimizer's first parameter group (ZeRO 0).
GROUP_KEY = "lossscale"


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


def carry_zero(engine: Any, old: Any, scaler: DeepSpeedLossScaler) -> None:
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


def hook_group_state(optimizer: Any, scaler: DeepSpeedLossScaler | GradScaler) -> None:
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


def carry_zero0_fp16(engine: Any, optimizer: Any, scaler: DeepSpeedLossScaler) -> None:
    """ZeRO-0 fp16: lossscale's state from the parameter group, else DeepSpeed's fields."""
    state = _group_state(_torch_optimizer(optimizer))
    if state is not None:
        _carry_state(scaler, state)
        return
    config = optimizer.loss_scale_config
    if config.dynamic_loss_scale and config.cur_iter > 0:
        stable = config.cur_iter - config.last_overflow_iter - 1
        _load_converted(scaler, config.cur_scale, stable, 0, int(engine.skipped_steps))


def carry_zero0_autocast(optimizer: Any, grad_scaler: GradScaler) -> None:
    """ZeRO-0 torch_autocast: the GradScaler state DeepSpeed restored into the parameter group."""
    state = _group_state(_torch_optimizer(optimizer))
    if state is not None:
        grad_scaler.load_state_dict(state)
