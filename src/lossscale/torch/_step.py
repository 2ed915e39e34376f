"""One loss-scaled optimizer step, for every torch front end.

A :class:`Step` holds one optimizer, its gradient groups, the front end's loss scale and the
process group its ranks agree over. ``LossScaleOptimizer`` runs it whole (:meth:`Step.run`),
``GradScaler`` and ``ShardedGradScaler`` in their protocol's halves (check in ``unscale_``,
apply in ``step``, record in ``update``). Its parts, in order:

1. :meth:`Step.prepare`: check the gradients and unscale them, unless the optimizer will (the
   one place the fused/unfused decision is made, :meth:`Step.on_device`);
2. :meth:`Step.agree`: the ``MAX`` all-reduce of the flag over the process group;
3. :meth:`Step.apply`: the optimizer's step, or none when skipped;
4. :meth:`Step.record`: the scale's update by the rule, where the decision is known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lossscale.core._warnings import warn_user
from lossscale.torch import _engine as engine
from lossscale.torch._state import AnyScale, DisabledScale, DynamicScale


class Float16ParametersWarning(UserWarning):
    """Warned once per optimizer by lossscale.torch's scalers when it trains float16
    parameters (``model.half()`` fine-tuning, PEFT adapters or ``modules_to_save`` in
    float16): float16 master weights and optimizer state. Training goes on; the message names
    the parameters and the fix (float32 trained parameters under autocast, or float32 master
    weights).

    Example:
      >>> import warnings
      >>> import torch
      >>> from lossscale.torch import Float16ParametersWarning, GradScaler
      >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
      >>> opt, scaler = torch.optim.SGD([w], lr=0.1), GradScaler("cpu", init_scale=4.0)
      >>> scaler.scale(w.float().sum()).backward()
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     scaler.step(opt)
      >>> caught[0].category is Float16ParametersWarning, w.dtype, bool((w < 1).all())
      (True, torch.float16, True)
    """


class Step:
    """One optimizer's loss-scaled step over a front end's scale ``ls``.

    ``device_side_skip``: let a fused optimizer on a GPU skip in its kernel (no host sync);
    see :func:`~lossscale.torch._engine.device_decides`. ``where``: the front end's name, for
    warnings.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        ls: AnyScale,
        process_group: Any,
        device_side_skip: bool,
        where: str,
    ) -> None:
        self.optimizer = optimizer
        self.ls = ls
        self.process_group = process_group
        self.device_side_skip = device_side_skip
        self.where = where
        self.grads = engine.GradGroups()
        #: an ``unscale_()`` result waiting for the step (LossScaleOptimizer)
        self.unscaled_found: torch.Tensor | None = None
        #: a scaled loss (or a read of the scale) since the last step (LossScaleOptimizer)
        self.scaled = False
        self.warned_unscaled = False
        self.warned_float16 = False

    # -- the decision -----------------------------------------------------------------------
    def fused(self) -> bool:
        """Whether the optimizer takes ``grad_scale`` / ``found_inf`` (torch's protocol)."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def on_device(self) -> bool:
        """Whether this step is decided on the device: a fused optimizer with a dynamic scale
        where :func:`~lossscale.torch._engine.device_decides` says so, or one whose ``step``
        is not torch's (:func:`~lossscale.torch._engine.own_fused_protocol`), always."""
        ls = self.ls
        if not (isinstance(ls, DynamicScale) and self.fused()):
            return False
        optimizer = self.optimizer
        return engine.own_fused_protocol(optimizer) or engine.device_decides(
            ls.device, self.device_side_skip
        )

    def check(self, unscale: bool) -> torch.Tensor:
        """Check the gradients (and unscale them in place, ``unscale``): ``found_inf``, 0-d
        float32 on the scale's device, not yet agreed. One fused kernel per (device, dtype)
        group; a second, read-only pass when the scale may drop below 1; no sync."""
        ls = self.ls
        assert not isinstance(ls, DisabledScale)  # the front ends pass disabled steps through
        params = self.optimizer.param_groups
        if unscale:
            found = engine.unscale_and_check(self.grads, params, ls)
        else:
            found = engine.check_and_unscale(self.grads, params, None, ls.device)
        if not self.warned_float16:
            self.warn_if_float16()
        return found

    def warn_if_float16(self) -> None:
        """Warn once (:class:`Float16ParametersWarning`) when the optimizer trains float16
        parameters, naming them; the step goes on. Host work only."""
        trained = self.grads.float16_trained()
        if not trained:
            return
        self.warned_float16 = True
        groups = self.optimizer.param_groups
        names = [engine.param_name(groups, p) for p in trained[:4]]
        more = f" and {len(trained) - 4} more" if len(trained) > 4 else ""
        warn_user(
            f"{self.where}: {len(trained)} trained parameter{'s' * (len(trained) > 1)} "
            f"{'are' if len(trained) > 1 else 'is'} float16 ({', '.join(names)}{more}): the "
            "optimizer updates float16 weights and keeps its state in float16, so updates "
            "below a weight's float16 spacing are lost and Adam's second moment underflows "
            "below 6e-8 (torch.amp.GradScaler refuses these: 'Attempting to unscale FP16 "
            "gradients'). Training goes on. Keep the trained parameters in float32 and compute "
            "in float16 under torch.autocast (PEFT: float32 adapters, "
            "autocast_adapter_dtype=True), or keep float32 master weights (DeepSpeed's fp16: "
            "lossscale.deepspeed).",
            Float16ParametersWarning,
        )

    def prepare(self) -> tuple[torch.Tensor, bool]:
        """Check the gradients, and unscale them unless a fused optimizer will: the flag and
        whether the gradients are unscaled now.

        A step decided on the device gives the fused optimizer the scale as ``grad_scale``:
        the check is then the loss scaling's only pass over the gradients. Not when the scale
        may drop below 1 (unscaling then multiplies, and a finite scaled float16 gradient could
        overflow inside the kernel, unchecked): those are unscaled and checked here.
        """
        if self.unscaled_found is not None:
            found, self.unscaled_found = self.unscaled_found, None
            return found, True
        if self.on_device() and not self.ls.may_drop_below_one:
            return self.check(unscale=False), False
        return self.check(unscale=True), True

    def agreement_group(self) -> Any:
        """The group the flag is agreed over this step; None when there is nothing to agree on
        (a fixed scale never skips) or nobody to agree with."""
        if not isinstance(self.ls, DynamicScale):
            return None
        return engine.resolve_group(self.process_group)

    def agree(self, found: torch.Tensor) -> torch.Tensor:
        """``found`` ``MAX``-all-reduced in place over :meth:`agreement_group` (one
        collective; none without a group)."""
        return engine.agree(found, [self.agreement_group()])

    # -- apply and record -------------------------------------------------------------------
    def apply(
        self, found: torch.Tensor, unscaled: bool, *args: Any, **kwargs: Any
    ) -> tuple[Any, bool | None]:
        """The optimizer's step unless ``found`` says skip: ``(its result or None, applied)``,
        ``applied`` None when the decision stayed on the device.

        Decided on the host, the flag is read (the step's one host sync) and a skipped step
        does not call the optimizer. Decided on the device, the fused optimizer is called with
        ``found_inf`` and, unless ``unscaled``, the scale as ``grad_scale`` (times a
        ``grad_scale`` the optimizer already carries); no sync. A fixed scale always applies.
        """
        optimizer, ls = self.optimizer, self.ls
        if not isinstance(ls, DynamicScale):
            return optimizer.step(*args, **kwargs), True
        if self.on_device():
            grad_scale = None if unscaled else ls.scale
            carried = getattr(optimizer, "grad_scale", None)
            if carried is not None:
                grad_scale = carried if grad_scale is None else grad_scale * carried
            return engine.fused_step(optimizer, grad_scale, found, *args, **kwargs), None
        applied = not found.item()  # the step's one host sync (a memory read on the CPU)
        return (optimizer.step(*args, **kwargs) if applied else None), applied

    def record(self, found: torch.Tensor, applied: bool | None) -> None:
        """Update the scale by the rule: on the host when the decision was read there (no
        device work; the stall alarm checked with no extra read), else on the device."""
        ls = self.ls
        if not isinstance(ls, DynamicScale):
            ls.applied_host = True
        elif applied is None:
            ls.record_device(found)
        else:
            ls.record_host(applied)
            ls.check_stall()

    # -- whole steps (LossScaleOptimizer) ---------------------------------------------------
    def warn_if_unscaled(self) -> None:
        """Warn once when this step's gradients cannot have come from a scaled loss: the step
        would divide unscaled gradients by the scale (a framework calling ``backward()`` on
        the plain loss). Host work only."""
        if not self.scaled and not self.warned_unscaled:
            self.warned_unscaled = True
            warn_user(
                f"{self.where}.step(): no scaled loss since the last step (no "
                "get_scaled_loss, minimize or scaled closure), yet step() divides the gradients "
                "by the loss scale, so this update is that many times too small. If a framework "
                "calls backward() for you (Lightning, Accelerate, the HF Trainer, timm), give it "
                "lossscale.torch.GradScaler as its scaler and pass it the plain optimizer. If "
                "you scale the loss yourself, multiply it by opt.loss_scale (reading it counts "
                "as scaling).",
                UserWarning,
            )
        self.scaled = False

    def run(self, closure: Callable[[], Any] | None = None) -> Any:
        """A whole step (see ``LossScaleOptimizer.step``); the optimizer's own step when
        disabled."""
        if isinstance(self.ls, DisabledScale):
            return self.optimizer.step(closure)
        if closure is not None:
            return self._run_with_closure(closure)
        with torch.no_grad():
            self.warn_if_unscaled()
            found, unscaled = self.prepare()
            found = self.agree(found)
            _, applied = self.apply(found, unscaled)
            self.record(found, applied)
        return None

    def _run_with_closure(self, closure: Callable[[], Any]) -> Any:
        """Evaluate, decide on the host (one sync), step with a closure that replays the first
        evaluation, and undo the step if a later evaluation (a line search) overflowed."""
        ls = self.ls
        device = ls.device
        found_total = torch.zeros((), device=device)

        def evaluate() -> Any:
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                torch.maximum(found_total, self.check(unscale=True), out=found_total)
            return loss

        self.unscaled_found = None
        first_loss = evaluate()
        self.warn_if_unscaled()
        if not isinstance(ls, DynamicScale):
            self.optimizer.step(lambda: first_loss)
            self.record(found_total, True)
            return first_loss
        if bool(self.agree(found_total).item()):  # the decision: one host sync
            self.record(found_total, False)
            return first_loss
        snapshot = _snapshot(self.optimizer)
        evaluations = [0]

        def replay() -> Any:
            evaluations[0] += 1
            return first_loss if evaluations[0] == 1 else evaluate()

        self.optimizer.step(replay)
        with torch.no_grad():
            applied = not bool(self.agree(found_total).item())
            if not applied:  # a later evaluation overflowed: undo the step
                _restore(self.optimizer, snapshot)
            self.record(found_total, applied)
        return first_loss


def step_together(steps: Sequence[Step]) -> torch.Tensor:
    """Run ``steps`` so that they all apply or all skip: each checks its own gradients, the
    flags are combined (``amax``: each is 0.0 or 1.0) and agreed once per distinct process
    group, then each applies or skips and records. Returns ``should_apply`` (0-d bool)."""
    with torch.no_grad():
        for step in steps:
            step.warn_if_unscaled()
        prepared = [step.prepare() for step in steps]
        device = prepared[0][0].device
        total = torch.stack([f.to(device, non_blocking=True) for f, _ in prepared]).amax()
        engine.agree(total, [step.agreement_group() for step in steps])
        for step, (_, unscaled) in zip(steps, prepared, strict=True):
            found = total.to(step.ls.device, non_blocking=True)
            _, applied = step.apply(found, unscaled)
            step.record(found, applied)
    return total == 0


def _clone_state(value: Any) -> Any:
    """A copy of an optimizer state value: tensors cloned, lists/tuples/dicts copied through."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_clone_state(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone_state(v) for k, v in value.items()}
    return value


def _snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of the parameters and of the optimizer's state, containers included (LBFGS
    keeps lists of tensors that it appends to and assigns into in place)."""
    params = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    state = {p: {k: _clone_state(v) for k, v in s.items()} for p, s in optimizer.state.items()}
    return {"params": params, "state": state}


def _restore(optimizer: torch.optim.Optimizer, snapshot: dict[str, Any]) -> None:
    """Put back what :func:`_snapshot` copied."""
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    for p, saved in zip(flat, snapshot["params"], strict=True):
        p.copy_(saved)
    optimizer.state.clear()
    optimizer.state.update(snapshot["state"])
