"""How :func:`loss_scale_optimizer` skips a non-finite step: the inner update, run or not.

Three executions of one meaning (the inner update's result when ``finite``; zero updates and
the inner state unchanged otherwise), chosen by ``skip_strategy``:

- :func:`select_at_definition` (``'select'``, the default): the inner update traced to a
  jaxpr and replayed with every new state value selected *where it is defined*
  (``select(finite, new, old)`` right after the equation that computes it), and the rest of
  the update computed from the selected value. On a finite step the selected value is the new
  value, bit for bit, so every output is the inner update's own; on a skipped step the state
  is the old one and the updates are replaced by zeros. XLA then fuses each select into the
  elementwise work that writes the state (``mu = select(finite, b1 * mu + (1 - b1) * g, mu)``
  in place), and nothing downstream reads the old state any more: with donated buffers no
  moment buffer is copied (selecting the outputs instead keeps the old moments alive beside
  the new ones, and XLA copies each donated one).
- :func:`select_outputs`: the inner update's outputs selected leaf by leaf; the fallback of
  ``'select'`` when the inner update cannot be traced on its own (it reads a named axis that
  is bound outside it, for instance).
- :func:`cond_skip` (``'cond'``): a ``lax.cond`` around the inner update.

None multiplies by a 0/1 flag, so a NaN in the gradients cannot reach the parameters or the
state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

try:
    from jax.extend.core import Literal
except ImportError:  # jax < 0.4.36
    from jax.core import Literal  # type: ignore[attr-defined,no-redef]

Update = Callable[..., tuple[Any, Any]]  # update(grads, state, params, **extra_args)


def _select_leaf(pred: jax.Array, a: Any, b: Any) -> Any:
    """``where(pred, a, b)`` for one leaf, in ``a``'s dtype (no multiplication)."""
    if a is b:
        return a
    if (
        isinstance(a, jax.Array)
        and isinstance(b, jax.Array)
        and a.shape == b.shape
        and a.dtype == b.dtype
    ):
        return lax.select(pred, a, b)  # a scalar predicate; jnp.where would add a call
    out = jnp.where(pred, a, b)
    dtype = getattr(a, "dtype", None)
    return out if dtype is None or out.dtype == dtype else out.astype(dtype)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``where(pred, a, b)`` (both computed; no multiplication, so NaN cannot leak)."""
    return jax.tree_util.tree_map(lambda a, b: _select_leaf(pred, a, b), on_true, on_false)


def same_types(a: Any, b: Any) -> bool:
    """Whether two pytrees have the same structure, shapes and dtypes."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    same_structure: bool = ta == tb  # type: ignore[operator]
    return same_structure and all(
        jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)
        for x, y in zip(la, lb, strict=True)
    )


def zeros_like_tree(tree: Any) -> Any:
    """Zeros shaped and typed like each leaf: one scalar zero per dtype, broadcast per leaf
    (``lax`` ops, cheaper to trace than ``jnp.zeros`` on trees of hundreds of leaves)."""
    zeros: dict[Any, jax.Array] = {}

    def one(x: Any) -> jax.Array:
        dtype = jnp.result_type(x)
        if dtype not in zeros:
            zeros[dtype] = lax.full((), 0, dtype)
        return lax.broadcast(zeros[dtype], jnp.shape(x))

    return jax.tree_util.tree_map(one, tree)


def select_outputs(
    update: Update, finite: jax.Array, grads: Any, state: Any, params: Any, extra: dict[str, Any]
) -> tuple[Any, Any]:
    """Run ``update``; select its updates or zeros, its new state or ``state``, leaf by leaf."""
    applied, new_state = update(grads, state, params, **extra)
    return (
        select_tree(finite, applied, zeros_like_tree(applied)),
        select_tree(finite, new_state, state),
    )


def cond_skip(
    update: Update, finite: jax.Array, grads: Any, state: Any, params: Any, extra: dict[str, Any]
) -> tuple[Any, Any]:
    """``lax.cond(finite, update, skip)``: one branch runs; the branch boundary stops fusion."""

    def apply(operands: tuple[Any, Any, Any]) -> tuple[Any, Any]:
        g, s, p = operands
        return update(g, s, p, **extra)

    def skip(operands: tuple[Any, Any, Any]) -> tuple[Any, Any]:
        g, s = operands[0], operands[1]
        out = jax.eval_shape(apply, operands)[0]
        if same_types(out, g):
            # zeros_like keeps the operand's shard_map axis type (varying or not)
            return jax.tree_util.tree_map(jnp.zeros_like, g), s
        return zeros_like_tree(out), s

    result: tuple[Any, Any] = lax.cond(finite, apply, skip, (grads, state, params))
    return result


def _trace(
    update: Update, grads: Any, state: Any, params: Any, extra: dict[str, Any]
) -> tuple[Any, Any] | None:
    """The inner update as a closed jaxpr of (grads, state, params) and its output tree, or
    None when it cannot be traced on its own (the caller then selects the outputs)."""

    def run(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        return update(g, s, p, **extra)

    try:
        closed, shapes = jax.make_jaxpr(run, return_shape=True)(grads, state, params)
    except Exception:  # e.g. a collective over an axis bound outside the update
        return None
    return closed, shapes


def _replay(
    closed: Any,
    finite: jax.Array,
    operands: tuple[Any, Any, Any],
    pairs: dict[Any, int],
    old_leaves: list[Any],
) -> tuple[list[Any], list[Any]]:
    """Evaluate ``closed`` (the inner update's jaxpr) on ``operands``, selecting each value in
    ``pairs`` against its old state leaf right after the equation that defines it. Returns the
    update leaves and the new state leaves (the others selected at the end)."""
    jaxpr = closed.jaxpr
    n_updates = len(jaxpr.outvars) - len(old_leaves)
    state_outvars = jaxpr.outvars[n_updates:]
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    args = jax.tree_util.tree_leaves(operands)
    for var, val in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        got = eqn.primitive.get_bind_params(eqn.params)
        subfuns, bind_params = got if isinstance(got, tuple) else ((), got)  # jax < 0.7: a pair
        with eqn.ctx.manager:
            ans = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
        outs = ans if eqn.primitive.multiple_results else [ans]
        for var, val in zip(eqn.outvars, outs, strict=True):
            if var in pairs:
                val = lax.select(finite, val, old_leaves[pairs[var]])
            env[var] = val

    outs = [read(v) for v in jaxpr.outvars]
    applied = outs[:n_updates]
    new_leaves = [
        val
        if not isinstance(var, Literal) and var in pairs
        else _select_leaf(finite, val, old_leaves[i])
        for i, (var, val) in enumerate(zip(state_outvars, outs[n_updates:], strict=True))
    ]
    return applied, new_leaves


def select_at_definition(
    update: Update, finite: jax.Array, grads: Any, state: Any, params: Any, extra: dict[str, Any]
) -> tuple[Any, Any]:
    """Replay ``update``'s jaxpr with each new state value selected where it is defined.

    Same results as :func:`select_outputs`, bit for bit: on a finite step every selected value
    is the new one, so the replay computes exactly what ``update`` computes; on a skipped step
    the state is the old one and the updates are zeros whatever the replay computed (selected,
    never multiplied). A value is selected right after its defining equation when it is a state
    output of one leaf only, of that leaf's shape and dtype; any other state output (an input
    passed through, a constant, a value shared by two leaves) is selected at the end.
    """
    traced = _trace(update, grads, state, params, extra)
    if traced is None:
        return select_outputs(update, finite, grads, state, params, extra)
    closed, shapes = traced
    jaxpr = closed.jaxpr
    out_tree = jax.tree_util.tree_structure(shapes)
    n_updates = len(jax.tree_util.tree_leaves(shapes[0]))
    old_leaves, state_tree = jax.tree_util.tree_flatten(state)
    new_state_tree = jax.tree_util.tree_structure(shapes[1])
    if new_state_tree != state_tree:  # type: ignore[operator]  # nothing to pair with
        return select_outputs(update, finite, grads, state, params, extra)

    # The state outputs that are computed inside the update, each paired with its old leaf.
    state_outvars = jaxpr.outvars[n_updates:]
    defined = {v for eqn in jaxpr.eqns for v in eqn.outvars}
    pairs: dict[Any, int] = {}
    shared: set[Any] = set()
    for i, var in enumerate(state_outvars):
        if isinstance(var, Literal) or var not in defined:
            continue
        old = old_leaves[i]
        aval = var.aval
        if not (
            isinstance(old, jax.Array)
            and getattr(aval, "shape", None) == old.shape
            and getattr(aval, "dtype", None) == old.dtype
        ):
            continue
        if var in pairs and pairs[var] != i:
            shared.add(var)
        pairs.setdefault(var, i)
    for var in shared:
        del pairs[var]

    try:
        applied, new_leaves = _replay(closed, finite, (grads, state, params), pairs, old_leaves)
    except Exception:  # an equation that does not replay here: select the outputs instead
        return select_outputs(update, finite, grads, state, params, extra)
    applied_tree, _ = jax.tree_util.tree_unflatten(out_tree, [*applied, *new_leaves])
    zeros = zeros_like_tree(applied_tree)
    return (
        select_tree(finite, applied_tree, zeros),
        jax.tree_util.tree_unflatten(state_tree, new_leaves),
    )
