"""One loss-scale decision for a Megatron ``ChainedOptimizer``: one scaler, shared by every
sub-optimizer, updated once per step with the flag agreed over all of them."""

from __future__ import annotations

from typing import Any

import torch

from lossscale.megatron._scale import ScalerBase
from lossscale.megatron._scaler import ConstantGradScaler, DynamicGradScaler

#: The attributes that hold a Megatron optimizer's sub-optimizers: ``ChainedOptimizer``'s, and
#: ``MimoOptimizer``'s (the optimizers of the modules active on this rank).
CHAINS = ("chained_optimizers", "_active_optimizers")


def _chain(node: Any) -> Any:
    for name in CHAINS:
        chain = getattr(node, name, None)
        if chain is not None:
            return chain
    return None


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers under ``optimizer`` that hold a grad scaler, in Megatron's order: the
    leaves of ``chained_optimizers`` (or a ``MimoOptimizer``'s ``_active_optimizers``; nested
    chains flattened, each optimizer once) whose ``grad_scaler`` is not None; ``[optimizer]``
    itself when it is not a chain and has one.

    Raises:
      TypeError: ``optimizer`` has no sub-optimizers and no ``grad_scaler``.
    """
    if _chain(optimizer) is None and not hasattr(optimizer, "grad_scaler"):
        raise TypeError(
            "optimizer must be a Megatron optimizer (a ChainedOptimizer, a MimoOptimizer or an "
            f"optimizer with a grad_scaler attribute), got {type(optimizer).__name__}"
        )
    found: list[Any] = []
    seen: set[int] = set()

    def walk(node: Any) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        chain = _chain(node)
        if chain is not None:
            for child in chain:
                walk(child)
        elif getattr(node, "grad_scaler", None) is not None:
            found.append(node)

    walk(optimizer)
    return found


def from_megatron(scaler: Any) -> DynamicGradScaler | ConstantGradScaler:
    """lossscale's scaler with the settings and state of Megatron's ``scaler`` (duck-typed: a
    ``DynamicGradScaler`` has ``growth_interval`` and ``hysteresis``, a ``ConstantGradScaler``
    only ``scale``), on the device of its scale. Reads its tensors (a host sync on a GPU).

    Raises:
      TypeError: ``scaler`` has no ``scale``.
      ValueError: its values are out of lossscale's ranges (e.g. a scale that overflowed).
    """
    if isinstance(scaler, DynamicGradScaler | ConstantGradScaler):
        return scaler
    scale = getattr(scaler, "scale", None)
    if scale is None:
        raise TypeError(f"scaler must be a grad scaler with a scale, got {type(scaler).__name__}")
    device = getattr(scale, "device", None)

    def number(value: Any) -> Any:
        return value.item() if hasattr(value, "item") else value

    if not (hasattr(scaler, "growth_interval") and hasattr(scaler, "hysteresis")):
        return ConstantGradScaler(float(number(scale)), device=device)
    ours = DynamicGradScaler(
        float(number(scale)),
        float(number(scaler.min_scale)),
        float(number(scaler.growth_factor)),
        float(number(scaler.backoff_factor)),
        scaler.growth_interval,
        scaler.hysteresis,
        device=device,
    )
    ours.load_state_dict(scaler.state_dict())
    return ours


def share_grad_scaler(
    optimizer: Any,
    scaler: DynamicGradScaler | ConstantGradScaler | None = None,
    *,
    process_group: Any = None,
) -> DynamicGradScaler | ConstantGradScaler:
    """Give every sub-optimizer of a Megatron optimizer one lossscale grad scaler, updated once
    per step with the OR of their flags.

    Megatron-core's ``get_megatron_optimizer`` builds one scaler per sub-optimizer (dense and
    expert parameters, each model chunk); each sub-optimizer's ``prepare_grads`` updates its own
    with its own flag, so after an overflow in one of them the scales differ (``[4.0, 8.0]``)
    while the loss is scaled by the first one's. Here each of those sub-optimizers gets the same
    ``scaler`` object (``o.grad_scaler = scaler``), and its ``update`` calls within one step,
    one per sub-optimizer, collapse into one: the flags are OR-ed and the rule runs once, when
    the last sub-optimizer has reported. Until then ``scale`` and ``inv_scale`` do not change,
    so every sub-optimizer unscales its gradients by the scale the loss was scaled with.

    Across ranks this relies on Megatron by default: each sub-optimizer all-reduces its flag
    (``MAX``) over its gradient-statistics group before ``update``, so ranks whose
    sub-optimizers' groups cover them all see the same flags and reach the same scale, and the
    scaler adds no collective. Where they do not, as with a ``MimoOptimizer`` whose modules
    live on disjoint ranks (it agrees on the flag over the world only after the scalers were
    updated), pass ``process_group``: the step's flag is then MAX-reduced over it before the
    one update. Unlike ``lossscale.torch``'s ``process_group``, None here means no collective.

    Args:
      optimizer: ``get_megatron_optimizer``'s result: a ``ChainedOptimizer`` (nested chains are
        flattened), a ``MimoOptimizer`` (its active optimizers) or a single optimizer. The
        sub-optimizers that share are those whose ``grad_scaler`` is not None (a bf16
        optimizer without loss scaling keeps none).
      scaler: the scaler to share. None: the first sharing sub-optimizer's scaler, when it is
        already lossscale's, else a lossscale scaler with the settings and state of Megatron's
        (read from its tensors: a host sync on a GPU), on its device.
      process_group: keyword-only; a ``torch.distributed`` group (e.g.
        ``torch.distributed.group.WORLD``) over which each step's flag is MAX-reduced before the
        update: one all-reduce of one element and one read (a host sync on a GPU) per step, on
        every rank of the group, each of which must share a scaler this way, every step (a
        ``ConstantGradScaler`` never changes and makes none). None (the default): no
        collective.

    Returns:
      The shared scaler. Call this again after changing the sub-optimizers.

    With a shared scaler, every sub-optimizer's checkpoint holds the same scaler state; loading
    a checkpoint whose sub-optimizers' scalers had diverged keeps the last one loaded.

    Raises:
      TypeError: ``optimizer`` is not a Megatron optimizer; ``scaler`` is not lossscale's;
        ``process_group`` is not a process group.
      ValueError: no sub-optimizer has a grad scaler while ``scaler`` is None or a
        ``process_group`` is given (this rank would never take part in the agreement).

    Example:
      >>> from types import SimpleNamespace
      >>> from lossscale.megatron import DynamicGradScaler, share_grad_scaler
      >>> dense = SimpleNamespace(grad_scaler=DynamicGradScaler(8.0, hysteresis=1, device="cpu"))
      >>> expert = SimpleNamespace(grad_scaler=DynamicGradScaler(8.0, hysteresis=1, device="cpu"))
      >>> chained = SimpleNamespace(chained_optimizers=[dense, expert])
      >>> shared = share_grad_scaler(chained)
      >>> dense.grad_scaler is expert.grad_scaler is shared
      True
      >>> dense.grad_scaler.update(True)     # dense overflowed: nothing applied yet
      >>> expert.grad_scaler.scale
      tensor([8.])
      >>> expert.grad_scaler.update(False)   # the last report: one update, with the OR
      >>> shared.scale, shared.pending_reports
      (tensor([4.]), 0)
    """
    subs = sub_optimizers(optimizer)
    if process_group is not None:
        dist: Any = torch.distributed
        if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
            raise TypeError(
                "process_group must be a torch.distributed process group or None, got "
                f"{process_group!r}"
            )
        if not subs:
            raise ValueError(
                "process_group is given but no sub-optimizer of optimizer has a grad_scaler: "
                "this rank would never take part in the agreement"
            )
    if scaler is None:
        if not subs:
            raise ValueError(
                "no sub-optimizer of optimizer has a grad_scaler (bf16 without loss scaling?); "
                "pass the scaler to share"
            )
        scaler = from_megatron(subs[0].grad_scaler)
    elif not isinstance(scaler, ScalerBase):
        raise TypeError(
            "scaler must be a lossscale.megatron DynamicGradScaler or ConstantGradScaler, got "
            f"{type(scaler).__name__}"
        )
    for sub in subs:
        sub.grad_scaler = scaler
    scaler.share(len(subs), process_group)
    return scaler
