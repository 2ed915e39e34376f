"""``ShardedGradScaler``: a drop-in for torch's FSDP1 scaler, on ``GradScaler``'s engine."""

from __future__ import annotations

from typing import Any

import torch

from lossscale.core._stall import DEFAULT_STALL_STEPS
from lossscale.core._validation import FLOAT32_MAX
from lossscale.torch._scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """A drop-in for ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``.

    torch's constructor in torch's positional order (``backoff_factor`` before
    ``growth_factor``, unlike :class:`GradScaler`), then lossscale's keyword-only extensions.
    Everything else is :class:`GradScaler`: the same methods, checkpoints (torch's keys; they
    load into torch's scalers and back), rule, floor, stall alarm and private compatibility
    surface. As torch's, it accepts float16 gradients (FSDP1 with float16 parameters),
    checks gradients offloaded to the CPU where they live and agrees on the scale's device,
    and agrees over ``process_group`` (the default group when torch.distributed is
    initialised) before any rank applies a step, so every rank skips together. As torch's
    ``unscale_``, the agreement is one ``SUM`` all-reduce of the ranks' non-finite flags in
    place: ``_found_inf_per_device(optimizer)`` then reads, on every rank, how many ranks of
    the group overflowed (non-zero everywhere when any did). The step is decided on that sum
    clamped to 1.0 (torch's passes the sum itself to a fused optimizer, which misreads 2.0 as
    "apply" when two ranks overflow). A user's ``MAX`` all-reduce of those flags before
    ``step`` changes nothing (they are equal on every rank). A rank that holds no gradient for an
    optimizer's parameters (an empty shard under ``use_orig_params=True``) checks nothing,
    takes part in the agreement with a finite flag, and skips or applies with the others, as
    torch's (:class:`GradScaler` raises there, as torch's). For the verl-style swap::

        from lossscale.torch import ShardedGradScaler   # was: torch.distributed.fsdp...
        scaler = ShardedGradScaler(growth_interval=400)

    Host syncs, device work and skipped steps: as :class:`GradScaler`.

    >>> import torch
    >>> from lossscale.torch import ShardedGradScaler
    >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))   # FSDP1's float16 params
    >>> opt = torch.optim.SGD([w], lr=0.5)
    >>> scaler = ShardedGradScaler("cpu", 1024.0, 0.25)             # backoff_factor third
    >>> w.grad = torch.tensor([float("inf"), 1024.0], dtype=torch.float16)
    >>> scaler.step(opt) is None; scaler.update()                   # skipped, backs off x0.25
    True
    >>> w.tolist(), scaler.get_scale(), int(scaler.skipped_steps)
    ([1.0, 1.0], 256.0, 1)

    Args:
      device, init_scale, backoff_factor, growth_factor, growth_interval, enabled: torch's.
      process_group: the group whose ranks agree; None (the default): the default group when
        torch.distributed is initialised (torch's default, ``dist.group.WORLD``).
      min_loss_scale, max_loss_scale, hysteresis, hysteresis_refill: keyword-only, as
        :class:`GradScaler`'s.
      stall_steps, on_stall, device_side_skip: keyword-only, as :class:`GradScaler`'s.

    Raises:
      TypeError / ValueError: an argument of the wrong type or out of range, naming it;
        ``growth_factor`` in (0, 1) with ``backoff_factor`` > 1 names the argument order
        (GradScaler's positional order given to this class).
    """

    _checks_without_gradients = True

    _SIGNATURE = (
        "ShardedGradScaler(device, init_scale, backoff_factor, growth_factor, growth_interval, "
        "enabled, process_group)"
    )
    _ORDER = "backoff_factor before growth_factor (torch's ShardedGradScaler order)"
    _OTHER = "GradScaler"

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        *,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = FLOAT32_MAX,
        hysteresis: int = 1,
        hysteresis_refill: str = "on_backoff",
        stall_steps: int | None = DEFAULT_STALL_STEPS,
        on_stall: str = "warn",
        device_side_skip: bool = False,
    ) -> None:
        super().__init__(
            device,
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            enabled,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            hysteresis_refill=hysteresis_refill,
            stall_steps=stall_steps,
            on_stall=on_stall,
            process_group=process_group,
            device_side_skip=device_side_skip,
        )

    def _agree_found(self, step: Any, found: torch.Tensor) -> tuple[Any, Any]:
        """torch's ``ShardedGradScaler.unscale_``: the flags ``SUM``-all-reduced in place over
        the group (one collective), so ``_found_inf_per_device`` shows the number of ranks that
        overflowed; the step's decision is that sum clamped to 1.0 (one kernel, no sync)."""
        group = step.agreement_group()
        if group is None:
            return found, None
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.SUM, group=group)
        return found, torch.clamp(found, max=1.0)
