"""The dynamic loss-scale update rule: one pure function, written once, for every library.

Every stateful class (:class:`lossscale.DynamicLossScale`) and every framework adapter calls
:func:`dynamic_update`; there is no second copy of the algorithm anywhere in lossscale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from lossscale.core import _validation as v
from lossscale.core._backends import NUMPY, ArrayNamespace, namespace_of

#: When the hysteresis allowance refills (:class:`DynamicRule`); the first is the default.
HYSTERESIS_REFILLS = ("on_backoff", "on_growth", "on_finite_step")


class DynamicRule(NamedTuple):
    """Hyperparameters of the dynamic rule: validated Python numbers, static under ``jax.jit``.

    Build one with :func:`dynamic_rule`, which checks every value. The algorithm, for one step
    whose gradients are all finite (``finite``) or not, in float32 arithmetic::

        if finite:
            if good_steps + 1 >= increment_period:         # the increment_period-th finite step
                grown = scale * multiplier                 # judged rounded to float32
                if isfinite(grown) and grown <= max_loss_scale:
                    scale = grown                          # else: growth refused, scale kept
                good_steps = 0; nonfinite_steps = 0        # every mode refills on growth
            else:
                good_steps += 1
                if hysteresis_refill == "on_finite_step":  # DeepSpeed's consecutive_hysteresis
                    nonfinite_steps = 0
        else:                                              # NaN, +inf or -inf anywhere
            good_steps = 0
            if nonfinite_steps + 1 >= hysteresis:          # hysteresis=1: at once (TensorFlow)
                shrunk = (scale / multiplier if backoff_factor is None   # TensorFlow
                          else scale * backoff_factor)                   # torch's GradScaler
                scale = maximum(shrunk, min_loss_scale)
                if hysteresis_refill == "on_backoff":      # lossscale's default
                    nonfinite_steps = 0
                else:                                      # allowance spent: every non-finite
                    nonfinite_steps = hysteresis - 1       # step backs off until a refill
            else:
                nonfinite_steps += 1                       # absorbed: skipped, scale kept
        should_apply = finite

    ``nonfinite_steps`` counts the hysteresis allowance spent, in ``[0, hysteresis)``; it
    never runs past that. The three refills of the allowance (all three refill on growth):

    * ``"on_backoff"`` (default): also on each back-off, so every ``hysteresis``-th non-finite
      step since the last back-off or growth backs off.
    * ``"on_growth"``: only on growth; after the first back-off every non-finite step backs off
      until the next growth. DeepSpeed's ``DynamicLossScaler`` (without
      ``consecutive_hysteresis``) and Megatron-core's ``DynamicGradScaler``.
    * ``"on_finite_step"``: on every finite step, so the scale backs off after ``hysteresis``
      non-finite steps in a row (and on each one after, until a finite step). DeepSpeed's
      ``consecutive_hysteresis=true``.

    With ``hysteresis=1`` the three are the same rule.
    With ``min_loss_scale=1``, ``max_loss_scale`` the largest float32, ``hysteresis=1`` and
    ``backoff_factor=None`` this is exactly TensorFlow's
    ``tf.compat.v1.mixed_precision.DynamicLossScale.update``, bit for bit.
    With ``multiplier`` = ``growth_factor`` and ``backoff_factor`` set it is
    ``torch.amp.GradScaler``'s update (``torch._amp_update_scale_``) with a floor and a ceiling:
    bit for bit whenever the two factors are exact in float32 (2 and 0.5, every power of two, 1.5,
    ...: the float32 product is then the correctly rounded exact product, as torch's float64
    product rounded to float32 is); for factors that float32 cannot hold (0.3, 1.1) torch rounds
    ``scale * factor`` from float64 and this float32 rule multiplies by the float32 factor, which
    may differ in the last bit (``lossscale.torch`` then evaluates the rule on a float64 copy of
    the scale, rounded back to float32: torch's arithmetic, bit for bit; the growth is judged
    against ``max_loss_scale`` after rounding to float32, as torch judges finiteness).

    Example:
      >>> from lossscale.core import DynamicRule, dynamic_rule
      >>> rule = dynamic_rule(increment_period=100, hysteresis=2)
      >>> rule
      DynamicRule(increment_period=100, multiplier=2.0, min_loss_scale=1.0,
                  max_loss_scale=3.4028234663852886e+38, hysteresis=2, backoff_factor=None,
                  hysteresis_refill='on_backoff')
      >>> isinstance(rule, DynamicRule), rule == dynamic_rule(100, 2, hysteresis=2)
      (True, True)
      >>> dynamic_rule(2000, 2.0, backoff_factor=0.25).backoff_factor   # GradScaler's factors
      0.25
    """

    increment_period: int
    multiplier: float
    min_loss_scale: float
    max_loss_scale: float
    hysteresis: int
    backoff_factor: float | None = None
    hysteresis_refill: str = "on_backoff"


class RuleAttributes:
    """Read-only views of a :class:`DynamicRule` held in ``self._rule``, for the classes built
    on the rule (the stateful :class:`lossscale.DynamicLossScale`, the JAX pytree)."""

    __slots__ = ()
    _rule: DynamicRule

    @property
    def rule(self) -> DynamicRule:
        """The validated hyperparameters, a :class:`lossscale.core.DynamicRule`."""
        return self._rule

    @property
    def increment_period(self) -> int:
        """Consecutive finite steps after which the scale grows."""
        return self._rule.increment_period

    @property
    def multiplier(self) -> float:
        """The growth factor (and the back-off divisor when ``backoff_factor`` is None)."""
        return self._rule.multiplier

    @property
    def backoff_factor(self) -> float | None:
        """The back-off factor (scale times it), or None: divide by ``multiplier`` (TF)."""
        return self._rule.backoff_factor

    @property
    def min_loss_scale(self) -> float:
        """The floor of back-offs."""
        return self._rule.min_loss_scale

    @property
    def max_loss_scale(self) -> float:
        """Growth beyond this is refused."""
        return self._rule.max_loss_scale

    @property
    def hysteresis(self) -> int:
        """The non-finite step that backs off, counted since the allowance last refilled."""
        return self._rule.hysteresis

    @property
    def hysteresis_refill(self) -> str:
        """When the hysteresis allowance refills: ``"on_backoff"``, ``"on_growth"`` or
        ``"on_finite_step"`` (see :class:`DynamicRule`)."""
        return self._rule.hysteresis_refill


class DynamicState(NamedTuple):
    """The mutable part of a dynamic loss scale: three 0-d arrays of one library and device.

    Attributes:
      loss_scale: float32, the current scale.
      good_steps: integer, consecutive finite steps since the last change (TF's ``good_steps``).
      nonfinite_steps: integer, the hysteresis allowance spent: non-finite steps since the
        allowance last refilled, in ``[0, hysteresis)`` (always 0 when ``hysteresis == 1``).

    Example:
      >>> import numpy as np
      >>> from lossscale.core import DynamicState, dynamic_rule, dynamic_update
      >>> state = DynamicState(np.asarray(1024.0, np.float32), np.asarray(5), np.asarray(0))
      >>> state = dynamic_update(state, np.asarray(False), dynamic_rule(hysteresis=2))
      >>> float(state.loss_scale), int(state.good_steps), int(state.nonfinite_steps)
      (1024.0, 0, 1)
    """

    loss_scale: Any
    good_steps: Any
    nonfinite_steps: Any


def dynamic_rule(
    increment_period: Any = 2000,
    multiplier: Any = 2.0,
    *,
    min_loss_scale: Any = 1.0,
    max_loss_scale: Any = v.FLOAT32_MAX,
    hysteresis: Any = 1,
    backoff_factor: Any = None,
    hysteresis_refill: Any = "on_backoff",
    names: Mapping[str, str] | None = None,
) -> DynamicRule:
    """Validate the hyperparameters and return a :class:`DynamicRule`.

    ``backoff_factor=None`` (the default) backs off by dividing by ``multiplier``, as TensorFlow
    does; a number in (0, 1) backs off by multiplying by it, as ``torch.amp.GradScaler`` does.
    ``hysteresis_refill`` is one of :data:`HYSTERESIS_REFILLS` (see :class:`DynamicRule`).
    ``names`` maps these argument names to a front end's own (``{"multiplier":
    "growth_factor"}``) for the error messages.

    Raises:
      TypeError: a value of the wrong type (``increment_period=2.7``, ``'3'`` or ``True``).
      ValueError: a value out of range, naming the argument and the value.

    Example:
      >>> from lossscale.core import dynamic_rule
      >>> dynamic_rule(increment_period=3).multiplier
      2.0
    """
    name = dict(names or {}).get
    period = v.integer(name("increment_period", "increment_period"), increment_period, 1)
    mult_name = name("multiplier", "multiplier")
    mult = v.real(mult_name, multiplier)
    if not (mult > 1 and v.as_float32(mult) < float("inf")):
        raise ValueError(f"{mult_name} must be finite and > 1, got {multiplier!r}")
    if v.as_float32(mult) <= 1:
        raise ValueError(f"{mult_name}={multiplier!r} rounds to 1 in float32; it must be > 1")
    lo_name, hi_name = (
        name("min_loss_scale", "min_loss_scale"),
        name("max_loss_scale", "max_loss_scale"),
    )
    lo = v.positive_float32(lo_name, min_loss_scale)
    hi = v.positive_float32(hi_name, max_loss_scale)
    if v.as_float32(lo) > v.as_float32(hi):
        raise ValueError(
            f"{lo_name}={min_loss_scale!r} must not exceed {hi_name}={max_loss_scale!r}"
        )
    hyst = v.integer(name("hysteresis", "hysteresis"), hysteresis, 1)
    backoff = None
    if backoff_factor is not None:
        backoff_name = name("backoff_factor", "backoff_factor")
        backoff = v.real(backoff_name, backoff_factor)
        if not 0 < backoff < 1:
            raise ValueError(f"{backoff_name} must be > 0 and < 1, got {backoff_factor!r}")
        if not 0 < v.as_float32(backoff) < 1:
            raise ValueError(
                f"{backoff_name}={backoff_factor!r} rounds to {v.as_float32(backoff)!r} in "
                "float32; it must lie strictly between 0 and 1"
            )
    refill = v.choice(
        name("hysteresis_refill", "hysteresis_refill"), hysteresis_refill, HYSTERESIS_REFILLS
    )
    return DynamicRule(period, mult, lo, hi, hyst, backoff, refill)


def dynamic_state(
    initial_loss_scale: float,
    rule: DynamicRule,
    like: Any | None = None,
    xp: ArrayNamespace | None = None,
) -> DynamicState:
    """A fresh state: ``initial_loss_scale`` in float32, both counters 0.

    The arrays belong to ``xp`` (default: the library of ``like``, else NumPy) and live on
    ``like``'s device. Allocates three 0-d arrays; no host sync.

    Raises:
      ValueError: ``initial_loss_scale`` not finite, ≤ 0 or above ``rule.max_loss_scale``
        (it may lie below ``min_loss_scale``: the first back-off lifts it to the floor).

    Example:
      >>> from lossscale.core import dynamic_rule, dynamic_state
      >>> state = dynamic_state(2.0**15, dynamic_rule())
      >>> float(state.loss_scale), int(state.good_steps), state.loss_scale.dtype
      (32768.0, 0, dtype('float32'))
      >>> dynamic_state(2.0**15, dynamic_rule(max_loss_scale=1024))
      Traceback (most recent call last):
      ...
      ValueError: initial_loss_scale=32768.0 exceeds max_loss_scale=1024.0
    """
    scale = v.scale_at_most(
        "initial_loss_scale", initial_loss_scale, rule.max_loss_scale, "max_loss_scale"
    )
    if xp is None:
        xp = namespace_of(like) if like is not None else NUMPY
        xp = xp or NUMPY
    return DynamicState(
        xp.scalar(scale, "float32", like),
        xp.scalar(0, "int", like),
        xp.scalar(0, "int", like),
    )


def dynamic_update(
    state: DynamicState, is_finite: Any, rule: DynamicRule, xp: ArrayNamespace | None = None
) -> DynamicState:
    """One step of the rule (see :class:`DynamicRule`): pure, branch-free, no host sync.

    Args:
      state: the current state; its arrays decide the library and device.
      is_finite: 0-d bool array of the same library: whether this step's gradients are all
        finite (see :func:`all_finite`).
      rule: the hyperparameters.
      xp: the namespace of ``state``'s arrays; found from ``state.loss_scale`` when omitted.

    Raises:
      TypeError, ValueError: ``is_finite`` not a bool, or with a shape (checked from its dtype
        and shape only: no device work, and it holds while tracing).

    Returns:
      The next state, as new arrays (the inputs are not modified). Every branch is computed and
      selected with ``where``, so the function traces under ``jax.jit`` and ``torch.compile``.

    Example:
      >>> import numpy as np
      >>> from lossscale.core import dynamic_rule, dynamic_state, dynamic_update
      >>> rule = dynamic_rule(increment_period=2)
      >>> s = dynamic_state(8.0, rule)
      >>> for finite in (True, True, False):
      ...     s = dynamic_update(s, np.asarray(finite), rule)
      ...     print(float(s.loss_scale), int(s.good_steps))
      8.0 1
      16.0 0
      8.0 0
    """
    v.finite_flag("is_finite", is_finite)
    if xp is None:
        xp = namespace_of(state.loss_scale) or NUMPY
    scale, good, bad = state
    multiplier = xp.full_like(scale, rule.multiplier)
    with xp.errstate():
        # Finite step: count it; grow on the increment_period-th.
        good_plus = good + 1
        grow = good_plus >= rule.increment_period
        grown = scale * multiplier
        # Judged as float32, the scale's type: a wider copy of the scale (lossscale.torch, for
        # factors float32 cannot hold) is rounded first, as torch rounds its float64 product
        # before its check. max_loss_scale is a finite float32, so this also refuses inf/NaN.
        grown32 = xp.float32(grown)
        grown_ok = grown32 <= xp.full_like(grown32, rule.max_loss_scale)
        scale_if_finite = xp.where(grow & grown_ok, grown, scale)
        zero = xp.full_like(good, 0)
        good_if_finite = xp.where(grow, zero, good_plus)
        if rule.hysteresis_refill == "on_finite_step":
            bad_if_finite = zero
        else:
            bad_if_finite = xp.where(grow, zero, bad)
        # Non-finite step: back off on the hysteresis-th one since the allowance refilled.
        bad_plus = bad + 1
        back_off = bad_plus >= rule.hysteresis
        if rule.backoff_factor is None:  # static: TensorFlow divides by the multiplier
            shrunk = xp.divide(scale, multiplier)
        else:  # torch.amp.GradScaler multiplies by its backoff factor
            shrunk = scale * xp.full_like(scale, rule.backoff_factor)
        shrunk = xp.maximum(shrunk, xp.full_like(scale, rule.min_loss_scale))
        scale_if_nonfinite = xp.where(back_off, shrunk, scale)
        if rule.hysteresis_refill == "on_backoff":
            bad_if_nonfinite = xp.where(back_off, zero, bad_plus)
        else:  # the allowance stays spent: the next non-finite step backs off too
            bad_if_nonfinite = xp.where(back_off, bad, bad_plus)
        return DynamicState(
            xp.where(is_finite, scale_if_finite, scale_if_nonfinite),
            xp.where(is_finite, good_if_finite, zero),
            xp.where(is_finite, bad_if_finite, bad_if_nonfinite),
        )
