"""``torch.amp.GradScaler``'s factor accessors, and the private members that code in the wild
reads (apex, Accelerate, training scripts that all-reduce ``_found_inf_per_device`` before
``step``), with torch's meaning, on lossscale's scalers. The private members are a
compatibility surface, not the recommended API: ``last_step_applied``, ``skipped_steps`` and
``read_last_step_applied()`` report skips."""

from __future__ import annotations

from typing import Any, cast

import torch

from lossscale.core import _validation as v
from lossscale.core._rule import DynamicRule, dynamic_rule
from lossscale.torch._persistence import SCALER_NAMES
from lossscale.torch._state import DisabledScale, DynamicScale
from lossscale.torch._step import Step


class TorchSurface:
    """torch's accessors and private scaler members over a scaler's state and rule
    (``GradScaler`` provides them)."""

    _ls: DynamicScale | DisabledScale
    _stepped: bool
    _rule: DynamicRule

    def _state_of(self, optimizer: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _step_of(self, optimizer: torch.optim.Optimizer) -> Step:
        raise NotImplementedError

    def _record_check(self, optimizer: torch.optim.Optimizer, step: Step, found: Any) -> None:
        raise NotImplementedError

    def _set_rule(self, **change: Any) -> None:
        rule = self._rule
        values = {
            "increment_period": rule.increment_period,
            "multiplier": rule.multiplier,
            "backoff_factor": rule.backoff_factor,
            **change,
        }
        self._rule = dynamic_rule(
            values["increment_period"],
            values["multiplier"],
            min_loss_scale=rule.min_loss_scale,
            max_loss_scale=rule.max_loss_scale,
            hysteresis=rule.hysteresis,
            backoff_factor=values["backoff_factor"],
            hysteresis_refill=rule.hysteresis_refill,
            names=SCALER_NAMES,
        )
        if isinstance(self._ls, DynamicScale):
            self._ls.set_rule(self._rule)

    def get_growth_factor(self) -> float:
        """The growth factor (a Python float)."""
        return self._rule.multiplier

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated: > 1; ValueError otherwise, nothing changes)."""
        self._set_rule(multiplier=new_factor)

    def get_backoff_factor(self) -> float:
        """The back-off factor (a Python float)."""
        return cast(float, self._rule.backoff_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the back-off factor (validated: in (0, 1))."""
        self._set_rule(backoff_factor=v.real("new_factor", new_factor))

    def get_growth_interval(self) -> int:
        """The growth interval (a Python int)."""
        return self._rule.increment_period

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated: an int ≥ 1). A growth counter at or above the
        new interval grows on the next finite iteration (torch's would never grow again)."""
        self._set_rule(increment_period=new_interval)

    def _get_growth_tracker(self) -> int:
        """The growth counter (torch's private accessor; a host sync on a GPU)."""
        ls = self._ls
        return 0 if isinstance(ls, DisabledScale) else ls.good_steps()

    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        """torch's private initialiser, which Accelerate calls after loading a scaler state
        under FSDP2. The state here is created eagerly, so this only moves it to ``dev`` when
        no step was taken yet (no sync)."""
        ls = self._ls
        if isinstance(ls, DynamicScale) and not self._stepped:
            place = torch.device(dev)
            if place != ls.device and place.type == ls.device.type:
                ls.move_to(place)

    @property
    def _scale(self) -> torch.Tensor | None:
        """torch's ``_scale``: the current scale, a 0-d float32 tensor on the scaler's device
        (None when disabled). Read-only compatibility surface; no sync."""
        return None if isinstance(self._ls, DisabledScale) else self._ls.scale

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """torch's ``_growth_tracker``: consecutive finite iterations, a 0-d int32 tensor on
        the scaler's device (None when disabled). Read-only; a new tensor per read after
        host-decided steps (one fill, no sync)."""
        ls = self._ls
        return None if isinstance(ls, DisabledScale) else ls.good_steps_tensor()

    def _get_scale_async(self) -> torch.Tensor | None:
        """torch's ``_get_scale_async``: :attr:`_scale` (no sync)."""
        return self._scale

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's ``_found_inf_per_device``: after ``unscale_(optimizer)`` (or
        ``_check_inf_per_device``), ``{device: flag}``, a 0-d float32 flag on the scaler's
        device; ``{}`` before. ``GradScaler``: this rank's own non-finite flag for the optimizer
        (1.0 when one of its gradients here was not finite), the ``process_group`` agreement
        kept apart, so it reads as torch's ``GradScaler``'s: this rank's own, or what an
        in-place all-reduce of it made (``MAX``: 1.0 on every rank if any overflowed; ``SUM``:
        how many did). ``ShardedGradScaler``: as torch's after ``unscale_``, the flags summed
        over the group, the same on every rank: how many ranks overflowed. ``step`` reads these
        very tensors together with the agreement, so an all-reduce of them before ``step``
        decides the step as with torch's. No sync."""
        return cast(dict[Any, torch.Tensor], self._state_of(optimizer)["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's ``_check_inf_per_device``: check ``optimizer``'s gradients without
        unscaling them, record and return :meth:`_found_inf_per_device`. The stage is not
        changed. One check kernel per (device, dtype) group; no sync.

        Raises:
          RuntimeError: disabled (torch's asserts), or no parameter has a gradient.
        """
        if isinstance(self._ls, DisabledScale):
            raise RuntimeError("_check_inf_per_device needs an enabled scaler")
        self._state_of(optimizer)
        step = self._step_of(optimizer)
        with torch.no_grad():
            self._record_check(optimizer, step, step.check(unscale=False))
        return self._found_inf_per_device(optimizer)
