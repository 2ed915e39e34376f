"""What lossscale's tools read of a loss scaler: one small protocol, :class:`ScaleReader`, and
:func:`scale_reader`, which reads the framework scalers lossscale does not ship through it."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["ScaleReader", "scale_reader"]


@runtime_checkable
class ScaleReader(Protocol):
    """What :class:`~lossscale.torch.NumericsMonitor` and the framework helpers (Lightning's
    :func:`~lossscale.torch.lightning.last_step_applied`, the DeepSpeed callbacks for Hugging
    Face and Lightning, Accelerate's loops) read of a loss scaler.

    Every scaler lossscale ships satisfies it: :class:`~lossscale.torch.GradScaler`,
    :class:`~lossscale.torch.ShardedGradScaler`, :class:`~lossscale.torch.LossScaleOptimizer`,
    :class:`lossscale.deepspeed.DeepSpeedLossScaler` and the Megatron classes
    (``lossscale.megatron.DynamicGradScaler``, ``ConstantGradScaler``). Check with
    ``isinstance(scaler, ScaleReader)``.

    Example:
      >>> from lossscale.torch import GradScaler, ScaleReader
      >>> scaler = GradScaler("cpu", init_scale=1024.0)
      >>> isinstance(scaler, ScaleReader), scaler.current_loss_scale()
      (True, tensor(1024.))
    """

    def current_loss_scale(self) -> torch.Tensor | float:
        """The scale the next backward pass is multiplied by, without a host sync: a tensor on
        the scaler's device (one element; not a copy, so read it before the next step changes
        it), or a Python float where the scaler keeps its scale on the host. 1.0 (or a tensor
        of 1.0) when scaling is disabled."""
        ...

    def read_last_step_applied(self) -> bool:
        """Whether the last step was applied (False: skipped for a non-finite gradient), as a
        Python bool; True before any step. May read a device flag (a host sync on a GPU) where
        the step's decision stayed on the device."""
        ...


class _ForeignScaler:
    """A framework's own scaler read through :class:`ScaleReader`: its scale, and a clear error
    for the skip, which it does not report."""

    def __init__(self, scaler: Any, scale: Any, what: str) -> None:
        self._scaler, self._scale, self._what = scaler, scale, what

    def current_loss_scale(self) -> torch.Tensor | float:
        return self._scale(self._scaler)  # type: ignore[no-any-return]

    def read_last_step_applied(self) -> bool:
        raise TypeError(
            f"{self._what} does not report whether a step was skipped; lossscale's scalers do "
            "(lossscale.torch.GradScaler, lossscale.deepspeed.install, lossscale.megatron)"
        )


def _torch_amp_scale(scaler: Any) -> Any:
    # torch.amp.GradScaler has no public sync-free read of its scale tensor (get_scale()
    # syncs); before its first scale() it has no tensor, and get_scale() is init_scale (or 1.0
    # when disabled) without a sync
    scale = scaler._scale if scaler.is_enabled() else None
    return scaler.get_scale() if scale is None else scale


def scale_reader(scaler: Any, name: str = "scaler") -> ScaleReader | None:
    """``scaler`` as a :class:`ScaleReader`: itself when it is one; None for None (no loss
    scaling); the frameworks' own scalers through a small adapter that reads their scale
    without a sync: ``torch.amp.GradScaler`` (and ``ShardedGradScaler``), DeepSpeed's loss
    scalers (``cur_scale``: a host float) and Megatron-core's grad scalers (``scale``: a
    one-element tensor). Their adapters raise TypeError from ``read_last_step_applied``: those
    scalers do not know whether a step was skipped. Recognised by their attributes, so no
    framework is imported.

    Raises:
      TypeError: ``scaler`` is none of these, naming its type and ``name``.

    Example:
      >>> import torch
      >>> from lossscale.torch import scale_reader
      >>> float(scale_reader(torch.amp.GradScaler("cpu", init_scale=8.0)).current_loss_scale())
      8.0
    """
    if scaler is None or isinstance(scaler, ScaleReader):
        return scaler
    kind = f"{type(scaler).__module__}.{type(scaler).__qualname__}"
    if isinstance(scaler, torch.amp.GradScaler):
        return _ForeignScaler(scaler, _torch_amp_scale, kind)
    if hasattr(scaler, "update_scale") and hasattr(scaler, "cur_scale"):  # DeepSpeed's
        return _ForeignScaler(scaler, lambda s: float(s.cur_scale), kind)
    scale = getattr(scaler, "scale", None)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and hasattr(scaler, "inv_scale"):
        return _ForeignScaler(scaler, lambda s: s.scale.reshape(()), kind)  # Megatron's
    raise TypeError(
        f"{name} must be a lossscale GradScaler, ShardedGradScaler, LossScaleOptimizer, "
        "DeepSpeedLossScaler or Megatron scaler (a lossscale.torch.ScaleReader), a "
        f"torch.amp.GradScaler, DeepSpeed's or Megatron-core's own scaler, or None, got {kind}"
    )
