"""Megatron-core's grad scalers, ``DynamicGradScaler`` and ``ConstantGradScaler``, on
lossscale's one rule (:func:`lossscale.core.dynamic_update`).

The rule runs on the host, on NumPy float32 scalars: Megatron hands ``update`` a Python bool
that its optimizer has already read (``found_inf.item()``), so the decision is on the host
anyway. The device holds the scale and its reciprocal, one-element float32 tensors, refilled
(``torch.full``: a fill, no copy from the host, no sync) only when the scale changes.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lossscale.core import (
    DEFAULT_STALL_STEPS,
    FLOAT32_MAX,
    DynamicRule,
    DynamicState,
    StallAlarm,
    dynamic_rule,
    stall_alarm,
)
from lossscale.core import _validation as v
from lossscale.core._host import check_host_stall, fresh_host_state, host_state, host_step
from lossscale.megatron._scale import (
    ScalerBase,
    check_found_inf,
    default_device,
    read_found_inf,
    scale_value,
    whole,
)

#: lossscale's rule arguments under Megatron's names (for the error messages).
NAMES = {
    "increment_period": "growth_interval",
    "multiplier": "growth_factor",
    "min_loss_scale": "min_scale",
    "max_loss_scale": "max_scale",
}
#: The keys of a ``DynamicGradScaler`` state dict, Megatron's and lossscale's alike.
DYNAMIC_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")


class ConstantGradScaler(ScalerBase):
    """Megatron-core's ``ConstantGradScaler``: a loss scale that never changes.

    Args:
      initial_scale: the scale, a finite float32 > 0 (Python number).
      device: keyword-only; where :attr:`scale` lives. Default: CUDA's current device when CUDA
        is available, else the CPU.

    ``update`` checks its argument and changes nothing: a non-finite step is still skipped, by
    Megatron's optimizer (it skips on the flag, whatever the scaler). ``state_dict()`` is ``{}``,
    as Megatron's. Allocates the scale tensor once.

    Raises:
      TypeError, ValueError: a bad argument, naming it and its value.

    Example:
      >>> from lossscale.megatron import ConstantGradScaler
      >>> scaler = ConstantGradScaler(1024.0, device="cpu")
      >>> scaler.update(True)
      >>> scaler.scale, scaler.inv_scale, scaler.state_dict()
      (tensor([1024.]), tensor([0.0010]), {})
    """

    def __init__(self, initial_scale: float, *, device: Any = None) -> None:
        scale = v.positive_float32("initial_scale", initial_scale)
        super().__init__(v.as_float32(scale), default_device(device))

    def update(self, found_inf: Any) -> None:
        """Check ``found_inf`` (a bool or a one-element tensor, never read: no sync) and keep
        the scale.

        Raises:
          TypeError, ValueError: as :meth:`DynamicGradScaler.update`.

        Example:
          >>> import torch
          >>> from lossscale.megatron import ConstantGradScaler
          >>> scaler = ConstantGradScaler(8.0, device="cpu")
          >>> scaler.update(torch.tensor([1.0]))
          >>> scaler.scale
          tensor([8.])
        """
        check_found_inf(found_inf)
        self._last_found = found_inf if isinstance(found_inf, torch.Tensor) else bool(found_inf)

    def state_dict(self) -> dict[str, Any]:
        """``{}``, as Megatron's ``ConstantGradScaler``.

        Example:
          >>> from lossscale.megatron import ConstantGradScaler
          >>> ConstantGradScaler(8.0, device="cpu").state_dict()
          {}
        """
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Accept ``{}`` (Megatron's and this class's state); nothing changes.

        Raises:
          TypeError: ``state_dict`` is not a mapping.
          ValueError: it has keys, e.g. a ``DynamicGradScaler``'s state (naming the keys).

        Example:
          >>> from lossscale.megatron import ConstantGradScaler
          >>> ConstantGradScaler(8.0, device="cpu").load_state_dict({})
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if state_dict:
            raise ValueError(
                f"state_dict has keys {sorted(map(str, state_dict))}, the state of a dynamic "
                "scaler; a ConstantGradScaler's state is {}"
            )
        self._pending, self._pending_found = 0, False

    def __repr__(self) -> str:
        return f"ConstantGradScaler({self._value!r}, device={str(self._device)!r})"


class DynamicGradScaler(ScalerBase):
    """Megatron-core's ``DynamicGradScaler``, with lossscale's ceiling and stall alarm.

    The positional arguments are Megatron's, in its order; their defaults are what
    ``get_megatron_optimizer`` builds from a default ``OptimizerConfig`` (fp16).

    Args:
      initial_scale: the first scale; finite, > 0, at least ``min_scale`` (as Megatron asserts)
        and at most ``max_scale``.
      min_scale: the floor of back-offs (finite, > 0).
      growth_factor: the scale is multiplied by it after ``growth_interval`` finite steps in a
        row (> 1, also once rounded to float32).
      backoff_factor: the scale is multiplied by it on a back-off (in (0, 1)).
      growth_interval: finite steps in a row before growth (an int ≥ 1; a float with an
        integral value, as Megatron-LM passes it, is read as that int).
      hysteresis: the non-finite step, counted since the last growth (or the start), that
        backs off; after it every non-finite step backs off until the next growth (Megatron's
        refill on growth).
      max_scale: keyword-only; growth beyond it is refused (default: float32's largest).
      stall_steps: keyword-only; warn (or raise) once that many steps in a row were skipped
        with the scale at ``min_scale``; None turns the alarm off. Default 1000.
      on_stall: keyword-only; ``"warn"`` (once per stall, re-armed by a finite step) or
        ``"raise"`` (:class:`lossscale.core.LossScaleStalledError`).
      device: keyword-only; where :attr:`scale` lives. Default: CUDA's current device when
        CUDA is available, else the CPU.

    Each step's arithmetic is Megatron's ``update``, bit for bit: float32 products of the scale
    and the float32 factors, ``max(scale * backoff_factor, min_scale)``, growth on the
    ``growth_interval``-th finite step. The differences: growth past ``max_scale`` is refused
    (Megatron's scale can overflow to inf); the hysteresis tracker never runs below 1 (Megatron's
    counts down past 0; both back off on every non-finite step then); the stall alarm.

    Allocates three one-element factor tensors (Megatron's ``min_scale``, ``growth_factor``,
    ``backoff_factor`` attributes) and the scale tensor. The constructor never syncs.

    Raises:
      TypeError, ValueError: a bad argument, naming it and its value.

    Example:
      >>> from lossscale.megatron import DynamicGradScaler
      >>> scaler = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, 2, 2, device="cpu")
      >>> for found_inf in (True, True, False, False):
      ...     scaler.update(found_inf)
      ...     print(scaler.scale.item(), scaler.state_dict()["hysteresis_tracker"])
      1024.0 1
      512.0 1
      512.0 1
      1024.0 2
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        *,
        max_scale: float = FLOAT32_MAX,
        stall_steps: int | None = DEFAULT_STALL_STEPS,
        on_stall: str = "warn",
        device: Any = None,
    ) -> None:
        backoff = v.real("backoff_factor", backoff_factor)  # None would mean TensorFlow's
        rule = dynamic_rule(
            whole("growth_interval", growth_interval, 1),
            growth_factor,
            min_loss_scale=min_scale,
            max_loss_scale=max_scale,
            hysteresis=whole("hysteresis", hysteresis, 1),
            backoff_factor=backoff,
            hysteresis_refill="on_growth",
            names=NAMES,
        )
        initial = v.scale_at_most("initial_scale", initial_scale, rule.max_loss_scale, "max_scale")
        if v.as_float32(initial) < v.as_float32(rule.min_loss_scale):
            raise ValueError(
                f"initial_scale={initial_scale!r} must not be below min_scale={min_scale!r}"
            )
        self._rule: DynamicRule = rule
        self._alarm: StallAlarm = stall_alarm(stall_steps, on_stall)
        self._state: DynamicState = fresh_host_state(initial, rule)
        self._stalled = 0
        self._stall_warned = False
        super().__init__(float(self._state.loss_scale), default_device(device))

        def factor(value: float) -> torch.Tensor:
            return torch.full((1,), value, dtype=torch.float32, device=self._device)

        self._factors = (
            factor(rule.min_loss_scale),
            factor(rule.multiplier),
            factor(backoff),
        )

    # -- Megatron's attributes ---------------------------------------------------------------
    @property
    def min_scale(self) -> torch.Tensor:
        """The floor, a one-element float32 tensor on :attr:`device` (as Megatron's)."""
        return self._factors[0]

    @property
    def growth_factor(self) -> torch.Tensor:
        """The growth factor, a one-element float32 tensor on :attr:`device` (as Megatron's)."""
        return self._factors[1]

    @property
    def backoff_factor(self) -> torch.Tensor:
        """The back-off factor, a one-element float32 tensor on :attr:`device` (as
        Megatron's)."""
        return self._factors[2]

    @property
    def growth_interval(self) -> int:
        """Finite steps in a row before growth."""
        return self._rule.increment_period

    @property
    def hysteresis(self) -> int:
        """The non-finite step since the last growth that backs off."""
        return self._rule.hysteresis

    @property
    def _growth_tracker(self) -> int:
        """Megatron's private counter: finite steps since the last change (read-only)."""
        return int(self._state.good_steps)

    @property
    def _hysteresis_tracker(self) -> int:
        """Megatron's private counter: ``hysteresis`` minus the non-finite steps since the last
        growth, never below 1 (read-only)."""
        return self._rule.hysteresis - int(self._state.nonfinite_steps)

    # -- lossscale's ------------------------------------------------------------------------
    @property
    def rule(self) -> DynamicRule:
        """The validated rule (:class:`lossscale.core.DynamicRule`, refill ``"on_growth"``)."""
        return self._rule

    @property
    def max_scale(self) -> float:
        """The ceiling: growth beyond it is refused."""
        return self._rule.max_loss_scale

    @property
    def stall_steps(self) -> int | None:
        """Skipped steps in a row at ``min_scale`` that set the stall alarm off (None: off)."""
        return self._alarm.steps

    @property
    def on_stall(self) -> str:
        """``"warn"`` or ``"raise"``."""
        return self._alarm.action

    def update(self, found_inf: Any) -> None:
        """One step of the rule: back off (with hysteresis) when ``found_inf``, else count the
        finite step and grow on the ``growth_interval``-th.

        Args:
          found_inf: whether a gradient of the step was not finite: a Python bool (Megatron
            passes ``found_inf.item() > 0``), or a one-element tensor, nonzero or NaN when one
            was (read once: a host sync on a GPU).

        Shared by several sub-optimizers (:func:`lossscale.megatron.share_grad_scaler`), the
        step's reports are collected and applied once, with their OR, when the last one
        arrives; until then :attr:`scale` and :attr:`inv_scale` do not change. Shared with a
        ``process_group``, that OR is then MAX-reduced over the group (one all-reduce of one
        element and one read: a host sync on a GPU), so every rank of the group applies the
        same update.

        On a non-finite step the scaler only records it (a back-off, per the hysteresis);
        skipping the optimizer step is Megatron's (``prepare_grads`` returns the flag and
        ``step`` returns before the inner optimizer runs).

        The rule runs on the host (no device op); when the scale changes, the scale tensor is
        refilled (one fill, no sync). The stall alarm warns from here (its warning names the
        first caller outside lossscale and torch).

        Raises:
          TypeError: ``found_inf`` is neither a bool nor a tensor.
          ValueError: a tensor with more than one element.
          lossscale.core.LossScaleStalledError: ``on_stall="raise"`` and the run stalled.

        Example:
          >>> import torch
          >>> from lossscale.megatron import DynamicGradScaler
          >>> scaler = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 1000, 1, device="cpu")
          >>> scaler.update(torch.tensor([1.0]))   # found_inf as Megatron's tensor
          >>> scaler.scale
          tensor([4.])
        """
        found = self._collect(read_found_inf(found_inf))
        if found is None:
            return
        if self._group is not None:  # share_grad_scaler(process_group=...)
            flag = torch.full((1,), float(found), dtype=torch.float32, device=self._device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
            found = bool(flag.item() > 0)
        self._apply(found)

    def _apply(self, found: bool) -> None:
        self._last_found = found
        state, alarm = self._state, self._alarm
        count_stall = alarm.steps is not None
        new, self._stalled = host_step(
            state, not found, self._rule, self._stalled, count_stall=count_stall
        )
        self._state = new
        if new.loss_scale != state.loss_scale:
            self._set_scale(float(new.loss_scale))
        self._stall_warned = check_host_stall(
            self._stalled,
            self._value,
            alarm,
            warned=self._stall_warned,
            where="lossscale.megatron.DynamicGradScaler",
        )

    def state_dict(self) -> dict[str, Any]:
        """Megatron's state dict: ``{'scale': tensor, 'growth_tracker': int,
        'hysteresis_tracker': int}``, loadable by Megatron's ``DynamicGradScaler`` and by this
        class.

        ``scale`` is a copy of :attr:`scale` (one small device copy; no sync);
        ``hysteresis_tracker`` is ``hysteresis`` minus the non-finite steps since the last
        growth, at least 1 (where Megatron's may have counted down to 0 or below: the same
        behaviour follows). Taken between two sub-optimizers' reports of a shared step, it is
        the state before that step.

        Example:
          >>> from lossscale.megatron import DynamicGradScaler
          >>> DynamicGradScaler(256.0, device="cpu").state_dict()
          {'scale': tensor([256.]), 'growth_tracker': 0, 'hysteresis_tracker': 2}
        """
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state written by Megatron's ``DynamicGradScaler`` or by this class.

        ``scale`` (a one-element floating tensor on any device, or a number) is read once (a
        host sync on a GPU) and refilled on :attr:`device`; it may lie below ``min_scale`` (the
        next back-off lifts it). ``hysteresis_tracker`` values of 0 or below (Megatron's counter
        after the allowance was spent) load as 1: every non-finite step backs off until the
        next growth, as in Megatron. A step's pending reports (shared scaler) and the stall
        count restart.

        Raises:
          TypeError: ``state_dict`` is not a mapping.
          ValueError: a missing or unknown key, or a value of the wrong type or out of range
            for this scaler (``scale`` not finite or above ``max_scale``, ``growth_tracker``
            outside ``[0, growth_interval)``, ``hysteresis_tracker`` above ``hysteresis``),
            naming the key. Nothing changes then.

        Example:
          >>> import torch
          >>> from lossscale.megatron import DynamicGradScaler
          >>> scaler = DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, 1000, 2, device="cpu")
          >>> scaler.load_state_dict(
          ...     {"scale": torch.tensor([512.0]), "growth_tracker": 7, "hysteresis_tracker": -3}
          ... )
          >>> scaler.state_dict()
          {'scale': tensor([512.]), 'growth_tracker': 7, 'hysteresis_tracker': 1}
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        for key in DYNAMIC_KEYS:
            if key not in state_dict:
                raise ValueError(
                    f"state_dict is missing key {key!r} (it has keys "
                    f"{sorted(map(str, state_dict))}); a DynamicGradScaler's state has keys "
                    f"{list(DYNAMIC_KEYS)}"
                )
        unknown = sorted(map(str, set(state_dict) - set(DYNAMIC_KEYS)))
        if unknown:
            raise ValueError(
                f"state_dict has unknown keys {unknown}; a DynamicGradScaler's state has keys "
                f"{list(DYNAMIC_KEYS)}"
            )
        rule = self._rule
        try:
            raw = scale_value("state_dict['scale']", state_dict["scale"])
            scale = v.scale_at_most("state_dict['scale']", raw, rule.max_loss_scale, "max_scale")
        except TypeError as error:
            raise ValueError(str(error)) from None
        good = self._counter("growth_tracker", state_dict["growth_tracker"])
        if not 0 <= good < rule.increment_period:
            raise ValueError(
                f"state_dict['growth_tracker']={good!r} must lie in [0, growth_interval="
                f"{rule.increment_period})"
            )
        tracker = self._counter("hysteresis_tracker", state_dict["hysteresis_tracker"])
        if tracker > rule.hysteresis:
            raise ValueError(
                f"state_dict['hysteresis_tracker']={tracker!r} exceeds hysteresis={rule.hysteresis}"
            )
        nonfinite = rule.hysteresis - max(tracker, 1)
        scale32 = float(np.float32(scale))
        self._state = host_state(scale32, good, nonfinite)
        self._set_scale(scale32)
        self._pending, self._pending_found = 0, False
        self._stalled, self._stall_warned = 0, False

    @staticmethod
    def _counter(key: str, value: Any) -> int:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            if value.is_floating_point() or value.dtype == torch.bool:
                raise ValueError(f"state_dict[{key!r}] must be an integer, got {value!r}")
            value = int(value.item())
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
            raise ValueError(f"state_dict[{key!r}] must be an integer, got {value!r}")
        return int(value)

    def __repr__(self) -> str:
        r = self._rule
        return (
            f"DynamicGradScaler(scale={self._value!r}, min_scale={r.min_loss_scale!r}, "
            f"growth_factor={r.multiplier!r}, backoff_factor={r.backoff_factor!r}, "
            f"growth_interval={r.increment_period}, hysteresis={r.hysteresis}, "
            f"max_scale={r.max_loss_scale!r}, device={str(self._device)!r})"
        )
