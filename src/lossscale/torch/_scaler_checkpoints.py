"""What a :class:`~lossscale.torch.GradScaler` saves: its checkpoint dict (torch's keys, and
lossscale's counters under ``'lossscale'``), its pickled form and its repr."""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch

from lossscale.core._rule import DynamicRule
from lossscale.torch import _persistence
from lossscale.torch._state import DisabledScale, DynamicScale
from lossscale.torch._step import Step


class ScalerCheckpoints:
    """``state_dict``/``load_state_dict``, pickling and ``repr`` over a scaler's state
    (``GradScaler`` provides it)."""

    _ls: DynamicScale | DisabledScale
    _rule: DynamicRule
    _device: str
    _enabled: bool
    _steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, Step]
    _per_optimizer_states: defaultdict[int, dict[str, Any]]

    def state_dict(self) -> dict[str, Any]:
        """torch's keys — ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker`` — so that ``torch.amp.GradScaler.load_state_dict`` reads it, plus
        ``'lossscale'``: the hysteresis counter and ``skipped_steps`` (torch's ignores it).
        ``{}`` when disabled, as torch's. Reads the state: a host sync on a GPU."""
        ls = self._ls
        return {} if isinstance(ls, DisabledScale) else _persistence.scaler_state_dict(ls)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by this class or by ``torch.amp.GradScaler``: the scale, the
        growth counter and the three factors (as torch's does); the hysteresis counter and
        ``skipped_steps`` when present. A ``LossScaleOptimizer`` state gives its scale,
        counters and skipped steps (this scaler's factors kept). Everything is checked before
        anything changes. Disabled: a no-op (as torch's).

        Raises:
          ValueError: the empty state of a disabled scaler, a missing key or a bad value
            (naming it), or a scale above this scaler's ``max_loss_scale``.
        """
        ls = self._ls
        if isinstance(ls, DisabledScale):
            return
        _persistence.load_scaler_state(ls, state_dict)
        self._rule = ls.rule

    def __getstate__(self) -> dict[str, Any]:
        """Pickling (``copy.deepcopy``, spawning workers): between iterations only, as torch's;
        the per-optimizer gradient groups are rebuilt on the next step."""
        if any(s["found_inf_per_device"] for s in self._per_optimizer_states.values()):
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, "
                "or at the end after scaler.update()."
            )
        state = dict(self.__dict__)
        del state["_steps"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._steps = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={self._device!r}, enabled={self._enabled}, "
            f"growth_factor={self._rule.multiplier}, backoff_factor={self._rule.backoff_factor}, "
            f"growth_interval={self._rule.increment_period}, "
            f"min_loss_scale={self._rule.min_loss_scale})"
        )
