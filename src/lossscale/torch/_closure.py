"""Steps beyond one backward pass: closures (LBFGS) and optimizers that skip together (GANs).

Both drive :class:`~lossscale.torch._optimizer.LossScaleOptimizer`'s two step halves (its
private ``_prepare`` / ``_finish`` and the engine's kernels); the rule and the checks are the
engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from lossscale.torch import _engine as engine

if TYPE_CHECKING:
    from lossscale.torch._optimizer import LossScaleOptimizer


def _clone_state(value: Any) -> Any:
    """A copy of an optimizer state value: tensors cloned, lists/tuples/dicts copied through."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_clone_state(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone_state(v) for k, v in value.items()}
    return value


def step_with_closure(opt: LossScaleOptimizer, closure: Callable[[], Any]) -> Any:
    """``opt.step(closure)`` (see :meth:`LossScaleOptimizer.step`): evaluate, decide on the
    host (one sync), step with a closure that replays the first evaluation, and undo the step
    if a later evaluation overflowed."""
    found_total = torch.zeros((), device=opt._device)

    def evaluate() -> Any:
        with torch.enable_grad():
            loss = closure()
        with torch.no_grad():
            found_total.add_(opt._unscale_all())
        return loss

    opt._pending.unscaled_found = None
    first_loss = evaluate()
    opt._check_scaled()
    ls = cast(engine.ScaleState, opt._ls)
    if not ls.dynamic:
        opt._inner.step(lambda: first_loss)
        ls.record_fixed()
        return first_loss
    group = [opt._group()]
    if bool(engine.agree(found_total, group).item()):  # the decision: one host sync
        ls.record_host(False)
        ls.check_stall(stacklevel=4)  # here, step, torch's step hooks, the user
        return first_loss
    snapshot = _snapshot(opt)
    evaluations = [0]

    def replay() -> Any:
        evaluations[0] += 1
        return first_loss if evaluations[0] == 1 else evaluate()

    opt._inner.step(replay)
    with torch.no_grad():
        applied = not bool(engine.agree(found_total, group).item())
        if not applied:  # a later evaluation (line search) overflowed: undo the step
            _restore(opt, snapshot)
        ls.record_host(applied)
        ls.check_stall(stacklevel=4)
    return first_loss


def _snapshot(opt: LossScaleOptimizer) -> dict[str, Any]:
    """Copies of the parameters and of the inner state (containers included)."""
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    # Containers are copied too: LBFGS keeps lists of tensors (old_dirs, al) that it
    # appends to and assigns into in place.
    state = {p: {k: _clone_state(v) for k, v in s.items()} for p, s in opt.state.items()}
    return {"params": params, "state": state}


def _restore(opt: LossScaleOptimizer, snapshot: dict[str, Any]) -> None:
    """Put back what :func:`_snapshot` copied."""
    flat = [p for g in opt.param_groups for p in g["params"]]
    for p, saved in zip(flat, snapshot["params"], strict=True):
        p.copy_(saved)
    opt.state.clear()
    opt.state.update(snapshot["state"])


def step_together(*optimizers: LossScaleOptimizer) -> torch.Tensor:
    """Step several LossScaleOptimizers (a GAN's) so that they all apply or all skip.

    Each unscales and checks its own gradients; if any of them found a non-finite gradient,
    every one skips and backs off. Under torch.distributed the combined flag is all-reduced
    once per distinct process group of the optimizers, so "any" spans all ranks too. Returns
    the shared ``should_apply`` (0-d bool tensor). Host syncs: one per unfused optimizer, none
    for fused ones.

    >>> import torch
    >>> from lossscale.torch import LossScaleOptimizer, step_together
    >>> g, d = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    >>> g_opt = LossScaleOptimizer(torch.optim.SGD([g], lr=0.1), initial_scale=8.0)
    >>> d_opt = LossScaleOptimizer(torch.optim.SGD([d], lr=0.1), initial_scale=8.0)
    >>> g.grad, d.grad = torch.full((2,), 8.0), torch.tensor([8.0, float("nan")])
    >>> bool(step_together(g_opt, d_opt))        # d overflowed: both skip
    False
    >>> g.tolist(), float(g_opt.loss_scale), float(d_opt.loss_scale)
    ([1.0, 1.0], 4.0, 4.0)
    """
    from lossscale.torch._optimizer import LossScaleOptimizer  # the class imports this module

    if not optimizers or not all(isinstance(o, LossScaleOptimizer) for o in optimizers):
        raise TypeError("step_together takes one or more LossScaleOptimizer instances")
    disabled = [o for o in optimizers if o._ls is None]
    for o in disabled:  # disabled: their inner step, nothing to agree on
        o._inner.step()
    optimizers = tuple(o for o in optimizers if o._ls is not None)
    if not optimizers:
        return torch.ones((), dtype=torch.bool, device=disabled[0]._device)
    with torch.no_grad():
        for o in optimizers:
            o._check_scaled()
        prepared = [o._prepare() for o in optimizers]
        founds = [found for found, _ in prepared]
        device = founds[0].device
        # amax, not a sum: each flag is 0.0 or 1.0 and fused optimizers skip only on 1.0
        total = torch.stack([f.to(device, non_blocking=True) for f in founds]).amax()
        engine.agree(total, [o._group() for o in optimizers])
        for o, (_, unscaled) in zip(optimizers, prepared, strict=True):
            o._finish(total.to(o._device, non_blocking=True), unscaled)
            # What torch's LR schedulers check for their "lr_scheduler.step() before
            # optimizer.step()" warning: this counts as a step of each optimizer.
            o._opt_called = True  # type: ignore[attr-defined]
    return total == 0
