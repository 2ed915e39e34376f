"""``scaled_value_and_grad``: ``jax.value_and_grad`` with loss scaling built in."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from lossscale.jax._gradients import all_finite, reduce_finite
from lossscale.jax._state import loss_scale_of


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: Any,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    *,
    axis_name: Hashable | None = None,
) -> Callable[..., tuple[Any, Any, jax.Array]]:
    """``jax.value_and_grad`` that scales the loss, unscales the gradients and checks them.

    The returned function computes ``fun(*args)``, differentiates ``loss * scale`` (in at least
    float32), multiplies the gradients by ``1 / scale`` (float32 math for float16/bfloat16
    gradients, cast back) and reports whether they are all finite. The scale is the one of
    ``loss_scale`` *now*: unscaling uses the same value the loss was scaled with (mpx adjusts
    first and unscales with the new scale, which halves the gradients on every growth step).

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
      loss_scale: a :class:`DynamicLossScale` or :class:`FixedLossScale`, or an optimizer state
        from :func:`loss_scale_optimizer` (its current scale is used).
      has_aux: as ``jax.value_and_grad``.
      argnums: as ``jax.value_and_grad``.
      axis_name: a ``pmap``/``shard_map`` axis name (or tuple of names): the finite flag is
        AND-ed across the devices of that axis (one scalar ``lax.pmin``), so every replica
        gets the same ``grads_finite`` and adjusts its scale alike (flax ``DynamicScale``'s
        ``axis_name``). The gradients themselves are not reduced: ``lax.pmean`` them
        yourself, as with ``jax.value_and_grad``. None (default): this device's gradients
        only (also right under ``jit`` on globally sharded arrays, where the check is global).

    Returns:
      A function ``(*args, **kwargs) -> (value, grads, grads_finite)``: ``value`` is the
      **unscaled** loss (``(loss, aux)`` with ``has_aux``), ``grads`` the unscaled gradients
      and ``grads_finite`` a 0-d bool array. Nothing is skipped here: pass ``grads_finite`` to
      ``loss_scale.adjust`` and select the update yourself (``jnp.where``/``lax.cond``; never
      multiply by 0), or feed the *scaled* gradients to :func:`loss_scale_optimizer` instead.
      Device cost over ``jax.value_and_grad``: one multiply of the loss, one fused multiply
      per gradient and one read of the gradients for the check; no host sync.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale.jax import DynamicLossScale, scaled_value_and_grad
      >>> @jax.jit
      ... def step(ls, w):
      ...     _, grads, finite = scaled_value_and_grad(lambda w: jnp.sum(w**2), ls)(w)
      ...     return grads, finite, ls.adjust(finite)
      >>> ls = DynamicLossScale(initial_loss_scale=2.0**10)
      >>> for w in (1.0, 100.0):  # scaled gradient 2**10 * 2 * 100 overflows float16
      ...     grads, finite, ls = step(ls, jnp.full(1, w, jnp.float16))
      ...     print(grads.tolist(), bool(finite), float(ls.loss_scale))
      [2.0] True 1024.0
      [inf] False 512.0
    """
    ls = loss_scale_of(loss_scale)

    def scaled_fun(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out = fun(*args, **kwargs)
        loss = out[0] if has_aux else out
        return ls.scale(loss), out

    value_and_grad = jax.value_and_grad(scaled_fun, argnums=argnums, has_aux=True)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, jax.Array]:
        (_, value), grads = value_and_grad(*args, **kwargs)
        grads = ls.unscale(grads)
        return value, grads, reduce_finite(all_finite(grads), axis_name)

    return wrapped
