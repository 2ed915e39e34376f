"""The state of :func:`lossscale.jax.loss_scale_optimizer` and what reads it: found inside
``optax.chain`` / ``named_chain`` states (and flax NNX wrappers), the scale, scaling and
unscaling with it, the skip records and the stall check."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax

from lossscale.jax._stall import StallCount, check_stall_count
from lossscale.jax._values import (
    DynamicLossScale,
    FixedLossScale,
    is_loss_scale,
)


class LossScaleState(NamedTuple):
    """The state of :func:`loss_scale_optimizer`.

    Attributes:
      loss_scale: the current :class:`DynamicLossScale` (or :class:`FixedLossScale`).
      inner_state: the wrapped transformation's state; unchanged by a skipped step.
      skipped_steps: 0-d int32, how many updates were skipped so far (saturates at 2**31 - 1).
      last_applied: 0-d bool, whether the last update was applied; read it as
        ``last_step_applied`` (a read-only property: lossscale's name in every front end).
        The field keeps its name, so the pytree and checkpoint keys of earlier versions
        still match.
      stall: the stall alarm's :class:`StallCount`: ``stall.count`` (0-d int32) counts the
        consecutive skipped steps taken with the scale at ``min_loss_scale``;
        ``stall.stalled`` (0-d bool) says whether it reached ``stall_steps``. Read them
        with :func:`stalled_steps` and :func:`check_stall`. Always 0 for a fixed scale and
        with ``enabled=False``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import LossScaleState, loss_scale_optimizer
      >>> state = loss_scale_optimizer(optax.sgd(0.1), initial_scale=8.0).init(jnp.ones(2))
      >>> isinstance(state, LossScaleState), state._fields
      (True, ('loss_scale', 'inner_state', 'skipped_steps', 'last_applied', 'stall'))
      >>> float(state.loss_scale()), int(state.skipped_steps), bool(state.last_step_applied)
      (8.0, 0, True)
    """

    loss_scale: DynamicLossScale | FixedLossScale
    inner_state: Any
    skipped_steps: jax.Array
    last_applied: jax.Array
    stall: StallCount

    @property
    def last_step_applied(self) -> jax.Array:
        """Whether the last update was applied: the ``last_applied`` field (read-only)."""
        return self.last_applied


# -- helpers over a LossScaleState (also found inside optax.chain / named_chain states) --------


def _unwrap_nnx(state: LossScaleState) -> LossScaleState:
    """``state`` with flax nnx ``Variable`` leaves (``nnx.Optimizer`` wraps every array of its
    ``opt_state`` in an ``OptArray``) replaced by their arrays; looked up only when flax.nnx is
    already imported."""
    nnx = sys.modules.get("flax.nnx")
    variable = getattr(nnx, "Variable", None)
    if variable is None:
        return state

    def plain(x: Any) -> Any:
        if not isinstance(x, variable):
            return x
        return x.get_value() if hasattr(x, "get_value") else x.value

    unwrapped: LossScaleState = jax.tree_util.tree_map(
        plain, state, is_leaf=lambda x: isinstance(x, variable)
    )
    return unwrapped


def find_state(opt_state: Any) -> LossScaleState:
    """The one :class:`LossScaleState` in ``opt_state`` (itself, or nested in a chain's
    tuple/dict, or in a flax ``nnx.Optimizer``'s ``opt_state``, whose variables are unwrapped).
    Raises ``ValueError`` when there is none or more than one."""
    if isinstance(opt_state, LossScaleState):
        return _unwrap_nnx(opt_state)
    found = [
        x
        for x in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda x: isinstance(x, LossScaleState)
        )
        if isinstance(x, LossScaleState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one LossScaleState in the optimizer state, found {len(found)}"
        )
    return _unwrap_nnx(found[0])


def loss_scale_of(obj: Any) -> DynamicLossScale | FixedLossScale:
    """The loss-scale value of ``obj``: a value itself, or the one inside an optimizer state."""
    if is_loss_scale(obj):
        return obj  # type: ignore[no-any-return]
    return find_state(obj).loss_scale


def current_scale(state: Any) -> jax.Array:
    """The current scale of an optimizer state: a 0-d float32 array (no copy, no sync).

    ``state`` is a :class:`LossScaleState`, an optax state containing exactly one (e.g. from
    ``optax.chain``), or a :class:`DynamicLossScale`/:class:`FixedLossScale`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, current_scale
      >>> opt = optax.chain(loss_scale_optimizer(optax.sgd(0.1)), optax.keep_params_nonnegative())
      >>> float(current_scale(opt.init(jnp.ones(2))))
      32768.0
    """
    return loss_scale_of(state).loss_scale


def scale_loss(loss: Any, state: Any) -> Any:
    """``loss * current_scale(state)``, in at least float32 (float16/bfloat16 losses come back
    float32). Call it on the loss whose gradients go to ``update``. One multiply per leaf.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, scale_loss
      >>> state = loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0).init(jnp.ones(1))
      >>> scale_loss(jnp.float16(1.5), state)
      Array(6., dtype=float32)
    """
    return loss_scale_of(state).scale(loss)


def unscale_grads(grads: Any, state: Any) -> Any:
    """``grads * (1 / current_scale(state))`` in each gradient's dtype (float32 math for
    float16/bfloat16). For inspecting or clipping grads yourself; ``update`` unscales on its
    own, so do not pass it unscaled grads. One fused multiply per leaf, no sync.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, unscale_grads
      >>> state = loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0).init(jnp.ones(1))
      >>> unscale_grads({"w": jnp.array([8.0], jnp.float16)}, state)
      {'w': Array([2.], dtype=float16)}
    """
    return loss_scale_of(state).unscale(grads)


def skipped_steps(state: Any) -> jax.Array:
    """0-d int32: how many updates of this optimizer state were skipped (no sync).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, skipped_steps, last_step_applied
      >>> opt = loss_scale_optimizer(optax.sgd(0.1))
      >>> state = opt.init(jnp.ones(2))
      >>> _, state = opt.update(jnp.array([1.0, jnp.nan]), state, jnp.ones(2))
      >>> int(skipped_steps(state)), bool(last_step_applied(state))
      (1, False)
    """
    return find_state(state).skipped_steps


def last_step_applied(state: Any) -> jax.Array:
    """0-d bool: whether the last update was applied (no sync).

    ``state`` is a :class:`LossScaleState` or an optax state containing exactly one.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, last_step_applied
      >>> opt = loss_scale_optimizer(optax.sgd(0.1))
      >>> params, update = jnp.ones(2), jax.jit(opt.update)
      >>> state = opt.init(params)
      >>> for grads in (jnp.ones(2), jnp.array([1.0, jnp.nan])):
      ...     _, state = update(grads, state, params)
      ...     print(bool(last_step_applied(state)))
      True
      False
    """
    return find_state(state).last_step_applied


def last_applied(state: Any) -> jax.Array:
    """The former name of :func:`last_step_applied`, kept for existing code: the same result.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, last_applied
      >>> state = loss_scale_optimizer(optax.sgd(0.1)).init(jnp.ones(2))
      >>> bool(last_applied(state))
      True
    """
    return last_step_applied(state)


def stalled_steps(state: Any) -> jax.Array:
    """0-d int32: consecutive skipped steps taken with the scale at ``min_loss_scale`` (the
    stall alarm's count; 0 after any finite step). On the device: no sync.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from lossscale.jax import loss_scale_optimizer, stalled_steps
      >>> opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0)
      >>> state, params = opt.init(jnp.ones(1)), jnp.ones(1)
      >>> for _ in range(3):  # 2 -> 1 (the floor) -> skipped at the floor, twice
      ...     _, state = opt.update(jnp.array([jnp.inf]), state, params)
      >>> int(stalled_steps(state))
      2
    """
    return find_state(state).stall.count  # type: ignore[no-any-return]


def check_stall(state: Any, *, warned: bool = False) -> bool:
    """The stall alarm's host-side check: warn once or raise when training has stalled.

    Reads the state's stall count (one device-to-host read of a 0-d int, which waits for the
    step that produced ``state``; and the scale, only when the alarm fires). When the count
    has reached the optimizer's ``stall_steps``: with ``on_stall='raise'`` raises
    :class:`lossscale.core.LossScaleStalledError`; with ``on_stall='warn'`` warns
    :class:`lossscale.core.LossScaleStalledWarning` unless ``warned`` is True. Call it outside
    ``jit``, as often as you like: every step where the loop already reads the loss (no extra
    wait), or every N steps (the alarm then fires up to N - 1 steps late). Pass back what it
    returns, so that a stall warns once: True while the stall lasts, False once the count
    dropped below the threshold (a finite step re-arms the alarm). Does nothing (returns
    False) when the alarm is off, the scale is fixed, or scaling is disabled.

    ``state`` is a :class:`LossScaleState` or an optax state containing exactly one (under
    ``pmap``, the replicas' largest count).

    Raises:
      LossScaleStalledError: ``on_stall='raise'`` and the count reached ``stall_steps``.
      TypeError: called on traced values (inside ``jit``; read ``state.stall.stalled`` there).

    Example:
      >>> import warnings, jax, jax.numpy as jnp, optax
      >>> from lossscale.jax import check_stall, loss_scale_optimizer
      >>> opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=3)
      >>> state, params, update = opt.init(jnp.ones(1)), jnp.ones(1), jax.jit(opt.update)
      >>> warned = False
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     for step in range(5):
      ...         _, state = update(jnp.array([jnp.nan]), state, params)
      ...         warned = check_stall(state, warned=warned)
      >>> warned, [w.category.__name__ for w in caught]
      (True, ['LossScaleStalledWarning'])
    """
    found = find_state(state)
    return check_stall_count(
        found.stall, found.loss_scale.loss_scale, warned=warned, where="loss_scale_optimizer"
    )
