"""The scale step on the host, written once for every front end that decides a step there.

A front end whose step decision is a host bool (``lossscale.torch`` after its one sync,
DeepSpeed's and Megatron's optimizers, which read the overflow flag before they call their
scaler) advances the rule on NumPy scalars. The step is always the same four things, in this
order, and :func:`host_step` and :func:`check_host_stall` are the only place they are written:

1. count the stall (:func:`~lossscale.core.stall_update`, with the scale the step used);
2. apply the rule (:func:`~lossscale.core.dynamic_update`), which
3. refills the hysteresis allowance as the rule's ``hysteresis_refill`` says;
4. report the stall on the host (:func:`~lossscale.core.report_stall`), once per stall.

Pure host work on NumPy scalars: no device op, no sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from lossscale.core._backends import NUMPY_SCALARS, ArrayNamespace
from lossscale.core._rule import DynamicRule, DynamicState, dynamic_state, dynamic_update
from lossscale.core._stall import StallAlarm, report_stall, stall_update

__all__ = ["HostStep", "check_host_stall", "fresh_host_state", "host_state", "host_step"]

#: ``update(state, is_finite, rule, xp)``: the rule, or a front end's exact evaluation of it
#: (``lossscale.torch`` evaluates it on a float64 copy for factors float32 cannot hold).
Update = Callable[[DynamicState, Any, DynamicRule, ArrayNamespace], DynamicState]


class HostStep(NamedTuple):
    """What :func:`host_step` returns.

    Attributes:
      state: the rule's next state (NumPy scalars).
      stalled: the stall count after this step (a Python int).
    """

    state: DynamicState
    stalled: int


def host_state(scale: float, good_steps: int = 0, nonfinite_steps: int = 0) -> DynamicState:
    """A host rule state: a float32 scale and two int64 counters, as NumPy scalars (values
    already validated).

    Example:
      >>> from lossscale.core._host import host_state
      >>> state = host_state(1024.0, 3)
      >>> float(state.loss_scale), int(state.good_steps), state.nonfinite_steps.dtype
      (1024.0, 3, dtype('int64'))
    """
    return DynamicState(np.float32(scale), np.int64(good_steps), np.int64(nonfinite_steps))


def fresh_host_state(initial_scale: float, rule: DynamicRule) -> DynamicState:
    """:func:`~lossscale.core.dynamic_state` on the host (ValueError for a bad scale)."""
    return dynamic_state(initial_scale, rule, xp=NUMPY_SCALARS)


def host_step(
    state: DynamicState,
    finite: bool,
    rule: DynamicRule,
    stalled: int,
    *,
    count_stall: bool = True,
    update: Update = dynamic_update,
) -> HostStep:
    """One step on the host: count the stall, then apply the rule (its hysteresis refill
    included). Report the stall with :func:`check_host_stall` where the front end's warning
    should come from.

    Args:
      state: the rule's state, NumPy scalars (:func:`host_state`).
      finite: whether the step's gradients were all finite (the step applies).
      rule: the rule.
      stalled: the stall count so far.
      count_stall: False when the alarm is off: the count stays as it is.
      update: the rule's evaluation (default :func:`~lossscale.core.dynamic_update`).

    Example:
      >>> from lossscale.core import dynamic_rule
      >>> from lossscale.core._host import host_state, host_step
      >>> rule = dynamic_rule(hysteresis=2, hysteresis_refill="on_growth")
      >>> step = host_step(host_state(1.0), False, rule, 0)
      >>> float(step.state.loss_scale), int(step.state.nonfinite_steps), step.stalled
      (1.0, 1, 1)
    """
    flag = np.bool_(finite)
    if count_stall:
        stalled = int(stall_update(np.int64(stalled), flag, state.loss_scale, rule, NUMPY_SCALARS))
    return HostStep(update(state, flag, rule, NUMPY_SCALARS), stalled)


def check_host_stall(
    stalled: int, scale: float, alarm: StallAlarm | None, *, warned: bool, where: str
) -> bool:
    """The stall report on the host: warn once (naming the user's line) or raise when
    ``stalled`` reached the alarm's threshold; returns the new ``warned`` flag (False again
    once a finite step reset the count). Free when the alarm is off or far from its threshold.

    Raises:
      LossScaleStalledError: the alarm's action is ``"raise"`` and the threshold is reached.

    Example:
      >>> from lossscale.core import stall_alarm
      >>> from lossscale.core._host import check_host_stall
      >>> check_host_stall(2, 1.0, stall_alarm(3), warned=False, where="loop")
      False
    """
    if alarm is None or alarm.steps is None:
        return False
    if stalled < alarm.steps and not warned:
        return False
    return report_stall(stalled, scale, alarm, warned=warned, where=where, stacklevel=None)
