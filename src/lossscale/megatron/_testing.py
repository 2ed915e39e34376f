"""The test toolbox of :mod:`lossscale.megatron` (kept out of the wheel).

:class:`MegatronDynamicPort` is Megatron-core 0.19.2's ``megatron/core/optimizer/grad_scaler.py``
(``MegatronGradScaler.__init__`` / ``scale`` / ``inv_scale`` L17-28, ``DynamicGradScaler``
L84-165), rewritten with torch ops on one-element float32 tensors exactly as Megatron keeps them,
with one change: ``device=`` where Megatron hard-codes ``'cuda'`` (L20, L111, L114, L117, L163),
so that it runs on the CPU. megatron-core itself is not installed (it needs Python >= 3.12 and
triton). Used as the oracle by the scaler's and the chained optimizer's tests.
"""

from __future__ import annotations

from typing import Any

import torch


class MegatronDynamicPort:
    """Megatron-core 0.19.2 ``DynamicGradScaler`` (grad_scaler.py L17-28, L84-165) on
    ``device``, its arithmetic unchanged (torch float32 tensors)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: Any,
        hysteresis: int,
        device: str = "cpu",
    ) -> None:
        self.device = device
        self._scale = torch.tensor([initial_scale], dtype=torch.float, device=device)  # L20
        self.min_scale = torch.tensor([min_scale], dtype=torch.float, device=device)  # L111
        self.growth_factor = torch.tensor([growth_factor], dtype=torch.float, device=device)
        self.backoff_factor = torch.tensor([backoff_factor], dtype=torch.float, device=device)
        self.growth_interval = growth_interval  # L121
        self.hysteresis = hysteresis  # L125
        self._growth_tracker = 0  # L128
        self._hysteresis_tracker = self.hysteresis  # L129

    @property
    def scale(self) -> torch.Tensor:  # L22-24
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:  # L26-28
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:  # L131-153
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:  # L155-160
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # L162-165
        self._scale = state_dict["scale"].to(self.device)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]
