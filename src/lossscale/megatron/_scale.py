"""What Megatron-core's two grad scalers share: the scale and its reciprocal on the device, the
collection of a shared scaler's reports within a step, and the checks of their arguments."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lossscale.core import _validation as v


def default_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``; None: CUDA's current device when CUDA is available
    (what Megatron's ``device='cuda'`` means), else the CPU.

    Raises:
      TypeError: not None, a string, an int or a ``torch.device``.
      ValueError: a string torch does not read as a device.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, str | int):
        raise TypeError(f"device must be a torch.device, a string or an int, got {device!r}")
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device={device!r} is not a device: {error}") from None


def read_found_inf(found_inf: Any) -> bool:
    """``update``'s argument as a Python bool: a bool (Megatron's, already read on the host),
    or a one-element tensor, nonzero (or NaN) when a gradient was not finite (one read: a host
    sync on a GPU).

    Raises:
      TypeError: neither a bool nor a tensor (an int 0/1 is refused: it may be a count).
      ValueError: a tensor with more than one element.
    """
    if isinstance(found_inf, bool | np.bool_):
        return bool(found_inf)
    check_found_inf(found_inf)
    return bool(found_inf.item() != 0)


def check_found_inf(found_inf: Any) -> None:
    """The type and shape checks of :func:`read_found_inf`, without reading a tensor's value."""
    if isinstance(found_inf, bool | np.bool_):
        return
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(
            "found_inf must be a bool or a one-element tensor, got "
            f"{found_inf!r} of type {type(found_inf).__name__}"
        )
    if found_inf.numel() != 1:
        raise ValueError(
            f"found_inf must be one flag for the step, got a tensor of shape "
            f"{tuple(found_inf.shape)}"
        )


def whole(name: str, value: Any, minimum: int) -> int:
    """An int ≥ ``minimum``; a float with an integral value is read as that int (Megatron-LM
    parses ``--loss-scale-window`` as a float and passes it on as ``growth_interval``)."""
    if isinstance(value, float) and value.is_integer():
        return v.integer(name, int(value), minimum)
    return v.integer(name, value, minimum)


def scale_value(name: str, value: Any) -> float:
    """A scale given as a number or a one-element floating tensor (read: a host sync on a GPU),
    as a Python float (not yet range-checked)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"{name} must be a one-element floating tensor or a number, got a "
                f"{value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return float(value.item())
    return v.real(name, value)


class ScalerBase:
    """What both scalers share: the scale and its reciprocal on the device."""

    def __init__(self, scale: float, device: torch.device) -> None:
        self._device = device
        self._set_scale(scale)
        # Reports per step: share_grad_scaler sets the number of sub-optimizers that call
        # update in one step; their flags are collected and applied once, OR-ed.
        self._reporters = 1
        self._pending = 0
        self._pending_found = False
        # share_grad_scaler(process_group=...): the step's flag is MAX-reduced over it
        self._group: Any = None
        # the last complete step's flag: a bool, or a tensor not read yet (ConstantGradScaler)
        self._last_found: bool | torch.Tensor = False

    def _set_scale(self, value: float) -> None:
        self._value = value
        self._scale = torch.full((1,), value, dtype=torch.float32, device=self._device)
        self._inv: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """The device of :attr:`scale` and :attr:`inv_scale`."""
        return self._device

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale: a one-element float32 tensor on :attr:`device`, as Megatron's.

        The tensor is replaced, never modified, when the scale changes (Megatron reassigns its
        ``_scale`` too): a tensor read before keeps its value. No sync, no allocation."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale``: a one-element float32 tensor on :attr:`device`, bit for bit
        Megatron's ``scale.double().reciprocal().float()``.

        Computed on the host from the scale's value and filled once per scale (one small
        allocation on the first read after a change; no sync); later reads return the same
        tensor."""
        if self._inv is None:
            inv = float(np.float32(1.0 / self._value))  # float64 reciprocal, then float32
            self._inv = torch.full((1,), inv, dtype=torch.float32, device=self._device)
        return self._inv

    def current_loss_scale(self) -> torch.Tensor:
        """:attr:`scale` as a 0-d view (no sync, no copy). With
        :meth:`read_last_step_applied`, what :class:`lossscale.torch.ScaleReader` reads."""
        return self._scale.reshape(())

    def read_last_step_applied(self) -> bool:
        """Whether the last step was applied: False when its flag reported a non-finite
        gradient, as Megatron's optimizer then skips the step (``DynamicGradScaler``: the last
        complete step's flag, OR-ed over a shared scaler's reports; ``ConstantGradScaler``: the
        flag last given to ``update``). True before any step. Reads a flag given as a tensor
        (a host sync on a GPU) where ``update`` did not."""
        found = self._last_found
        if isinstance(found, torch.Tensor):
            found = self._last_found = bool(found.item() != 0)
        return not found

    @property
    def pending_reports(self) -> int:
        """Reports of the current step collected so far by a shared scaler (see
        :func:`lossscale.megatron.share_grad_scaler`); 0 between steps, always 0 unshared."""
        return self._pending

    def share(self, reporters: int, group: Any = None) -> None:
        """Expect ``reporters`` reports per step (agreed over ``group`` when given) and drop the
        pending ones; :func:`lossscale.megatron.share_grad_scaler` calls it (call that instead).
        """
        self._reporters = max(reporters, 1)
        self._pending, self._pending_found = 0, False
        self._group = group

    def _collect(self, found: bool) -> bool | None:
        """The step's flag once every reporter has reported (OR of theirs), else None."""
        if self._reporters == 1:
            return found
        self._pending_found |= found
        self._pending += 1
        if self._pending < self._reporters:
            return None
        found, self._pending, self._pending_found = self._pending_found, 0, False
        return found
