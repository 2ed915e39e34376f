"""The stall alarm: training that skips every step at the minimum scale, said out loud.

At ``min_loss_scale`` with every gradient non-finite, the rule (:class:`DynamicRule`) skips
every step and can lower the scale no further: training has stopped, silently. The alarm counts
those steps and, past a threshold, warns once or raises. It observes the rule; it changes
nothing the rule does. In pseudo-code, per step, with ``loss_scale`` the scale the step used::

    if finite or loss_scale > min_loss_scale:
        stalled_steps = 0
    else:                                  # skipped, and the scale cannot go lower
        stalled_steps += 1
    if stall_steps is not None and stalled_steps >= stall_steps:
        warn once (re-armed by a finite step), or raise LossScaleStalledError

:func:`stall_update` is the count (pure, branch-free, on the state's library and device);
:func:`report_stall` is the host-side check, which each front end calls where it already reads
the step's result on the host, so that the alarm costs no extra host sync.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

from lossscale.core import _validation as v
from lossscale.core._backends import NUMPY, ArrayNamespace, namespace_of
from lossscale.core._rule import DynamicRule
from lossscale.core._warnings import warn_user

#: The default threshold: consecutive skipped steps at the minimum scale before the alarm.
DEFAULT_STALL_STEPS = 1000
#: What the alarm does: ``"warn"`` (once per stall) or ``"raise"``.
STALL_ACTIONS = ("warn", "raise")


class LossScaleStalledError(RuntimeError):
    """Raised (with ``on_stall="raise"``) when training skips every step at the minimum scale.

    Example:
      >>> from lossscale.core import LossScaleStalledError, report_stall, stall_alarm
      >>> try:
      ...     report_stall(5, 1.0, stall_alarm(5, "raise"), warned=False, where="my loop")
      ... except LossScaleStalledError as e:
      ...     print(str(e)[:60])
      my loop: the last 5 steps were all skipped with the loss sca
    """


class LossScaleStalledWarning(RuntimeWarning):
    """Warned (with ``on_stall="warn"``, the default) when training skips every step at the
    minimum scale.

    Example:
      >>> import warnings
      >>> from lossscale.core import LossScaleStalledWarning, report_stall, stall_alarm
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("error", LossScaleStalledWarning)  # the alarm as an error
      ...     try:
      ...         report_stall(9, 1.0, stall_alarm(5), warned=False, where="loop")
      ...     except LossScaleStalledWarning as w:
      ...         print(type(w).__name__)
      LossScaleStalledWarning
    """


class StallAlarm(NamedTuple):
    """A validated alarm setting.

    Attributes:
      steps: consecutive skipped steps at the minimum scale that set it off; None: off.
      action: ``"warn"`` or ``"raise"``.

    Example:
      >>> from lossscale.core import stall_alarm
      >>> stall_alarm()
      StallAlarm(steps=1000, action='warn')
      >>> stall_alarm(None).steps is None
      True
    """

    steps: int | None
    action: str


def stall_alarm(
    stall_steps: Any = DEFAULT_STALL_STEPS,
    on_stall: Any = "warn",
    *,
    names: Mapping[str, str] | None = None,
) -> StallAlarm:
    """Validate the alarm's arguments and return a :class:`StallAlarm`.

    Args:
      stall_steps: an int ≥ 1, or None to turn the alarm off.
      on_stall: ``"warn"`` (once per stall; a finite step re-arms it) or ``"raise"``.
      names: the front end's names for the two arguments, for the error messages.

    Raises:
      TypeError: ``stall_steps`` not an int or None; ``on_stall`` not a string.
      ValueError: ``stall_steps`` < 1; ``on_stall`` not one of the two actions.

    Example:
      >>> from lossscale.core import stall_alarm
      >>> stall_alarm(50, "raise")
      StallAlarm(steps=50, action='raise')
      >>> stall_alarm(0)
      Traceback (most recent call last):
      ...
      ValueError: stall_steps must be an integer >= 1, got 0
    """
    name = dict(names or {}).get
    steps = (
        None
        if stall_steps is None
        else v.integer(name("stall_steps", "stall_steps"), stall_steps, 1)
    )
    action_name = name("on_stall", "on_stall")
    if not isinstance(on_stall, str):
        raise TypeError(f"{action_name} must be 'warn' or 'raise', got {on_stall!r}")
    if on_stall not in STALL_ACTIONS:
        raise ValueError(f"{action_name} must be 'warn' or 'raise', got {on_stall!r}")
    return StallAlarm(steps, on_stall)


def stall_update(
    count: Any, is_finite: Any, loss_scale: Any, rule: DynamicRule, xp: ArrayNamespace | None = None
) -> Any:
    """The next count of consecutive skipped steps at the minimum scale: pure, no host sync.

    Args:
      count: 0-d integer array, the count so far.
      is_finite: 0-d bool array: whether this step's gradients were all finite.
      loss_scale: 0-d float32 array: the scale this step used (before the rule's update).
      rule: the rule whose ``min_loss_scale`` is the floor.
      xp: the arrays' namespace (found from ``count`` when omitted).

    Returns:
      ``count + 1`` when the step was skipped with the scale at (or below) the floor, else 0;
      a new array of ``count``'s library, device and dtype.

    Example:
      >>> import numpy as np
      >>> from lossscale.core import dynamic_rule, stall_update
      >>> rule, count = dynamic_rule(), np.asarray(0)
      >>> for finite, scale in [(False, 2.0), (False, 1.0), (False, 1.0), (True, 1.0)]:
      ...     count = stall_update(count, np.asarray(finite), np.float32(scale), rule)
      ...     print(int(count), end=" ")
      0 1 2 0
    """
    v.finite_flag("is_finite", is_finite)
    if xp is None:
        xp = namespace_of(count) or NUMPY
    zero = xp.full_like(count, 0)
    at_floor = loss_scale <= xp.full_like(loss_scale, rule.min_loss_scale)
    return xp.where(is_finite, zero, xp.where(at_floor, count + 1, zero))


def stall_message(count: int, loss_scale: float, where: str) -> str:
    """What the alarm says: the scale, the count, and what to check."""
    return (
        f"{where}: the last {count} steps were all skipped with the loss scale at its minimum "
        f"({loss_scale!r}): the gradients are not finite even at this scale, so training is not "
        "progressing. Check the inputs, labels and loss for NaN/inf (no scale fixes those); a "
        "learning rate that made the weights diverge; operations that overflow float16 even "
        "unscaled (run them in float32, or train in bfloat16); or lower min_loss_scale. "
        "stall_steps=None turns this check off; on_stall='raise' makes it an error."
    )


def report_stall(
    count: int,
    loss_scale: float,
    alarm: StallAlarm,
    *,
    warned: bool,
    where: str,
    stacklevel: int | None = 3,
) -> bool:
    """Host side: warn once or raise when ``count`` reached the alarm's threshold.

    Takes Python numbers (the front end reads them where it already syncs). Returns the new
    ``warned`` flag: True while the stall lasts (so a stall warns once), False once ``count``
    is below the threshold again (a finite step re-arms the alarm). ``stacklevel`` is the
    warning's, counted from this function (3: the caller of the function that calls it);
    None: the first frame outside lossscale and torch (the user's line).

    Raises:
      LossScaleStalledError: ``alarm.action == "raise"`` and the threshold is reached.

    Example:
      >>> import warnings
      >>> from lossscale.core import report_stall, stall_alarm
      >>> alarm = stall_alarm(3)
      >>> report_stall(2, 1.0, alarm, warned=False, where="demo")
      False
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     warned = report_stall(3, 1.0, alarm, warned=False, where="demo")
      ...     warned = report_stall(4, 1.0, alarm, warned=warned, where="demo")
      >>> warned, len(caught), caught[0].category.__name__
      (True, 1, 'LossScaleStalledWarning')
    """
    if alarm.steps is None or count < alarm.steps:
        return False
    if alarm.action == "raise":
        raise LossScaleStalledError(stall_message(count, loss_scale, where))
    if not warned:
        message = stall_message(count, loss_scale, where)
        if stacklevel is None:
            warn_user(message, LossScaleStalledWarning)
        else:
            warnings.warn(message, LossScaleStalledWarning, stacklevel=stacklevel)
    return True
