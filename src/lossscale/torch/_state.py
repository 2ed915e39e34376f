"""The loss scale of a torch front end, one small class per mode: :class:`DisabledScale` and
:class:`FixedScale` (:mod:`lossscale.torch._scale`), and here :class:`DynamicScale`, the rule
(:func:`lossscale.core.dynamic_update`) advanced where the step's decision is known; an
execution strategy that never changes a value (tests compare every path with the core rule,
bit for bit). :func:`scale_state` builds the one a front end's settings describe.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lossscale.core._backends import ArrayNamespace
from lossscale.core._checkpoint import read_dynamic_state, scale_state_dict
from lossscale.core._host import check_host_stall, fresh_host_state, host_state, host_step
from lossscale.core._rule import DynamicRule, DynamicState, dynamic_update
from lossscale.core._settings import ScaleSettings
from lossscale.core._stall import StallAlarm
from lossscale.core._validation import FLOAT32_MAX, as_float32
from lossscale.torch._scale import DisabledScale, FixedScale, Scale

__all__ = ["AnyScale", "DisabledScale", "DynamicScale", "FixedScale", "applied_now", "scale_state"]

#: (scale, good_steps, nonfinite_steps, skipped, stalled) as Python numbers.
Values = tuple[float, int, int, int, int]

#: Device-home steps after which the float32 skipped-steps count is folded into its int64 base
#: (on the device, no sync), long before float32 stops counting exactly (2**24).
_FOLD_EVERY = 2**22


def fused_factors(rule: DynamicRule) -> tuple[float, float] | None:
    """``(growth, backoff)`` for ``torch._amp_update_scale_`` when that kernel computes the
    rule exactly from a scale at or above ``min_loss_scale`` (followed by the floor), else
    None. It does when: ``hysteresis`` is 1; ``max_loss_scale`` is the float32 maximum (the
    kernel refuses a non-finite growth, the rule a growth above the maximum: the same steps);
    the growth counter fits its int32 tracker; and the back-off is a product the kernel rounds
    as the rule does (both factors exact in float32, or TensorFlow's division by a power-of-two
    multiplier). Pure host code."""
    if rule.hysteresis != 1 or rule.max_loss_scale != FLOAT32_MAX:
        return None
    if not 1 <= rule.increment_period < 2**31 - 1:
        return None
    growth = rule.multiplier
    if rule.backoff_factor is None:
        mantissa, _ = math.frexp(growth)
        if mantissa != 0.5:  # not a power of two
            return None
        return growth, 1.0 / growth
    if needs_float64(rule):
        return None
    return growth, rule.backoff_factor


@functools.cache
def needs_float64(rule: DynamicRule) -> bool:
    """Whether a torch-style rule (``backoff_factor`` set) has a factor that float32 cannot
    hold exactly: torch's kernel rounds the float64 product ``scale * factor`` to float32, so
    the rule then runs on a float64 copy of the scale, rounded back (torch's arithmetic)."""
    if rule.backoff_factor is None:
        return False
    return any(as_float32(f) != f for f in (rule.multiplier, rule.backoff_factor))


def _advance(
    state: DynamicState,
    is_finite: Any,
    rule: DynamicRule,
    widen: Callable[[Any], Any] | None,
    narrow: Callable[[Any], Any],
    xp: ArrayNamespace | None = None,
) -> DynamicState:
    """One step of the core rule, on a float64 copy of the scale (``widen``, then ``narrow``
    back to float32) when :func:`needs_float64`; ``widen`` None: a library without float64
    (MPS), always float32. ``xp``: as for ``dynamic_update``."""
    if widen is None or not needs_float64(rule):
        return dynamic_update(state, is_finite, rule, xp)
    wide = dynamic_update(state._replace(loss_scale=widen(state.loss_scale)), is_finite, rule, xp)
    return wide._replace(loss_scale=narrow(wide.loss_scale))


def _host_update(state: DynamicState, flag: Any, rule: DynamicRule, xp: Any) -> DynamicState:
    """The rule on the host home's NumPy scalars, in torch's arithmetic (:func:`_advance`)."""
    return _advance(state, flag, rule, np.float64, np.float32, xp)


class _HostHome:
    """The rule's state on the host: NumPy scalars and Python counters. The device holds
    only the scale (refilled when it changes) and its reciprocal."""

    __slots__ = ("rule_state", "skipped", "stalled")

    def __init__(self, rule_state: DynamicState, skipped: int, stalled: int) -> None:
        self.rule_state = rule_state
        self.skipped = skipped
        self.stalled = stalled


class _DeviceHome:
    """The rule's state as tensors on the scale's device, advanced in place."""

    __slots__ = (
        "above_floor",  # the scale is known to be >= the floor (fused_factors' precondition)
        "applied",  # what ``applied`` reports before the first device-home step
        "found",  # the last device-home step's flag, or None
        "good",  # the rule's good_steps, int32 (the fused kernel's tracker) when it fits
        "nonfinite",  # the rule's nonfinite_steps (hysteresis counter), int64
        "skipped",  # skipped steps since the last fold, float32 (adds the flag: one op)
        "skipped_base",  # skipped steps folded so far, int64
        "stalled",  # the stall count, float32 (exact far beyond any alarm threshold)
        "steps",  # device-home steps since the last fold (a host int)
    )

    def __init__(self, host: _HostHome, rule: DynamicRule, applied: bool, device: Any) -> None:
        counter = torch.int32 if rule.increment_period < 2**31 - 1 else torch.int64
        state = host.rule_state
        self.good = torch.full((), int(state.good_steps), dtype=counter, device=device)
        self.nonfinite = torch.full(
            (), int(state.nonfinite_steps), dtype=torch.int64, device=device
        )
        self.skipped_base = torch.full((), host.skipped, dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self.stalled = torch.full((), float(host.stalled), dtype=torch.float32, device=device)
        self.found: torch.Tensor | None = None
        self.applied = applied
        self.steps = 0
        self.above_floor = float(state.loss_scale) >= rule.min_loss_scale

    def move_to(self, device: torch.device) -> None:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        self.good, self.nonfinite = move(self.good), move(self.nonfinite)
        self.skipped_base, self.skipped = move(self.skipped_base), move(self.skipped)
        self.stalled = move(self.stalled)
        self.found = None if self.found is None else move(self.found)


class DynamicScale(Scale):
    """A dynamic scale with its step records and the stall alarm's count.

    Where the rule runs (never what it computes):

    * **host home.** After a step whose decision was read on the host (the step's one sync),
      the rule runs on NumPy scalars; the counters are host numbers. No device op per step.
    * **device home.** When decisions stay on the device (fused optimizers with
      ``device_side_skip``: no sync), the state is tensors, advanced in place by torch's fused
      update kernel ``torch._amp_update_scale_`` where it computes the rule exactly
      (:func:`fused_factors`), else by the rule itself on tensors.

    It starts in the host home. Moving to the device costs a few fills (no sync); back to the
    host one read (a host sync on a GPU), made only when a host-decided step follows.
    """

    dynamic = True

    def __init__(
        self,
        rule: DynamicRule,
        initial_scale: float,
        device: torch.device,
        alarm: StallAlarm | None = None,
        where: str = "LossScaleOptimizer",
    ) -> None:
        super().__init__(initial_scale, device)
        self.rule = rule
        self.alarm = alarm
        self.where = where
        self.stall_warned = False
        start = fresh_host_state(initial_scale, rule)
        self.home: _HostHome | _DeviceHome = _HostHome(start, 0, 0)

    @property
    def alarm_on(self) -> bool:
        return self.alarm is not None and self.alarm.steps is not None

    @property
    def may_drop_below_one(self) -> bool:
        return self.rule.min_loss_scale < 1 or self.initial_scale < 1

    def scale_snapshot(self) -> torch.Tensor:
        """The host home replaces the scale (a snapshot is the tensor itself); the device
        home updates it in place (a snapshot is a copy: one tiny kernel)."""
        return self._scale.clone() if isinstance(self.home, _DeviceHome) else self._scale

    def move_to(self, device: torch.device) -> None:
        super().move_to(device)
        if isinstance(self.home, _DeviceHome):
            self.home.move_to(device)

    # -- the step records -------------------------------------------------------------------
    @property
    def applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last step applied (no sync)."""
        home = self.home
        if isinstance(home, _DeviceHome):
            if home.found is not None:
                return home.found == 0
            return torch.full((), home.applied, dtype=torch.bool, device=self.device)
        return super().applied

    @property
    def skipped(self) -> torch.Tensor:
        """0-d int64 tensor: the skipped steps so far (no sync; a new tensor)."""
        home = self.home
        if isinstance(home, _DeviceHome):
            return home.skipped_base + home.skipped.long()
        return torch.full((), home.skipped, dtype=torch.int64, device=self.device)

    def set_skipped(self, count: int) -> None:
        """Set the skipped-steps count (a loaded checkpoint's)."""
        self._host_home().skipped = count

    # -- a step's outcome -------------------------------------------------------------------
    def record_host(self, is_finite: bool) -> None:
        """A step whose decision the host knows: the rule on NumPy scalars, one fill when the
        scale changed. From the device home: one read first (a host sync on a GPU)."""
        home = self._host_home()
        state = home.rule_state
        new, home.stalled = host_step(
            state,
            is_finite,
            self.rule,
            home.stalled,
            count_stall=self.alarm_on,
            update=_host_update,
        )
        home.skipped += not is_finite
        if new.loss_scale != state.loss_scale:
            self._set_scale_tensor(float(new.loss_scale))
        home.rule_state = new
        self.applied_host = is_finite

    def record_device(self, found: torch.Tensor) -> None:
        """A step whose decision stays on the device: ``found`` is the 0-d float32 flag (1.0
        when a gradient was not finite). Moves to the device home first (a few fills). Ops:
        with the fused kernel, 2 for the scale, 1 for the skipped count and 3 for the stall
        count (alarm on); the rule on tensors costs about 18. No sync."""
        home = self.home
        if isinstance(home, _HostHome):
            home = self.home = _DeviceHome(home, self.rule, bool(self.applied_host), self.device)
            # updated in place from now on: a tensor handed out before keeps its value
            self._scale = self._scale.clone()
        rule, scale = self.rule, self._scale
        if self.alarm_on:
            # the stall count in three ops: with g = found * (scale <= floor), a step skipped
            # at the floor gives count + 1 and any other step 0, i.e. (count + 1) * g
            g = found * (scale <= rule.min_loss_scale)
            home.stalled = torch.addcmul(g, home.stalled, g)
        home.skipped.add_(found)
        home.steps += 1
        if home.steps >= _FOLD_EVERY:
            home.skipped_base = home.skipped_base + home.skipped.long()
            home.skipped = torch.zeros_like(home.skipped)
            home.steps = 0
        mps = scale.device.type == "mps"
        factors = fused_factors(rule) if home.above_floor and not mps else None
        if factors is not None:
            # the kernel computes the rule from a scale >= the floor; then the rule's floor
            torch._amp_update_scale_(scale, home.good, found, *factors, rule.increment_period)
            scale.clamp_min_(rule.min_loss_scale)
        else:
            widen = None if mps else torch.Tensor.double
            state = DynamicState(scale, home.good, home.nonfinite)
            new = _advance(state, found == 0, rule, widen, torch.Tensor.float)
            self._scale, home.good, home.nonfinite = new
        self._inv = None
        home.found = found
        self.applied_host = None

    def _host_home(self) -> _HostHome:
        """The host home, moving there from the device home (one read: a host sync on a GPU)."""
        home = self.home
        if isinstance(home, _HostHome):
            return home
        scale, good, nonfinite, skipped, stalled, applied = self._device_values(home)
        self.home = _HostHome(host_state(scale, good, nonfinite), skipped, stalled)
        self.applied_host = home.applied if applied is None else applied
        return self.home

    def _device_values(self, home: _DeviceHome) -> tuple[float, int, int, int, int, bool | None]:
        """The device home's values and whether its last step applied (None before one), in
        one read: a host sync on a GPU."""
        parts = [
            self._scale.double(),
            home.good.double(),
            home.nonfinite.double(),
            home.skipped_base.double() + home.skipped.double(),
            home.stalled.double(),
        ]
        if home.found is not None:
            parts.append((home.found == 0).double())
        values = torch.stack(parts).tolist()
        applied = bool(values[5]) if home.found is not None else None
        return values[0], int(values[1]), int(values[2]), int(values[3]), int(values[4]), applied

    # -- host reads and checkpoints ---------------------------------------------------------
    def host_values(self) -> Values:
        """(scale, good_steps, nonfinite_steps, skipped, stalled) as Python numbers: free in
        the host home, one read (a host sync on a GPU) in the device home, which stays."""
        home = self.home
        if isinstance(home, _DeviceHome):
            return self._device_values(home)[:5]
        state = home.rule_state
        good, nonfinite = int(state.good_steps), int(state.nonfinite_steps)
        return float(state.loss_scale), good, nonfinite, home.skipped, home.stalled

    def read(self) -> Values:
        """:meth:`host_values`, and the stall alarm's check on them (no second read)."""
        values = self.host_values()
        self._alarm(values[0], values[4])
        return values

    def check_stall(self) -> None:
        """The stall alarm's host-side check: free in the host home, a read (a host sync on a
        GPU) in the device home. A warning names the user's line."""
        if self.alarm_on:
            self.read()

    def _alarm(self, scale: float, count: int) -> None:
        self.stall_warned = check_host_stall(
            count, scale, self.alarm, warned=self.stall_warned, where=self.where
        )

    def good_steps(self) -> int:
        """The growth counter (a host sync on a GPU in the device home)."""
        home = self.home
        if isinstance(home, _DeviceHome):
            return int(home.good.item())
        return int(home.rule_state.good_steps)

    def good_steps_tensor(self) -> torch.Tensor:
        """The growth counter as a 0-d int32 tensor on ``device`` (no sync: a fill from the
        host value, or the device home's counter itself)."""
        home = self.home
        if isinstance(home, _DeviceHome):
            return home.good
        good = int(home.rule_state.good_steps)
        return torch.full((), good, dtype=torch.int32, device=self.device)

    def state_dict(self, values: Values | None = None) -> dict[str, Any]:
        """The checkpoint dict of :mod:`lossscale.core._checkpoint`, from ``values`` already
        read, else read here (a host sync on a GPU in the device home)."""
        scale, good, nonfinite, _, _ = self.host_values() if values is None else values
        return scale_state_dict(scale, (good, nonfinite))

    def check_state_dict(self, state: Any) -> tuple[float, int, int]:
        """Validate a checkpoint dict against this rule (ValueError naming the key)."""
        return read_dynamic_state(state, self.rule)

    def load(self, scale: float, good: int, nonfinite: int) -> None:
        """Set a validated state, in the host home (one fill; no sync after host steps). The
        skipped count is kept; the stall count restarts."""
        skipped = self._host_home().skipped
        self.home = _HostHome(host_state(scale, good, nonfinite), skipped, 0)
        self._set_scale_tensor(scale)
        self.stall_warned = False

    def set_rule(self, rule: DynamicRule) -> None:
        """Replace the hyperparameters (GradScaler's setters); the state is kept."""
        self.rule = rule

    def set_scale(self, value: float) -> None:
        """Replace the current scale with a validated float32 ``value``; counters kept. One
        fill; no sync."""
        home = self.home
        if isinstance(home, _HostHome):
            home.rule_state = home.rule_state._replace(loss_scale=np.float32(value))
        else:
            home.above_floor = value >= self.rule.min_loss_scale
        self._set_scale_tensor(value)


def applied_now(ls: DisabledScale | FixedScale | DynamicScale) -> bool:
    """Whether the last step applied, as a Python bool: free when the step's decision was read
    on the host; one read (a host sync on a GPU) after a device-side step."""
    known = ls.applied_host
    return bool(ls.applied.item()) if known is None else known


#: An enabled loss scale.
EnabledScale = FixedScale | DynamicScale
#: Any loss scale a front end holds.
AnyScale = DisabledScale | FixedScale | DynamicScale


def scale_state(
    settings: ScaleSettings,
    device: torch.device,
    alarm: StallAlarm | None,
    where: str,
    enabled: bool = True,
) -> AnyScale:
    """The mode ``settings`` and ``enabled`` describe, on ``device``."""
    if not enabled:
        return DisabledScale(device)
    if settings.rule is None:
        return FixedScale(settings.initial_scale, device)
    return DynamicScale(settings.rule, settings.initial_scale, device, alarm, where)
