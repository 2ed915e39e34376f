"""Functional loss-scale values for JAX: frozen pytrees, TensorFlow's names.

:class:`DynamicLossScale` and :class:`FixedLossScale` are immutable values: every method returns
a new value and nothing is modified in place, so they pass through ``jax.jit``, ``jax.vmap``,
``lax.scan``, ``jax.tree_util`` and checkpointers like any other pytree.

Leaves and static data are chosen deliberately:

* the **leaves** are the state (the float32 scale and the integer counters), so a new scale is
  new *data*: changing it never retraces or recompiles a jitted function;
* the **static aux data** of :class:`DynamicLossScale` is its :class:`lossscale.core.DynamicRule`
  (a hashable tuple of Python numbers), so every hyperparameter (``min_loss_scale`` included)
  survives ``tree_flatten``/``tree_unflatten``, ``jit``, ``vmap`` and a checkpoint restored
  into a template (jmp's ``DynamicLossScale`` drops ``min_loss_scale`` there).

The update rule is :func:`lossscale.core.dynamic_update`, the same function every other part of
lossscale calls; this module only checks the gradients and hands the flag over.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from lossscale.core import _validation as v
from lossscale.core._backends import JaxNamespace
from lossscale.core._rule import (
    DynamicRule,
    DynamicState,
    RuleAttributes,
    dynamic_rule,
    dynamic_state,
    dynamic_update,
)
from lossscale.core._settings import fixed_value
from lossscale.jax._gradients import all_finite, scale_tree, unscale_tree

#: The array namespace through which the core rule runs on JAX arrays (eager or traced).
JAX = JaxNamespace(jax)

_STATE_FIELDS = ("loss_scale", "good_steps", "nonfinite_steps")


def _concrete_number(name: str, value: Any) -> Any:
    """A concrete 0-d real array (``jnp.asarray(2.0**15)``, ``np.asarray(10)``, as jmp users write
    them) as a Python number; anything else unchanged, for the usual checks in core.

    Raises:
      TypeError: a traced value (the configuration must be known when the value is built,
        outside ``jit``).
        An array with a shape is a TypeError too (a hyperparameter is one number, not an
        array), naming the shape.
    """
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number, got a traced value {value!r}; build the loss "
            "scale outside jax.jit (its scale is data, so a new value never recompiles)"
        )
    if isinstance(value, jax.Array | np.ndarray):
        if value.ndim != 0:
            raise TypeError(
                f"{name} must be a number or a 0-d array, got an array of shape {value.shape}"
            )
        if jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer):
            return value.item()
    return value


def concrete_numbers(**values: Any) -> list[Any]:
    """:func:`_concrete_number` of each keyword argument, in order (named by its keyword)."""
    return [_concrete_number(name, value) for name, value in values.items()]


def _leaf_equal(a: Any, b: Any, what: str) -> bool:
    """Whether two state leaves hold the same values (a host read of each; tracers refused)."""
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        raise TypeError(
            f"cannot compare {what} values holding traced arrays (inside jax.jit, vmap, ...): "
            "equality is a Python bool; compare the leaves with jnp.array_equal instead"
        )
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


@jax.tree_util.register_pytree_with_keys_class
class DynamicLossScale(RuleAttributes):
    """A dynamic loss scale as a frozen pytree (TensorFlow's ``DynamicLossScale``, functional).

    The rule is :class:`lossscale.core.DynamicRule`'s (its docstring states the algorithm),
    run by :func:`lossscale.core.dynamic_update`, the function :class:`lossscale.DynamicLossScale`
    runs too, so the trajectories agree bit for bit.

    The scale is a float32 leaf whatever the compute dtype (jmp#47); the counters are integer
    leaves (int32 unless x64 is enabled). The hyperparameters are static aux data: a changed
    scale never recompiles, and ``min_loss_scale`` and friends survive every pytree round trip.

    Args:
      initial_loss_scale: finite, > 0 in float32 and ≤ ``max_loss_scale``; default 2**15.
      increment_period: int ≥ 1; default 2000.
      multiplier: finite, > 1; default 2.0.
      min_loss_scale: floor of back-offs, > 0 (may be < 1); default 1.0.
      max_loss_scale: growth beyond it is refused; default the largest float32.
      hysteresis: back off on the hysteresis-th non-finite step; default 1 (TensorFlow).
      hysteresis_refill: when the hysteresis allowance refills, ``"on_backoff"`` (default),
        ``"on_growth"`` or ``"on_finite_step"`` (:class:`lossscale.core.DynamicRule`).

    Every hyperparameter may be a Python or NumPy number or a concrete 0-d NumPy/JAX array
    (jmp's style: ``DynamicLossScale(jnp.asarray(2**15), increment_period=jnp.asarray(10))``);
    an integer argument needs an integer array.

    Equality: two values are equal when they have the same rule and their state leaves hold the
    same values (``ls.adjust(True) == ls.adjust(True)``, ``tree_map(lambda x: x, ls) == ls``).
    It reads the leaves on the host (a sync per leaf on an accelerator) and is a ``TypeError``
    on traced values (inside ``jit``: compare ``.state`` with ``jnp.array_equal``). The values
    are unhashable, like the arrays they hold.

    Raises:
      TypeError, ValueError: as :class:`lossscale.DynamicLossScale` (the same checks in
        :mod:`lossscale.core`, the same messages); a traced hyperparameter or an array with a
        shape is a TypeError.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale.jax import DynamicLossScale
      >>> ls = DynamicLossScale(initial_loss_scale=8, increment_period=2)
      >>> step = jax.jit(lambda ls, g: ls.update(g))
      >>> for g in (jnp.ones(2), jnp.ones(2), jnp.array([jnp.nan, 1.0])):
      ...     ls, ok = step(ls, g)
      ...     print(bool(ok), float(ls.loss_scale), int(ls.good_steps))
      True 8.0 1
      True 16.0 0
      False 8.0 0
    """

    __slots__ = ("_rule", "_state")
    _rule: DynamicRule
    _state: DynamicState

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
    ) -> None:
        initial_loss_scale = _concrete_number("initial_loss_scale", initial_loss_scale)
        v.real("initial_loss_scale", initial_loss_scale)  # its type before the others' ranges
        rule = dynamic_rule(
            _concrete_number("increment_period", increment_period),
            _concrete_number("multiplier", multiplier),
            min_loss_scale=_concrete_number("min_loss_scale", min_loss_scale),
            max_loss_scale=_concrete_number("max_loss_scale", max_loss_scale),
            hysteresis=_concrete_number("hysteresis", hysteresis),
            hysteresis_refill=hysteresis_refill,
        )
        object.__setattr__(self, "_rule", rule)
        object.__setattr__(self, "_state", dynamic_state(initial_loss_scale, rule, xp=JAX))

    @classmethod
    def from_state(cls, state: DynamicState, rule: DynamicRule) -> DynamicLossScale:
        """A value from an explicit state and rule, without any check (used by unflattening).

        ``state``'s leaves may be arrays, tracers or anything a JAX transformation puts there.
        """
        obj = object.__new__(cls)
        object.__setattr__(obj, "_rule", rule)
        object.__setattr__(obj, "_state", DynamicState(*state))
        return obj

    # -- pytree protocol --------------------------------------------------------------------
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass (say, one that logs in ``adjust``) is a pytree too, so it passes through
        ``jit`` and comes back from ``adjust``/``update`` as itself."""
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys_class(cls)

    def tree_flatten_with_keys(self) -> tuple[list[tuple[GetAttrKey, Any]], DynamicRule]:
        """Leaves ``loss_scale``, ``good_steps``, ``nonfinite_steps``; aux data: the rule."""
        return [(GetAttrKey(k), x) for k, x in zip(_STATE_FIELDS, self._state, strict=True)], (
            self._rule
        )

    def tree_flatten(self) -> tuple[tuple[Any, ...], DynamicRule]:
        """The three state leaves and the (hashable) rule."""
        return tuple(self._state), self._rule

    @classmethod
    def tree_unflatten(cls, rule: DynamicRule, leaves: Any) -> DynamicLossScale:
        """Rebuild from :meth:`tree_flatten`'s output: every rule field is kept."""
        return cls.from_state(DynamicState(*leaves), rule)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; methods return new values")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __getstate__(self) -> tuple[DynamicRule, DynamicState]:
        return self._rule, self._state

    def __setstate__(self, data: tuple[DynamicRule, DynamicState]) -> None:
        object.__setattr__(self, "_rule", DynamicRule(*data[0]))
        object.__setattr__(self, "_state", DynamicState(*data[1]))

    # -- the state --------------------------------------------------------------------------
    @property
    def loss_scale(self) -> jax.Array:
        """The current scale: a 0-d float32 array (no copy, no sync)."""
        return self._state.loss_scale  # type: ignore[no-any-return]

    def __call__(self) -> jax.Array:
        """The current scale (TensorFlow's ``loss_scale()``); same as :attr:`loss_scale`."""
        return self.loss_scale

    @property
    def good_steps(self) -> jax.Array:
        """0-d int array: consecutive finite steps counted toward the next growth."""
        return self._state.good_steps  # type: ignore[no-any-return]

    @property
    def nonfinite_steps(self) -> jax.Array:
        """0-d int array: the hysteresis allowance spent (non-finite steps since it refilled)."""
        return self._state.nonfinite_steps  # type: ignore[no-any-return]

    @property
    def state(self) -> DynamicState:
        """The :class:`lossscale.core.DynamicState` (the three leaves)."""
        return self._state

    # -- the API ----------------------------------------------------------------------------
    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next value after a step whose gradients were all finite (or not).

        Args:
          grads_finite: a 0-d bool (array or Python bool), e.g. from :func:`all_finite`.

        Returns:
          A new :class:`DynamicLossScale`. A handful of scalar ops, no host sync; inside
          ``jit`` nothing is retraced when the scale changes.

        Raises:
          TypeError: ``grads_finite`` not of bool dtype (a float 0.5 would silently count as
            finite).
          ValueError: ``grads_finite`` with a shape (it would make the scale and the counters
            vectors): reduce it first, e.g. with :func:`all_finite`. Both are checked when
            tracing, so they hold under ``jit`` too.
        """
        finite = _flag("grads_finite", grads_finite)
        return type(self).from_state(
            dynamic_update(self._state, finite, self._rule, JAX), self._rule
        )

    def update(self, grads: Any) -> tuple[DynamicLossScale, jax.Array]:
        """Check this step's (unscaled) gradients and return ``(new_loss_scale, should_apply)``.

        ``should_apply`` is a 0-d bool array, True when every floating element of ``grads`` is
        finite. On False, skip the step: leave the parameters and optimizer state as they are
        (select with ``jnp.where``/``lax.cond``; never multiply the update by 0, NaN * 0 is
        NaN). Device cost: one read of every gradient (see :func:`all_finite`) plus a few scalar
        ops; no host sync. Integer, bool and ``float0`` leaves are not read (this method does
        not unscale; :meth:`unscale` refuses integer and bool leaves).
        """
        finite = all_finite(grads)
        return self.adjust(finite), finite

    def scale(self, loss: Any) -> Any:
        """``loss * loss_scale`` (any pytree of arrays), computed and returned in at least
        float32: a float16/bfloat16 loss comes back float32, float64 stays float64. One
        multiply per leaf."""
        return scale_tree(loss, self.loss_scale)

    def unscale(self, grads: Any) -> Any:
        """``grads * (1 / loss_scale)`` in each gradient's dtype; float16/bfloat16 gradients
        are computed in float32 and cast back. Non-floating leaves pass through. One fused
        multiply per leaf (free when it fuses into the optimizer update under ``jit``)."""
        return unscale_tree(grads, self.loss_scale)

    def __eq__(self, other: object) -> bool:
        """Same rule and same state values (host reads; TypeError on traced values)."""
        if not isinstance(other, DynamicLossScale):
            return NotImplemented
        return self._rule == other._rule and all(
            _leaf_equal(a, b, "DynamicLossScale")
            for a, b in zip(self._state, other._state, strict=True)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        r = self._rule
        return (
            f"DynamicLossScale(loss_scale={self.loss_scale!r}, good_steps={self.good_steps!r}, "
            f"nonfinite_steps={self.nonfinite_steps!r}, increment_period={r.increment_period}, "
            f"multiplier={r.multiplier}, min_loss_scale={r.min_loss_scale}, "
            f"max_loss_scale={r.max_loss_scale}, hysteresis={r.hysteresis})"
        )


@jax.tree_util.register_pytree_with_keys_class
class FixedLossScale:
    """A constant loss scale as a pytree (TensorFlow's ``FixedLossScale``, functional).

    The value is a float32 *leaf*, not static data, so jitted code compiled for one value runs
    unchanged for another (jmp's ``StaticLossScale`` recompiles per value). ``update`` never
    looks at the gradients and always says to apply them, as TensorFlow: non-finite gradients
    are applied. Use :class:`DynamicLossScale` to skip them.

    Args:
      loss_scale_value: a real number (or a concrete 0-d NumPy/JAX array), at least 1 and
        finite in float32 (:func:`lossscale.core.fixed_value`, as
        :class:`lossscale.FixedLossScale`).

    Equality compares the scale values (see :class:`DynamicLossScale`).

    Example:
      >>> import jax.numpy as jnp
      >>> from lossscale.jax import FixedLossScale
      >>> ls = FixedLossScale(1024)
      >>> new, ok = ls.update([jnp.nan])
      >>> new is ls, bool(ok), float(ls.scale(jnp.float16(2)))
      (True, True, 2048.0)
    """

    __slots__ = ("_loss_scale",)
    _loss_scale: Any

    def __init__(self, loss_scale_value: Any) -> None:
        loss_scale_value = _concrete_number("loss_scale_value", loss_scale_value)
        value = fixed_value("loss_scale_value", loss_scale_value)
        object.__setattr__(self, "_loss_scale", jnp.asarray(value, dtype=jnp.float32))

    @classmethod
    def from_value(cls, loss_scale: Any) -> FixedLossScale:
        """A value holding ``loss_scale`` as is, without any check (used by unflattening)."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "_loss_scale", loss_scale)
        return obj

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass is a pytree too (see :class:`DynamicLossScale`)."""
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys_class(cls)

    def tree_flatten_with_keys(self) -> tuple[list[tuple[GetAttrKey, Any]], None]:
        """One leaf, ``loss_scale``; no aux data."""
        return [(GetAttrKey("loss_scale"), self._loss_scale)], None

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        """One leaf, the scale."""
        return (self._loss_scale,), None

    @classmethod
    def tree_unflatten(cls, aux: None, leaves: Any) -> FixedLossScale:
        """Rebuild from :meth:`tree_flatten`'s output."""
        (scale,) = leaves
        return cls.from_value(scale)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; methods return new values")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __getstate__(self) -> Any:
        return self._loss_scale

    def __setstate__(self, data: Any) -> None:
        object.__setattr__(self, "_loss_scale", data)

    @property
    def loss_scale(self) -> jax.Array:
        """The scale: a 0-d float32 array."""
        return self._loss_scale  # type: ignore[no-any-return]

    def __call__(self) -> jax.Array:
        """The scale (TensorFlow's ``loss_scale()``)."""
        return self.loss_scale

    def adjust(self, grads_finite: Any) -> FixedLossScale:
        """Return ``self``: a fixed scale never changes (no device work). ``grads_finite`` is
        checked as in :meth:`DynamicLossScale.adjust` (a 0-d bool), so that code switching
        between the two fails the same way."""
        _flag("grads_finite", grads_finite)
        return self

    def update(self, grads: Any) -> tuple[FixedLossScale, jax.Array]:
        """Return ``(self, True)`` without reading ``grads``: no device work, never skips."""
        return self, jnp.asarray(True)

    def scale(self, loss: Any) -> Any:
        """``loss * loss_scale`` in at least float32 (see :meth:`DynamicLossScale.scale`)."""
        return scale_tree(loss, self._loss_scale)

    def unscale(self, grads: Any) -> Any:
        """``grads * (1 / loss_scale)`` in each gradient's dtype, float32 math for half types
        (see :meth:`DynamicLossScale.unscale`)."""
        return unscale_tree(grads, self._loss_scale)

    def __eq__(self, other: object) -> bool:
        """Same scale value (a host read; TypeError on traced values), as for
        :class:`DynamicLossScale`: ``FixedLossScale(2) == FixedLossScale(2)``."""
        if not isinstance(other, FixedLossScale):
            return NotImplemented
        return _leaf_equal(self._loss_scale, other._loss_scale, "FixedLossScale")

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FixedLossScale(loss_scale={self._loss_scale!r})"


def _flag(name: str, value: Any) -> jax.Array:
    """A 0-d bool flag as an array, checked by core (``finite_flag``) as every front end."""
    v.finite_flag(name, value)
    return jnp.asarray(value)


#: Either loss-scale value.
LossScale: TypeAlias = DynamicLossScale | FixedLossScale


def is_loss_scale(x: Any) -> bool:
    """Whether ``x`` is a :class:`DynamicLossScale` or :class:`FixedLossScale`."""
    return isinstance(x, DynamicLossScale | FixedLossScale)


__all__: list[str] = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "is_loss_scale",
]
