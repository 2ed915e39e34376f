"""The scalers ``install`` puts in ``accelerator.scaler``: lossscale's :class:`GradScaler` and
:class:`ShardedGradScaler`, and a ``step()`` with no scaled loss behind it (the dummy step of a
checkpoint load) passed through without counting as a training iteration."""

from __future__ import annotations

from typing import Any

import torch

from lossscale.torch import GradScaler, ShardedGradScaler

__all__ = ["AcceleratorGradScaler", "AcceleratorShardedGradScaler"]


class _TrainingStepsOnly:
    """A step is a training iteration only when ``scale()`` (or ``unscale_``) ran since the
    last ``update()``: Accelerate scales every training loss in ``accelerator.backward``. A
    ``step(optimizer)`` with neither behind it has gradients that this scaler never scaled,
    such as the zero gradients of the optimizer step that ``torch.distributed.checkpoint``'s
    ``set_optimizer_state_dict`` runs (at learning rate 0) to create the optimizer's state
    before loading it: the optimizer steps as it is, and the ``update()`` after it changes
    nothing (no growth count, no skip, the scale as loaded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scaled_since_update = False
        self._passed_through = False
        self.passed_through_steps = 0

    def scale(self, outputs: Any) -> Any:
        result = super().scale(outputs)  # type: ignore[misc]
        self._scaled_since_update = self.is_enabled()  # type: ignore[attr-defined]
        return result

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)  # type: ignore[misc]
        self._scaled_since_update = self.is_enabled()  # type: ignore[attr-defined]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self._scaled_since_update or not self.is_enabled():  # type: ignore[attr-defined]
            return super().step(optimizer, *args, **kwargs)  # type: ignore[misc]
        self._passed_through = True
        self.passed_through_steps += 1
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        passed, self._passed_through = self._passed_through, False
        scaled, self._scaled_since_update = self._scaled_since_update, False
        if new_scale is None and passed and not scaled:
            return  # no training iteration since the last update: nothing to count
        super().update(new_scale)  # type: ignore[misc]


class AcceleratorGradScaler(_TrainingStepsOnly, GradScaler):
    """:class:`lossscale.torch.GradScaler` as ``accelerator.scaler`` (what
    :func:`lossscale.accelerate.install` builds where Accelerate would build
    ``torch.amp.GradScaler``): the same constructor, methods, checkpoints and rule, and one
    difference. A ``step(optimizer)`` with no ``scale()`` or ``unscale_()`` since the last
    ``update()`` — the zero-gradient step ``torch.distributed.checkpoint`` runs at learning rate
    0 to create an optimizer's state before loading it into an FSDP2 model, which Accelerate's
    prepared optimizer routes through its scaler — calls ``optimizer.step`` as it is and the
    ``update()`` after it changes nothing: the scale and counters stay as loaded (torch's
    scaler counts it as a finite iteration and may grow). Counted in
    :attr:`passed_through_steps`.

    Every training iteration goes through ``accelerator.backward`` (``scale``) first, so it is
    never mistaken for one; a hand-written loop that steps without scaling its loss gets the
    same pass-through (its gradients were never scaled, so none is unscaled or checked).

    >>> import torch
    >>> from lossscale.accelerate import AcceleratorGradScaler
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.Adam([w], lr=0.0)
    >>> scaler = AcceleratorGradScaler("cpu", init_scale=1024.0, growth_interval=1)
    >>> w.grad = torch.zeros(2)                     # the checkpoint load's dummy step
    >>> scaler.step(opt); scaler.update()
    >>> scaler.get_scale(), scaler.passed_through_steps, sorted(opt.state[w])
    (1024.0, 1, ['exp_avg', 'exp_avg_sq', 'step'])
    >>> scaler.scale((w**2).sum()).backward()      # a training iteration
    >>> scaler.step(opt); scaler.update()
    >>> scaler.get_scale()                          # growth_interval=1: grew
    2048.0
    """

    passed_through_steps: int


class AcceleratorShardedGradScaler(_TrainingStepsOnly, ShardedGradScaler):
    """:class:`lossscale.torch.ShardedGradScaler` (torch's constructor order) as
    ``accelerator.scaler`` under FSDP1, where Accelerate builds torch's ``ShardedGradScaler``;
    the step without a scaled loss passes through as in :class:`AcceleratorGradScaler`.

    >>> import torch
    >>> from lossscale.accelerate import AcceleratorShardedGradScaler
    >>> scaler = AcceleratorShardedGradScaler("cpu", 1024.0, 0.25)  # backoff_factor third
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.1)
    >>> w.grad = torch.zeros(2)                   # a step with no scaled loss behind it
    >>> scaler.step(opt); scaler.update()
    >>> scaler.get_scale(), scaler.passed_through_steps
    (1024.0, 1)
    """

    passed_through_steps: int
