"""The stall alarm in an optax state: a count on the device, the alarm's setting as static data.

The count (consecutive skipped steps at ``min_loss_scale``) advances inside the jitted
``update`` with :func:`lossscale.core.stall_update`: a few scalar operations on the device, no
host sync, no callback. The host side, :func:`check_stall`, reads it where the user chooses
(every N steps, or where the loop already reads the loss) and calls
:func:`lossscale.core.report_stall`.

The alarm is not raised from inside ``update`` with ``jax.debug.callback``: a callback is not
free even when it does not fire (it adds a host custom-call to the compiled step and orders the
step against the host, inside a ``lax.cond`` too), whereas the count is a single 0-d leaf. The
measured costs are on the Performance page (``docs/performance.md``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from lossscale.core._stall import StallAlarm, report_stall


@jax.tree_util.register_pytree_with_keys_class
class StallCount:
    """The stall alarm's part of a :class:`LossScaleState`: one leaf and the static setting.

    Attributes:
      count: 0-d int32 leaf: consecutive skipped steps taken with the scale at its minimum
        (0 after any finite step or any step above the minimum).
      alarm: the :class:`lossscale.core.StallAlarm` (static aux data: it survives ``jit``,
        ``tree_map`` and a checkpoint restored into a template, and never recompiles).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer
      >>> state = loss_scale_optimizer(optax.sgd(0.1), stall_steps=10).init(jnp.ones(2))
      >>> int(state.stall.count), state.stall.alarm
      (0, StallAlarm(steps=10, action='warn'))
      >>> bool(state.stall.stalled)
      False
    """

    __slots__ = ("alarm", "count")
    count: Any
    alarm: StallAlarm

    def __init__(self, count: Any, alarm: StallAlarm) -> None:
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "alarm", alarm)

    def tree_flatten_with_keys(self) -> tuple[list[tuple[GetAttrKey, Any]], StallAlarm]:
        """One leaf, ``count``; aux data: the alarm."""
        return [(GetAttrKey("count"), self.count)], self.alarm

    def tree_flatten(self) -> tuple[tuple[Any], StallAlarm]:
        """``(count,)`` and the alarm."""
        return (self.count,), self.alarm

    @classmethod
    def tree_unflatten(cls, alarm: StallAlarm, leaves: Any) -> StallCount:
        """Rebuild from :meth:`tree_flatten`'s output."""
        return cls(leaves[0], alarm)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StallCount is immutable")

    def __reduce__(self) -> tuple[type[StallCount], tuple[Any, StallAlarm]]:
        """Pickle and copy through the constructor (the instance is immutable)."""
        return StallCount, (self.count, self.alarm)

    def __repr__(self) -> str:
        return f"StallCount(count={self.count!r}, alarm={self.alarm!r})"

    @property
    def stalled(self) -> jax.Array:
        """0-d bool: the count has reached the alarm's threshold (always False when the alarm
        is off). A comparison on the device: no sync; usable under ``jit``."""
        if self.alarm.steps is None:
            return jnp.zeros(jnp.shape(self.count), jnp.bool_)
        return jnp.asarray(self.count) >= self.alarm.steps


def check_stall_count(stall: StallCount, loss_scale: Any, *, warned: bool, where: str) -> bool:
    """Host side of :func:`lossscale.jax.check_stall` on an unwrapped :class:`StallCount`."""
    if stall.alarm.steps is None:
        return False
    if isinstance(stall.count, jax.core.Tracer):
        raise TypeError(
            "check_stall reads the state on the host: call it outside jax.jit (on the state "
            "a jitted step returned); inside jit, read state.stall.stalled instead"
        )
    count = int(np.max(np.asarray(stall.count)))  # one device-to-host read (max over replicas)
    if count < stall.alarm.steps:
        return False
    scale = float(np.min(np.asarray(loss_scale)))  # read only when the alarm fires
    # the warning points at the caller of check_stall: report_stall <- here <- check_stall <- user
    return report_stall(count, scale, stall.alarm, warned=warned, where=where, stacklevel=4)
