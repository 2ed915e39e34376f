"""The loss scale of a torch front end: where its state lives and how a step advances it.

The rule is :func:`lossscale.core.dynamic_update` (and :func:`lossscale.core.stall_update` for
the stall alarm's count). This module only chooses *where* it runs, an execution strategy that
never changes a value (tests compare every path with the core rule, bit for bit):

* **host home.** After a step whose decision was read on the host (ordinary optimizers read it
  anyway, in their one sync per step), the rule runs on the host on NumPy scalars (core's
  ``NUMPY_SCALARS``: the 0-d array rule's values at a third of its cost), and the
  counters (growth, hysteresis, skipped steps, the stall count) are host numbers. The device
  holds only the scale, a 0-d float32 tensor replaced by one fill when the scale changes, and
  its reciprocal, computed once per scale. No device op per step for the rule.
* **device home.** When decisions stay on the device (fused optimizers: no sync), the state is
  tensors, advanced in place by torch's fused update kernel ``torch._amp_update_scale_`` where
  it computes the rule exactly (:func:`fused_factors`), else by the rule itself on tensors.

Switching costs a few fills from host to device (no sync), and one read from device to host (a
host sync on a GPU), made only when a synced step follows device-home steps.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from lossscale.core._backends import NUMPY_SCALARS, ArrayNamespace
from lossscale.core._checkpoint import read_dynamic_state, read_fixed_state, scale_state_dict
from lossscale.core._rule import DynamicRule, DynamicState, dynamic_state, dynamic_update
from lossscale.core._settings import ScaleSettings
from lossscale.core._stall import StallAlarm, report_stall, stall_update
from lossscale.core._validation import FLOAT32_MAX, as_float32

#: Device-home steps after which the float32 skipped-steps count is folded into its int64 base
#: (on the device, no sync), long before float32 stops counting exactly (2**24).
_FOLD_EVERY = 2**22


def fused_factors(rule: DynamicRule) -> tuple[float, float] | None:
    """``(growth, backoff)`` for ``torch._amp_update_scale_`` when that kernel computes the
    rule exactly from a scale at or above ``min_loss_scale`` (followed by the floor), else
    None. It does when: ``hysteresis`` is 1 (a back-off on every non-finite step, the counter
    reset); ``max_loss_scale`` is the float32 maximum (the kernel refuses a non-finite growth,
    the rule a growth above the maximum: the same steps); the growth counter fits its int32
    tracker; and the back-off is a product the kernel rounds as the rule does: torch's
    ``backoff_factor`` with both factors exact in float32 (the float64 product rounded to
    float32 is then the float32 product), or TensorFlow's division by a power-of-two
    multiplier (``scale / m`` is exactly ``scale * (1 / m)``). Pure host code."""
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
    hold exactly. torch's ``_amp_update_scale_`` rounds the float64 product ``scale * factor``
    to float32; with such a factor (0.3, 1.1) float32 arithmetic can differ in the last bit,
    so the rule then runs on a float64 copy of the scale, rounded back: torch's arithmetic.
    With exact factors the float32 product is already the correctly rounded exact product."""
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
    back to float32) when :func:`needs_float64`, as torch's kernel rounds; ``widen`` None: a
    library without float64 (MPS), always float32. ``xp``: as for ``dynamic_update``."""
    if widen is None or not needs_float64(rule):
        return dynamic_update(state, is_finite, rule, xp)
    wide = dynamic_update(state._replace(loss_scale=widen(state.loss_scale)), is_finite, rule, xp)
    return wide._replace(loss_scale=narrow(wide.loss_scale))


def _to_float64(x: Any) -> Any:
    return np.float64(x)


def _to_float32(x: Any) -> Any:
    return np.float32(x)


def _host_state(scale: float, good: int, bad: int) -> DynamicState:
    """The host home's state: NumPy scalars, on which the rule runs (``NUMPY_SCALARS``)."""
    return DynamicState(np.float32(scale), np.int64(good), np.int64(bad))


class _DeviceRecords:
    """The state of the device home: tensors on the scale's device (filled by
    :meth:`ScaleState._to_device`)."""

    __slots__ = (
        "above_floor",  # the scale is known to be >= the floor (fused_factors' precondition)
        "applied",  # what ``applied`` reports before the first device-home step
        "bad",  # the rule's nonfinite_steps (hysteresis counter), int64
        "found",  # the last device-home step's flag, or None
        "good",  # the rule's good_steps, int32 (the fused kernel's tracker) when it fits
        "skipped",  # skipped steps since the last fold, float32 (adds the flag: one op)
        "skipped_base",  # skipped steps folded so far, int64
        "stalled",  # the stall count, float32 (exact far beyond any alarm threshold)
        "steps",  # device-home steps since the last fold (a host int)
    )

    above_floor: bool
    applied: bool
    bad: torch.Tensor
    found: torch.Tensor | None
    good: torch.Tensor
    skipped: torch.Tensor
    skipped_base: torch.Tensor
    stalled: torch.Tensor
    steps: int


class ScaleState:
    """The loss scale of one front end, on one device, with its step records.

    A fixed scale (``settings.rule`` None) is one 0-d float32 tensor. A dynamic one lives in
    the host home or the device home (see the module docstring); it starts in the host home,
    with its scale on ``device``.
    """

    def __init__(
        self,
        settings: ScaleSettings,
        device: torch.device,
        alarm: StallAlarm | None = None,
        where: str = "LossScaleOptimizer",
    ) -> None:
        self.rule: DynamicRule | None = settings.rule
        self.initial_scale = settings.initial_scale
        self.device = device
        self.alarm = alarm
        self.where = where
        self.stall_warned = False
        self._scale = torch.full((), settings.initial_scale, dtype=torch.float32, device=device)
        self._inv: torch.Tensor | None = None
        # the host home (``host`` None: the device home holds the state, in ``dev``)
        self.host: DynamicState | None = None
        if self.rule is not None:
            self.host = dynamic_state(settings.initial_scale, self.rule, xp=NUMPY_SCALARS)
        self.host_skipped = 0
        self.host_stalled = 0
        #: whether the last step applied, when known on the host (None after a fused step)
        self.applied_host: bool | None = True
        self.dev: _DeviceRecords | None = None

    @property
    def dynamic(self) -> bool:
        return self.rule is not None

    @property
    def alarm_on(self) -> bool:
        return self.alarm is not None and self.alarm.steps is not None and self.rule is not None

    # -- the scale on the device --------------------------------------------------------------
    @property
    def scale(self) -> torch.Tensor:
        """The current scale, 0-d float32 on ``device`` (no sync, no copy). The host home
        replaces it when it changes; the device home updates it in place."""
        return self._scale

    def scale_snapshot(self) -> torch.Tensor:
        """The scale as a tensor that later steps never modify: ``scale`` itself in the host
        home (replaced, never modified), a copy (one tiny kernel) in the device home."""
        return self._scale if self.dev is None else self._scale.clone()

    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` in float32, computed once per scale (one tiny kernel then, none
        otherwise; no sync). The float32 reciprocal of a float32 equals torch's GradScaler's
        float64 reciprocal rounded to float32 (double rounding is innocuous for division when
        53 >= 2 * 24 + 2), so both front ends use it."""
        if self._inv is None:
            self._inv = torch.reciprocal(self._scale)
        return self._inv

    def _set_scale_tensor(self, value: float) -> None:
        self._scale = torch.full((), value, dtype=torch.float32, device=self.device)
        self._inv = None

    @property
    def may_drop_below_one(self) -> bool:
        """Whether the scale can ever be < 1 (then unscaling can overflow float16 grads)."""
        if self.rule is None:
            return self.initial_scale < 1
        return self.rule.min_loss_scale < 1 or self.initial_scale < 1

    def move_to(self, device: torch.device) -> None:
        """Move every tensor to ``device`` (device to device, no host sync)."""
        self.device = device

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        self._scale = move(self._scale)
        self._inv = None
        d = self.dev
        if d is not None:
            d.good, d.bad = move(d.good), move(d.bad)
            d.skipped_base, d.skipped, d.stalled = (
                move(d.skipped_base),
                move(d.skipped),
                move(d.stalled),
            )
            d.found = None if d.found is None else move(d.found)

    # -- the step records -----------------------------------------------------------------------
    @property
    def applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last step applied (no sync: a new tensor from the host
        value, or a compare of the last device-home flag)."""
        d = self.dev
        if d is not None and d.found is not None:
            return d.found == 0
        value = self.applied_host if d is None else d.applied
        return torch.full((), bool(value), dtype=torch.bool, device=self.device)

    @property
    def skipped(self) -> torch.Tensor:
        """0-d int64 tensor: the skipped steps so far (no sync; a new tensor)."""
        d = self.dev
        if d is None:
            return torch.full((), self.host_skipped, dtype=torch.int64, device=self.device)
        return d.skipped_base + d.skipped.long()

    def set_skipped(self, count: int) -> None:
        """Set the skipped-steps count (a loaded checkpoint's)."""
        if self.dev is not None:
            self._to_host()
        self.host_skipped = count

    # -- a step's outcome ---------------------------------------------------------------------
    def record_fixed(self) -> None:
        """A step with a fixed scale: applied."""
        self.applied_host = True

    def record_host(self, is_finite: bool) -> None:
        """A dynamic step whose decision the host knows: the rule on the host (on NumPy
        scalars, ~15 us), and one fill when the scale changed. Moves the state to the host
        home first if it is in the device home (one read: a host sync on a GPU)."""
        if self.dev is not None:
            self._to_host()
        rule = cast(DynamicRule, self.rule)
        host = cast(DynamicState, self.host)
        finite = np.bool_(is_finite)  # validated by core without reading a dtype name
        if self.alarm_on:
            stalled = np.int64(self.host_stalled)
            count = stall_update(stalled, finite, host.loss_scale, rule, NUMPY_SCALARS)
            self.host_stalled = int(count)
        self.host_skipped += not is_finite
        new = _advance(host, finite, rule, _to_float64, _to_float32, NUMPY_SCALARS)
        if new.loss_scale != host.loss_scale:
            self._set_scale_tensor(float(new.loss_scale))
        self.host = new
        self.applied_host = is_finite

    def record_device(self, found: torch.Tensor) -> None:
        """A dynamic step whose decision stays on the device: ``found`` is the 0-d float32
        flag (1.0 when a gradient was not finite). Moves the state to the device home first
        (a few fills, no sync). Ops: with the fused kernel (:func:`fused_factors`), 2 for the
        scale, 1 for the skipped count and, with the stall alarm on, 3 for its count; the rule
        on tensors (hysteresis, a ``max_loss_scale``, other factors) costs about 18. No sync."""
        if self.dev is None:
            self._to_device()
        d = cast(_DeviceRecords, self.dev)
        rule = cast(DynamicRule, self.rule)
        scale = self._scale
        if self.alarm_on:
            # stall_update's count, in three ops: with g = found * (scale <= floor), a step
            # skipped at the floor gives count + 1 and any other step 0, i.e. (count + 1) * g
            g = found * (scale <= rule.min_loss_scale)
            d.stalled = torch.addcmul(g, d.stalled, g)
        d.skipped.add_(found)
        d.steps += 1
        if d.steps >= _FOLD_EVERY:
            d.skipped_base = d.skipped_base + d.skipped.long()
            d.skipped = torch.zeros_like(d.skipped)
            d.steps = 0
        factors = fused_factors(rule) if d.above_floor and scale.device.type != "mps" else None
        if factors is not None:
            # The kernel computes the rule from a scale >= the floor (fused_factors); then
            # the rule's floor. In place: the device home's scale is a live tensor.
            torch._amp_update_scale_(scale, d.good, found, *factors, rule.increment_period)
            scale.clamp_min_(rule.min_loss_scale)
        else:
            widen = None if scale.device.type == "mps" else torch.Tensor.double
            state = DynamicState(scale, d.good, d.bad)
            new = _advance(state, found == 0, rule, widen, torch.Tensor.float)
            self._scale, d.good, d.bad = new
        self._inv = None
        d.found = found
        self.applied_host = None

    def _to_device(self) -> None:
        host = cast(DynamicState, self.host)
        rule = cast(DynamicRule, self.rule)
        d = _DeviceRecords()
        device = self.device
        counter = torch.int32 if rule.increment_period < 2**31 - 1 else torch.int64
        d.good = torch.full((), int(host.good_steps), dtype=counter, device=device)
        d.bad = torch.full((), int(host.nonfinite_steps), dtype=torch.int64, device=device)
        d.skipped_base = torch.full((), self.host_skipped, dtype=torch.int64, device=device)
        d.skipped = torch.zeros((), dtype=torch.float32, device=device)
        d.stalled = torch.full((), float(self.host_stalled), dtype=torch.float32, device=device)
        d.found = None
        d.applied = bool(self.applied_host)
        d.steps = 0
        d.above_floor = float(host.loss_scale) >= rule.min_loss_scale
        self.dev = d
        self.host = None
        # the device home updates the scale in place: a tensor handed out before (a snapshot
        # of the host home) must keep its value
        self._scale = self._scale.clone()

    def _to_host(self) -> None:
        d = cast(_DeviceRecords, self.dev)
        scale, good, bad, skipped, stalled, applied = self._device_values()
        self.host = _host_state(scale, good, bad)
        self.host_skipped, self.host_stalled = skipped, stalled
        self.applied_host = d.applied if applied is None else applied
        self.dev = None

    def _device_values(self) -> tuple[float, int, int, int, int, bool | None]:
        """The device home's (scale, good_steps, nonfinite_steps, skipped, stalled, whether
        the last device-home step applied, or None before one), in one read: a host sync on
        a GPU."""
        d = cast(_DeviceRecords, self.dev)
        parts = [
            self._scale.double(),
            d.good.double(),
            d.bad.double(),
            d.skipped_base.double() + d.skipped.double(),
            d.stalled.double(),
        ]
        if d.found is not None:
            parts.append((d.found == 0).double())
        values = torch.stack(parts).tolist()
        applied = bool(values[5]) if d.found is not None else None
        return values[0], int(values[1]), int(values[2]), int(values[3]), int(values[4]), applied

    # -- host reads and checkpoints -------------------------------------------------------------
    def host_values(self) -> tuple[float, int, int, int, int]:
        """(scale, good_steps, nonfinite_steps, skipped, stalled) of a dynamic scale as
        Python numbers: free in the host home, one read (a host sync on a GPU) in the device
        home, which stays the home."""
        if self.dev is None:
            host = cast(DynamicState, self.host)
            return (
                float(host.loss_scale),
                int(host.good_steps),
                int(host.nonfinite_steps),
                self.host_skipped,
                self.host_stalled,
            )
        return self._device_values()[:5]

    def read(self, stacklevel: int = 2) -> tuple[float, int, int, int, int]:
        """:meth:`host_values`, and the stall alarm's check on them (no second read);
        ``stacklevel`` as for :meth:`check_stall`."""
        values = self.host_values()
        self._alarm(values[0], values[4], stacklevel + 3)
        return values

    def check_stall(self, stacklevel: int = 2) -> None:
        """The stall alarm's host-side check: free in the host home; in the device home it
        reads the count (a host sync on a GPU). ``stacklevel``: the frame the warning names,
        counted from the caller of this method (1: the caller, 2: its caller, ...)."""
        if self.alarm_on:
            self.read(stacklevel + 1)  # one frame deeper

    def _alarm(self, scale: float, count: int, stacklevel: int) -> None:
        """Warn or raise when ``count`` reached the threshold (``stacklevel`` from
        :func:`report_stall`)."""
        if not self.alarm_on:
            return
        alarm = cast(StallAlarm, self.alarm)
        if count < cast(int, alarm.steps) and not self.stall_warned:
            return
        self.stall_warned = report_stall(
            count, scale, alarm, warned=self.stall_warned, where=self.where, stacklevel=stacklevel
        )

    def good_steps(self) -> int:
        """The growth counter as a Python int (a host sync on a GPU in the device home)."""
        if self.dev is None:
            return int(cast(DynamicState, self.host).good_steps)
        return int(self.dev.good.item())

    def good_steps_tensor(self) -> torch.Tensor:
        """The growth counter as a 0-d int32 tensor on ``device`` (no sync: a fill from the
        host value, or the device home's counter itself)."""
        if self.dev is None:
            good = int(cast(DynamicState, self.host).good_steps)
            return torch.full((), good, dtype=torch.int32, device=self.device)
        return self.dev.good

    def skipped_count(self) -> int:
        """The skipped steps as a Python int (a host sync on a GPU in the device home)."""
        return self.host_skipped if self.dev is None else int(self.skipped.item())

    def state_dict(self, values: tuple[float, int, int, int, int] | None = None) -> dict[str, Any]:
        """The checkpoint dict of :mod:`lossscale.core._checkpoint`, from :meth:`host_values`
        already read, else read here (a host sync on a GPU in the device home)."""
        if self.rule is None:
            return scale_state_dict(self.initial_scale)
        scale, good, bad, _, _ = self.host_values() if values is None else values
        return scale_state_dict(scale, (good, bad))

    def check_state_dict(self, state: Any) -> tuple[float, int, int] | None:
        """Validate a checkpoint dict against this configuration (ValueError naming the key);
        nothing changes."""
        if self.rule is None:
            read_fixed_state(state, self.initial_scale)
            return None
        return read_dynamic_state(state, self.rule)

    def load(self, scale: float, good: int, bad: int) -> None:
        """Set a validated dynamic state, in the host home (one fill; no sync). The skipped
        count is kept; the stall count restarts."""
        if self.dev is not None:
            self.host_skipped = self.skipped_count()
            self.dev = None
        self.host = _host_state(scale, good, bad)
        self._set_scale_tensor(scale)
        self.host_stalled = 0
        self.stall_warned = False

    def set_rule(self, rule: DynamicRule) -> None:
        """Replace the hyperparameters (GradScaler's setters); the state is kept."""
        self.rule = rule

    def set_scale(self, value: float) -> None:
        """Replace the current scale with ``value`` (a validated float32 value); counters
        kept. One fill; no sync."""
        if self.dev is None:
            host = cast(DynamicState, self.host)
            self.host = host._replace(loss_scale=np.float32(value))
        else:
            self.dev.above_floor = value >= cast(DynamicRule, self.rule).min_loss_scale
        self._set_scale_tensor(value)
