"""TensorFlow's ``LossScale`` classes, as stateful objects over the pure core rule."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

from lossscale.core import _validation as v
from lossscale.core._backends import NUMPY, ArrayNamespace
from lossscale.core._checkpoint import (
    read_dynamic_state,
    read_fixed_state,
    scale_state_dict,
)
from lossscale.core._rule import (
    DynamicState,
    RuleAttributes,
    dynamic_rule,
    dynamic_state,
    dynamic_update,
)
from lossscale.core._settings import (
    EXTENSION_DEFAULTS,
    extension_config,
    fixed_value,
    register_loss_scale_classes,
)
from lossscale.core._stall import DEFAULT_STALL_STEPS, report_stall, stall_alarm, stall_update
from lossscale.core._tree import flatten_grads


class LossScale(abc.ABC):
    """Base class of loss scales (TensorFlow's ``tf.mixed_precision.experimental.LossScale``).

    A loss scale multiplies the loss before the backward pass so that small float16 gradients
    do not underflow; the gradients are divided by it before they are applied. Subclasses
    implement ``__call__`` (the current scale), ``update(grads)`` (adjust the scale from this
    step's gradients, say whether to apply them) and ``get_config``.

    ``LossScale()`` itself raises ``TypeError`` (it is abstract).

    Example:
      >>> import lossscale
      >>> [isinstance(lossscale.get(x), lossscale.LossScale) for x in (8, "dynamic")]
      [True, True]
      >>> lossscale.LossScale()
      Traceback (most recent call last):
      ...
      TypeError: Can't instantiate abstract class LossScale...
    """

    @abc.abstractmethod
    def __call__(self) -> Any:
        """The current loss scale as a 0-d float32 array."""

    @abc.abstractmethod
    def update(self, grads: Any) -> tuple[None, Any]:
        """Update the scale from ``grads``; return ``(update_op, should_apply_gradients)``."""

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as TensorFlow's ``get_config``."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScale:
        """``cls(**config)``: a new instance, at its initial state (TensorFlow's rule).

        Unknown keys raise ``TypeError``; missing keys take the constructor's defaults.
        """
        return cls(**config)

    def state_dict(self) -> dict[str, Any]:
        """The current state as a dict of Python numbers (see the subclasses)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement state_dict()")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state written by :meth:`state_dict` (see the subclasses)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement load_state_dict()")


class FixedLossScale(LossScale):
    """A loss scale that never changes (TensorFlow's ``FixedLossScale``).

    ``update`` never inspects the gradients and always says to apply them, so non-finite
    gradients are applied (TensorFlow's behaviour); use :class:`DynamicLossScale` to skip them.

    Args:
      loss_scale_value: a Python int/float or NumPy real scalar, at least 1 and finite in
        float32. ``bool`` is a ``TypeError``; values < 1, NaN, inf or above the largest float32
        are a ``ValueError`` (TensorFlow accepts NaN and inf).

    Example:
      >>> import lossscale
      >>> ls = lossscale.FixedLossScale(1024)
      >>> float(ls()), ls.update([float("nan")]), ls.get_config()
      (1024.0, (None, True), {'loss_scale_value': 1024.0})
    """

    def __init__(self, loss_scale_value: Any) -> None:
        self._value = fixed_value("loss_scale_value", loss_scale_value)

    def __call__(self) -> Any:
        """The scale as a new 0-d float32 NumPy array (one host allocation, no device work)."""
        return NUMPY.scalar(self._value, "float32", None)

    def update(self, grads: Any) -> tuple[None, bool]:
        """Return ``(None, True)`` without looking at ``grads``: no work, no sync, never skips."""
        return None, True

    def get_config(self) -> dict[str, Any]:
        """``{'loss_scale_value': float}``, as TensorFlow."""
        return {"loss_scale_value": self._value}

    def state_dict(self) -> dict[str, Any]:
        """``{'version': 1, 'class_name': 'FixedLossScale', 'current_loss_scale': float}``."""
        return scale_state_dict(self._value)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check ``state`` matches this scale (a fixed scale has no state to restore).

        Raises ``ValueError`` naming the key for a malformed state, a state of another class,
        or a different value; nothing changes either way.
        """
        read_fixed_state(state, self._value)

    def __repr__(self) -> str:
        return f"FixedLossScale({self._value!r})"


class DynamicLossScale(RuleAttributes, LossScale):
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    TensorFlow's ``DynamicLossScale``, same arguments, same trajectory bit for bit with the
    defaults of the keyword-only extensions. The rule is :class:`lossscale.core.DynamicRule`'s
    (its docstring states the algorithm), run by :func:`lossscale.core.dynamic_update`, the
    function every front end calls.

    The state (scale and counters) is a set of 0-d arrays that lives with the gradients: NumPy
    until ``update`` sees torch tensors or JAX arrays, then on their library and device (no host
    sync on that path).

    Args:
      initial_loss_scale: finite, > 0 in float32 and ≤ ``max_loss_scale``; it may lie below
        ``min_loss_scale`` (the first back-off lifts it to the floor, as TensorFlow).
      increment_period: int ≥ 1; the scale grows on this many consecutive finite steps.
      multiplier: finite, > 1: the growth factor, and the divisor on back-off.
      min_loss_scale: the floor of back-offs, > 0 (may be below 1); default 1 (TensorFlow).
      max_loss_scale: growth beyond it is refused; default the largest float32.
      hysteresis: int ≥ 1: back off on the hysteresis-th non-finite step counted since the last
        back-off or growth; the allowance refills when the scale backs off and when
        ``increment_period`` consecutive finite steps complete (growth, or growth refused at
        the maximum). Every non-finite step is skipped whatever the value. Default 1
        (TensorFlow: back off at once).
      hysteresis_refill: when the allowance refills: ``"on_backoff"`` (default, as above),
        ``"on_growth"`` (only on growth: DeepSpeed's and Megatron-core's rule) or
        ``"on_finite_step"`` (on every finite step: DeepSpeed's ``consecutive_hysteresis``);
        see :class:`lossscale.core.DynamicRule`.
      stall_steps: the stall alarm (:mod:`lossscale.core._stall`): after this many consecutive
        skipped steps at ``min_loss_scale``, warn once (re-armed by a finite step) or raise;
        None turns it off. Default 1000. The count is checked in :meth:`update` while the state
        lives in host memory (NumPy, CPU tensors and arrays: no device sync); on an accelerator
        it is kept on the device and checked only where the state is read on the host anyway
        (:attr:`num_good_steps`, :attr:`stalled_steps`, :meth:`state_dict`). It is not part of
        the checkpoint (a resumed run counts afresh).
      on_stall: ``"warn"`` (default, :class:`lossscale.core.LossScaleStalledWarning`) or
        ``"raise"`` (:class:`lossscale.core.LossScaleStalledError`).

    Example:
      >>> import numpy as np, lossscale
      >>> ls = lossscale.DynamicLossScale(initial_loss_scale=8, increment_period=2)
      >>> for g in ([np.float32(1)], [np.float32(1)], {"w": np.array([np.nan, 1.0])}):
      ...     _, ok = ls.update(g)
      ...     print(bool(ok), float(ls()), ls.num_good_steps)
      True 8.0 1
      True 16.0 0
      False 8.0 0
    """

    _EXTENSION_DEFAULTS: ClassVar[dict[str, float | int | str]] = EXTENSION_DEFAULTS

    def __init__(
        self,
        initial_loss_scale: Any = 2**15,
        increment_period: Any = 2000,
        multiplier: Any = 2.0,
        *,
        min_loss_scale: Any = 1.0,
        max_loss_scale: Any = v.FLOAT32_MAX,
        hysteresis: Any = 1,
        hysteresis_refill: Any = "on_backoff",
        stall_steps: Any = DEFAULT_STALL_STEPS,
        on_stall: Any = "warn",
    ) -> None:
        v.real("initial_loss_scale", initial_loss_scale)  # type before the other arguments' ranges
        self._rule = dynamic_rule(
            increment_period,
            multiplier,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            hysteresis_refill=hysteresis_refill,
        )
        self._alarm = stall_alarm(stall_steps, on_stall)
        self._state: DynamicState = dynamic_state(initial_loss_scale, self._rule)
        self._xp: ArrayNamespace = NUMPY
        self._initial_loss_scale = float(initial_loss_scale)
        self._stalled = NUMPY.scalar(0, "int", None)  # lives beside the state (same library)
        self._stall_warned = False

    # -- TensorFlow's properties ---------------------------------------------------------
    @property
    def initial_loss_scale(self) -> float:
        """The constructor's ``initial_loss_scale`` (never the current scale)."""
        return self._initial_loss_scale

    @property
    def num_good_steps(self) -> int:
        """Consecutive finite steps counted toward the next growth, as a Python int.

        Reads the counter: a host sync when the state lives on a GPU (which also runs the
        stall alarm's check, see ``stall_steps``).
        """
        self._check_stall(self._stalled_host())
        return self._xp.to_host_int(self._state.good_steps)

    @property
    def stalled_steps(self) -> int:
        """Consecutive steps skipped at ``min_loss_scale`` (the stall alarm's count), as a
        Python int. Reads the count (a host sync when the state lives on a GPU) and runs the
        alarm's check."""
        count = self._stalled_host()
        self._check_stall(count)
        return count

    def _check_stall(self, count: int) -> None:
        self._stall_warned = report_stall(
            count,
            self._xp.to_host_float(self._state.loss_scale),
            self._alarm,
            warned=self._stall_warned,
            where="DynamicLossScale",
            stacklevel=4,
        )

    @property
    def state(self) -> DynamicState:
        """The current :class:`lossscale.core.DynamicState` (0-d arrays; do not mutate them)."""
        return self._state

    # -- the LossScale contract -------------------------------------------------------------
    def __call__(self) -> Any:
        """The current scale: a 0-d float32 array of the state's library, on its device.

        A snapshot: later updates do not change it. NumPy and torch: a new 0-d array (one tiny
        copy on the device, no host sync); JAX: the immutable state array itself.
        """
        return self._xp.copy(self._state.loss_scale)

    def update(self, grads: Any) -> tuple[None, Any]:
        """Adjust the scale from this step's (unscaled) gradients.

        Args:
          grads: any nesting of list/tuple/dict of float gradients (NumPy arrays, Python floats,
            torch tensors or eager JAX arrays; one library at a time), ``None`` entries allowed.
            An empty structure counts as a finite step.

        Returns:
          ``(None, should_apply)``: ``should_apply`` is a 0-d bool array of the gradients'
          library (``bool()`` works; that call syncs on a GPU): True when every gradient is
          finite. On a non-finite step the caller must skip applying the gradients; the scale
          backs off (:class:`lossscale.core.DynamicRule`) and nothing else changes.

        Device: the check and the rule run on the gradients' device with a handful of small
        kernels and no host sync. The first update with torch or JAX gradients moves the state
        there (an allocation per state array); the state then stays on that library and device.

        Raises:
          TypeError: an integer, bool, complex or string gradient (naming the entry), a
            non-array leaf, arrays of two libraries, or JAX tracers (use
            :func:`lossscale.core.dynamic_update` inside ``jax.jit``). The state is unchanged.
        """
        leaves = flatten_grads(grads)
        if leaves.namespace is None:
            # Nothing but Python floats (converted to NumPy float32) or no gradient at all:
            # judged on the host; the state stays on its library and device.
            xp, state = self._xp, self._state
            finite = bool(NUMPY.all_finite(leaves.arrays, None))
            is_finite = xp.scalar(finite, "bool", state.loss_scale)
        else:
            xp = leaves.namespace
            if any(xp.is_traced(a) for a in leaves.arrays):
                raise TypeError(
                    "DynamicLossScale.update got traced JAX arrays (inside jax.jit); it keeps "
                    "state in Python. Inside a traced function use "
                    "lossscale.core.dynamic_update with an explicit lossscale.core.DynamicState "
                    "instead"
                )
            state = self._state_for(xp, leaves.arrays[0])
            is_finite = xp.all_finite(leaves.arrays, state.loss_scale)
        stalled = self._stalled_for(xp, state.loss_scale)
        self._stalled = stall_update(stalled, is_finite, state.loss_scale, self._rule, xp)
        self._state = dynamic_update(state, is_finite, self._rule, xp)
        self._xp = xp
        if self._alarm.steps is not None and xp.on_host(self._stalled):
            self._check_stall(xp.to_host_int(self._stalled))  # host memory: no device sync
        return None, is_finite

    def _stalled_for(self, xp: ArrayNamespace, like: Any) -> Any:
        """The stall count on ``xp``'s library and ``like``'s device, moved there if needed."""
        if xp.owns(self._stalled):
            if xp.same_place(self._stalled, like):
                return self._stalled
            return xp.move(self._stalled, like)
        return xp.scalar(int(self._stalled_host()), "int", like)

    def _stalled_host(self) -> int:
        """The stall count as a Python int (a host sync when it lives on a GPU)."""
        xp = self._xp if self._xp.owns(self._stalled) else NUMPY
        return xp.to_host_int(self._stalled)

    def _state_for(self, xp: ArrayNamespace, like: Any) -> DynamicState:
        """The state on ``xp``'s library and ``like``'s device, moved there if needed."""
        if xp is self._xp:
            if like is None or xp.same_place(self._state.loss_scale, like):
                return self._state
            return DynamicState(*(xp.move(a, like) for a in self._state))
        # Another library: go through host values (a sync only when leaving a device).
        scale = self._xp.to_host_float(self._state.loss_scale)
        good = self._xp.to_host_int(self._state.good_steps)
        bad = self._xp.to_host_int(self._state.nonfinite_steps)
        return DynamicState(
            xp.scalar(scale, "float32", like),
            xp.scalar(good, "int", like),
            xp.scalar(bad, "int", like),
        )

    def get_config(self) -> dict[str, Any]:
        """TensorFlow's three keys; the extension arguments only where not at their defaults.

        ``{'initial_loss_scale': float, 'increment_period': int, 'multiplier': float}`` — the
        constructor values, never the current scale (as TensorFlow).
        """
        config: dict[str, Any] = {
            "initial_loss_scale": self._initial_loss_scale,
            "increment_period": self._rule.increment_period,
            "multiplier": self._rule.multiplier,
        }
        config.update(extension_config(self._rule, self._alarm))
        return config

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The current scale and counters as Python numbers (lossless: the float32 scale is
        exact in a Python float).

        ``{'version': 1, 'class_name': 'DynamicLossScale', 'current_loss_scale': float,
        'num_good_steps': int, 'num_nonfinite_steps': int}``. The configuration is not part
        of the state (as TensorFlow's checkpoints); :meth:`get_config` holds it.

        Device: reads three 0-d arrays, a host sync when the state lives on a GPU.
        """
        self._check_stall(self._stalled_host())
        return scale_state_dict(
            self._xp.to_host_float(self._state.loss_scale),
            (
                self._xp.to_host_int(self._state.good_steps),
                self._xp.to_host_int(self._state.nonfinite_steps),
            ),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state written by :meth:`state_dict`, keeping this object's configuration.

        Works on a fresh object before any update. The state is put on the library and device
        the current state lives on (three small fills, no host sync).

        Raises:
          ValueError: naming the key, for a state that is not a dict, has another version or
            class, misses or adds a key, has a wrong type, a scale that is not finite and > 0
            or exceeds ``max_loss_scale``, or a counter outside ``[0, increment_period)`` /
            ``[0, hysteresis)``. The object is unchanged.
        """
        scale, good, bad = read_dynamic_state(state, self._rule)
        xp, like = self._xp, self._state.loss_scale
        self._state = DynamicState(
            xp.scalar(scale, "float32", like),
            xp.scalar(good, "int", like),
            xp.scalar(bad, "int", like),
        )
        self._stalled, self._stall_warned = xp.scalar(0, "int", like), False

    def __repr__(self) -> str:
        """TensorFlow's eager repr (reads the state: a host sync on a GPU)."""
        # TF formats the float32 value with %s: NumPy's shortest float32 text (3.3333333).
        current = str(np.float32(self._xp.to_host_float(self._state.loss_scale)))
        extra = "".join(
            f", {key}={getattr(self._rule, key)!r}"
            for key, default in self._EXTENSION_DEFAULTS.items()
            if getattr(self._rule, key) != default
        )
        return (
            f"DynamicLossScale(current_loss_scale={current}, "
            f"num_good_steps={self.num_good_steps}, "
            f"initial_loss_scale={self._initial_loss_scale!r}, "
            f"increment_period={self._rule.increment_period!r}, "
            f"multiplier={self._rule.multiplier!r}{extra})"
        )


register_loss_scale_classes(FixedLossScale, DynamicLossScale)
