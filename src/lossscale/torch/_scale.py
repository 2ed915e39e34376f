"""The simple modes of a torch front end's loss scale: :class:`DisabledScale` (a null object),
and :class:`Scale`, a 0-d float32 tensor on a device with its reciprocal, fixed
(:class:`FixedScale`) or the base of :class:`~lossscale.torch._state.DynamicScale`."""

from __future__ import annotations

from typing import Any

import torch

from lossscale.core._checkpoint import read_fixed_state, scale_state_dict


class DisabledScale:
    """``enabled=False``: no loss-scale tensors, checks or syncs; the scale reads 1."""

    enabled = False
    dynamic = False
    may_drop_below_one = False
    applied_host: bool | None = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def scale(self) -> torch.Tensor:
        """A new 0-d float32 1.0 per read."""
        return torch.ones((), device=self.device)

    def scale_snapshot(self) -> torch.Tensor:
        return self.scale

    @property
    def applied(self) -> torch.Tensor:
        return torch.ones((), dtype=torch.bool, device=self.device)

    @property
    def skipped(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64, device=self.device)


class Scale:
    """What the enabled modes share: the scale as a 0-d float32 tensor on ``device`` and its
    float32 reciprocal, and the record of the last step on the host."""

    enabled = True
    dynamic: bool

    def __init__(self, initial_scale: float, device: torch.device) -> None:
        self.initial_scale = initial_scale
        self.device = device
        self._scale = torch.full((), initial_scale, dtype=torch.float32, device=device)
        self._inv: torch.Tensor | None = None
        #: whether the last step applied, when known on the host (None after a device step)
        self.applied_host: bool | None = True

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, 0-d float32 on ``device`` (no sync, no copy)."""
        return self._scale

    def scale_snapshot(self) -> torch.Tensor:
        """The scale as a tensor that later steps never modify."""
        return self._scale

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` in float32, computed once per scale (one tiny kernel then; no sync).
        It equals torch's GradScaler's float64 reciprocal rounded to float32 (double rounding
        is innocuous for division when 53 >= 2 * 24 + 2)."""
        if self._inv is None:
            self._inv = torch.reciprocal(self._scale)
        return self._inv

    def _set_scale_tensor(self, value: float) -> None:
        self._scale = torch.full((), value, dtype=torch.float32, device=self.device)
        self._inv = None

    @property
    def may_drop_below_one(self) -> bool:
        """Whether the scale can ever be < 1 (then unscaling can overflow float16 grads)."""
        return self.initial_scale < 1

    def move_to(self, device: torch.device) -> None:
        """Move the state to ``device`` (device to device, no host sync)."""
        self.device = device
        self._scale = self._scale.to(device, non_blocking=True)
        self._inv = None

    @property
    def applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last step applied (no sync; a new tensor)."""
        return torch.full((), bool(self.applied_host), dtype=torch.bool, device=self.device)


class FixedScale(Scale):
    """A fixed scale: every step applies, non-finite gradients included (TensorFlow's)."""

    dynamic = False

    @property
    def skipped(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64, device=self.device)

    def state_dict(self) -> dict[str, Any]:
        return scale_state_dict(self.initial_scale)

    def check_state_dict(self, state: Any) -> None:
        """Validate a checkpoint dict against this scale (ValueError naming the key)."""
        read_fixed_state(state, self.initial_scale)
