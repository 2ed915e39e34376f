"""Loss scaling as an optax transformation: TensorFlow's ``LossScaleOptimizer`` for optax.

``loss_scale_optimizer(inner)`` wraps any optax ``GradientTransformation``. Its ``update`` takes
the gradients of the *scaled* loss, unscales them by the scale the loss was scaled with, checks
them, runs the inner transformation or skips the step, and advances the scale with
:func:`lossscale.core.dynamic_update` (through :meth:`DynamicLossScale.adjust`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax.numpy as jnp
import optax

from lossscale.core import _validation as v
from lossscale.core._rule import dynamic_state
from lossscale.core._settings import scale_settings
from lossscale.core._stall import DEFAULT_STALL_STEPS, stall_alarm, stall_update
from lossscale.core._validation import FLOAT32_MAX
from lossscale.jax._gradients import reduce_finite, unscaled_all_finite
from lossscale.jax._skip import cond_skip, select_at_definition
from lossscale.jax._stall import StallCount
from lossscale.jax._state import LossScaleState
from lossscale.jax._values import (
    JAX,
    DynamicLossScale,
    FixedLossScale,
    concrete_numbers,
)

#: ``skip_strategy`` -> how the skip is executed (see ``_skip``).
SKIP_STRATEGIES = {"select": select_at_definition, "cond": cond_skip}
_INT32_MAX = 2**31 - 1


def loss_scale_optimizer(
    inner: optax.GradientTransformation,
    dynamic: bool = True,
    initial_scale: float | None = None,
    dynamic_growth_steps: int | None = None,
    *,
    axis_name: Hashable | None = None,
    min_loss_scale: float = 1.0,
    max_loss_scale: float = FLOAT32_MAX,
    hysteresis: int = 1,
    hysteresis_refill: str = "on_backoff",
    multiplier: float = 2.0,
    backoff_factor: float | None = None,
    skip_strategy: str = "select",
    stall_steps: int | None = DEFAULT_STALL_STEPS,
    on_stall: str = "warn",
    enabled: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation with dynamic (or fixed) loss scaling.

    TensorFlow's ``LossScaleOptimizer`` arguments, as an optax transformation. A step::

        opt = loss_scale_optimizer(optax.adam(1e-3))
        state = opt.init(params)

        @jax.jit
        def train_step(params, state, batch):
            grads = jax.grad(lambda p: scale_loss(loss_fn(p, batch), state))(params)
            updates, state = opt.update(grads, state, params)   # grads are SCALED
            return optax.apply_updates(params, updates), state

    ``update(grads, state, params=None, **extra_args)``:

    1. unscales ``grads`` by the state's scale, the one the loss was scaled with (float32 math
       for float16/bfloat16 gradients, cast back);
    2. checks that every unscaled gradient is finite (with ``axis_name``: AND-ed across the
       devices of that axis with one scalar ``lax.pmin``, so every replica decides alike);
    3. finite: runs ``inner.update`` on the unscaled gradients and returns its updates;
       not finite: returns **zero updates and the inner state unchanged** (parameters, moments
       and the inner step count do not move, so schedules do not advance); the skip is a
       *selection* (``lax.select`` or ``lax.cond``), never a multiplication by 0, so a NaN
       cannot reach the parameters;
    4. advances the scale (:meth:`DynamicLossScale.adjust`, the core rule) and the counters.

    With ``dynamic=False`` the scale is fixed and, as TensorFlow, nothing is checked or skipped:
    non-finite gradients are applied.

    With ``enabled=False`` (``torch.amp.GradScaler(enabled=...)``'s switch) ``update`` is the
    inner transformation's ``update`` exactly: the gradients go to it untouched, nothing is
    checked, skipped or counted, and the compiled step holds no loss-scale operation. The
    state is still a :class:`LossScaleState` with a fixed scale of 1 (``scale_loss`` multiplies
    by 1; :func:`current_scale`, :func:`skipped_steps` and :func:`check_stall` work and report
    1, 0 and nothing), so one training loop serves both settings. Every other argument is
    still validated.

    Stall alarm (dynamic only): at ``min_loss_scale`` with every step non-finite, the scale can
    go no lower and every step is skipped: training has stopped. ``update`` counts those steps
    in the state (``state.stall.count``, with :func:`lossscale.core.stall_update`; a few scalar
    ops, no host sync); :func:`check_stall`, called on the host where you choose, warns once
    (``on_stall='warn'``) or raises :class:`lossscale.core.LossScaleStalledError`
    (``on_stall='raise'``) once the count reaches ``stall_steps``. Nothing reads the count
    unless you call :func:`check_stall` (or read ``state.stall.stalled``).

    Device cost per step (dynamic): one extra read of the gradients (the finite check; the
    unscale multiply fuses into the inner update), a handful of scalar ops, and with
    ``axis_name`` one scalar all-reduce. No host sync. The check reads the *scaled* gradients
    when the scale cannot drop below 1 (``initial_scale`` and ``min_loss_scale`` both at least
    1, the defaults), which gives the same answer (a state given a scale below 1 by hand is
    then skipped, and the back-off lifts the scale to ``min_loss_scale``); on CPU it sums rows
    of ``g - g`` instead of writing an ``isfinite`` mask (see :func:`all_finite`). Under
    ``jit`` on sharded global arrays (GSPMD) the check is already global: ``axis_name`` is
    only for ``pmap``/``shard_map``.

    Gradient accumulation: wrap ``optax.MultiSteps`` (``loss_scale_optimizer(optax.MultiSteps(
    inner, k))``). Every micro-batch's gradients are then unscaled and checked before they are
    accumulated, and a non-finite micro-batch is skipped: the accumulator and its micro-step
    count do not move, the scale backs off at once, and the window waits for one more finite
    micro-batch. Do not wrap it the other way round: ``MultiSteps`` clears its accumulator by
    multiplying it by 0, so a NaN that reaches it stays there, and every later window is
    skipped (optax 0.2.8).

    Args:
      inner: the optax ``GradientTransformation`` to wrap (extra arguments are forwarded), or
        an object with a ``gradient_transformation()`` method such as ``optax.MultiSteps``.
      dynamic: bool; False gives a fixed scale (``initial_scale`` required).
      initial_scale: the starting scale; default 2**15 when dynamic.
      dynamic_growth_steps: consecutive finite steps before the scale doubles; default 2000;
        must be None when not dynamic.
      axis_name: a ``pmap``/``shard_map`` axis name (or tuple of names) over which the finite
        flag is reduced; None (default) for a single device or GSPMD ``jit``.
      min_loss_scale, max_loss_scale, hysteresis, hysteresis_refill: the
        :class:`DynamicLossScale` extensions (dynamic only).
      multiplier: the growth factor (dynamic only; default 2, TensorFlow's); without
        ``backoff_factor`` also the back-off divisor.
      backoff_factor: None (default): back off by dividing by ``multiplier`` (TensorFlow);
        a number in (0, 1): back off by multiplying by it (``torch.amp.GradScaler``'s and
        flax ``DynamicScale``'s ``backoff_factor``). Dynamic only.
      skip_strategy: ``'select'`` (default): no branch. The inner update is traced and
        replayed with each new state value selected where it is defined
        (``mu = select(finite, b1 * mu + (1 - b1) * g, mu)``) and the rest of the update
        computed from the selected values; the updates are then selected against zeros. A
        finite step computes exactly the inner update (the selected values are the new ones,
        bit for bit); a skipped step keeps the old state and returns zero updates. XLA fuses
        each select into the elementwise work that writes the state, in place: with donated
        buffers the compiled step copies no parameter or moment buffer (as the plain optax
        step; ``_hlo_test.py`` counts them). An inner update that cannot be traced on its own
        is run directly and its outputs selected. ``'cond'``: a ``lax.cond`` around the inner
        update; runs one branch, but the branch boundary stops fusion and copies operands
        (about one copy per leaf). Both cost the same compile time within noise. On GPU,
        XLA's conditional has historically copied its predicate to the host (a sync per
        step, jax#7934). Measurements: ``docs/performance.md``.
      stall_steps: consecutive skipped steps at ``min_loss_scale`` after which
        :func:`check_stall` warns or raises (default 1000); None turns the alarm off.
      on_stall: ``'warn'`` (default; once per stall, see :func:`check_stall`) or ``'raise'``.
      enabled: bool; False makes the transformation the inner one exactly (see above).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`LossScaleState`.

    Raises:
      TypeError: ``inner`` not a GradientTransformation; ``dynamic`` or ``enabled`` not a
        bool; ``stall_steps`` not an int or None.
      ValueError: ``dynamic=False`` without ``initial_scale`` or with ``dynamic_growth_steps``
        or an extension argument; an unknown ``skip_strategy`` or ``on_stall``; any value
        out of range.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, current_scale
      >>> opt = loss_scale_optimizer(optax.sgd(0.5), initial_scale=8.0)
      >>> params, update = jnp.ones(2), jax.jit(opt.update)
      >>> state = opt.init(params)
      >>> for scaled_grads in (jnp.array([8.0, 16.0]), jnp.array([8.0, jnp.inf])):
      ...     updates, state = update(scaled_grads, state, params)
      ...     print(updates.tolist(), float(current_scale(state)), int(state.skipped_steps))
      [-0.5, -1.0] 8.0 0
      [0.0, 0.0] 4.0 1
    """
    to_transformation = getattr(inner, "gradient_transformation", None)
    if not isinstance(inner, optax.GradientTransformation) and callable(to_transformation):
        inner = to_transformation()  # optax.MultiSteps: its documented conversion
    if not (
        isinstance(inner, optax.GradientTransformation)
        and callable(getattr(inner, "init", None))
        and callable(getattr(inner, "update", None))
    ):
        raise TypeError(f'"inner" must be an optax.GradientTransformation, got {inner!r}')
    v.boolean("enabled", enabled)  # dynamic: checked by scale_settings
    if isinstance(dynamic, str):  # this front end has no experimental form to point to
        raise TypeError(
            f"dynamic must be a bool, got the string {dynamic!r}. dynamic=True (the default) "
            "gives a dynamic loss scale: loss_scale_optimizer(inner) or "
            "loss_scale_optimizer(inner, dynamic=True); dynamic=False with initial_scale=... "
            "gives a fixed one. (TensorFlow's experimental form, loss_scale='dynamic', has no "
            "counterpart in lossscale.jax.)"
        )
    if skip_strategy not in SKIP_STRATEGIES:
        raise ValueError(
            f'"skip_strategy" must be one of {tuple(SKIP_STRATEGIES)}, got {skip_strategy!r}'
        )
    skip = SKIP_STRATEGIES[skip_strategy]
    alarm = stall_alarm(stall_steps, on_stall)
    # Concrete 0-d NumPy/JAX arrays (jmp's style) are numbers; traced ones a TypeError.
    initial_scale, dynamic_growth_steps, min_loss_scale, max_loss_scale, hysteresis = (
        concrete_numbers(
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
        )
    )
    multiplier, backoff_factor = concrete_numbers(
        multiplier=multiplier, backoff_factor=backoff_factor
    )

    settings = scale_settings(  # validation shared with every front end
        dynamic,
        initial_scale,
        dynamic_growth_steps,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        hysteresis=hysteresis,
        hysteresis_refill=hysteresis_refill,
        multiplier=multiplier,
        backoff_factor=backoff_factor,
    )
    rule = settings.rule
    make_loss_scale: Callable[[], DynamicLossScale | FixedLossScale]
    if not enabled:

        def make_loss_scale() -> DynamicLossScale | FixedLossScale:
            return FixedLossScale(1.0)

        scale_at_least_one = True  # unused: nothing is checked
    elif rule is not None:
        scale0 = settings.initial_scale
        # The scale starts at scale0 and backs off no lower than min_loss_scale, so it stays
        # >= 1 when both are: the check may then read the scaled gradients (see _numerics).
        scale_at_least_one = scale0 >= 1 and rule.min_loss_scale >= 1
        dyn_rule = rule

        def make_loss_scale() -> DynamicLossScale | FixedLossScale:
            return DynamicLossScale.from_state(dynamic_state(scale0, dyn_rule, xp=JAX), dyn_rule)

    else:
        fixed_value = settings.initial_scale
        scale_at_least_one = True  # unused: a fixed scale is never checked

        def make_loss_scale() -> DynamicLossScale | FixedLossScale:
            return FixedLossScale(fixed_value)

    tx = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> LossScaleState:
        return LossScaleState(
            loss_scale=make_loss_scale(),
            inner_state=tx.init(params),
            skipped_steps=jnp.zeros((), jnp.int32),
            last_applied=jnp.ones((), jnp.bool_),
            stall=StallCount(jnp.zeros((), jnp.int32), alarm),
        )

    def update_fn(
        updates: Any, state: LossScaleState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScaleState]:
        if not isinstance(state, LossScaleState):
            raise TypeError(f"state must be a LossScaleState, got {type(state).__name__}")
        if not enabled:  # the inner update exactly: no loss-scale op at all
            new_updates, inner_state = tx.update(updates, state.inner_state, params, **extra_args)
            return new_updates, state._replace(inner_state=inner_state)
        loss_scale = state.loss_scale
        grads = loss_scale.unscale(updates)  # the scale the loss was scaled with
        if not dynamic:
            new_updates, inner_state = tx.update(grads, state.inner_state, params, **extra_args)
            return new_updates, state._replace(inner_state=inner_state)

        finite = unscaled_all_finite(
            updates, loss_scale.loss_scale, scale_at_least_one=scale_at_least_one
        )
        finite = reduce_finite(finite, axis_name)
        new_updates, inner_state = skip(
            tx.update, finite, grads, state.inner_state, params, extra_args
        )
        skipped = state.skipped_steps
        skipped = jnp.where(finite | (skipped >= _INT32_MAX), skipped, skipped + 1)
        stall = state.stall
        assert rule is not None  # dynamic
        stalled = stall_update(stall.count, finite, loss_scale.loss_scale, rule, JAX)
        return new_updates, LossScaleState(
            loss_scale=loss_scale.adjust(finite),
            inner_state=inner_state,
            skipped_steps=skipped,
            last_applied=finite,
            stall=StallCount(stalled, stall.alarm),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
