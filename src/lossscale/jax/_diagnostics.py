"""Which gradients are not finite: the JAX counterpart of the torch optimizer's
``nonfinite_gradients``.

:func:`finite_leaves` is jit-friendly (a pytree of 0-d bools, computed on the device);
:func:`nonfinite_paths` is its host-side reading: the key paths and ``max |g|`` of the leaves
that hold a NaN or an inf, for the log line after a skipped step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _leaf_finite(g: Any) -> jax.Array:
    g = jnp.asarray(g)
    if not jnp.issubdtype(g.dtype, jnp.inexact):
        return jnp.ones((), jnp.bool_)  # integers and bools are always finite
    return jnp.all(jnp.isfinite(g))


def finite_leaves(grads: Any) -> Any:
    """A pytree shaped like ``grads`` with, per leaf, a 0-d bool: True when every element of
    that leaf is finite (the polarity of ``all_finite``: True = finite).

    Works under ``jit``, ``pmap`` and ``shard_map`` (per device; no collective). One reduction
    per leaf on the device; no host sync. Integer and bool leaves are finite; ``None`` entries
    are not leaves (as everywhere in JAX). Read it on the host with :func:`nonfinite_paths`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale.jax import finite_leaves
      >>> grads = {"w": jnp.array([1.0, jnp.inf]), "b": jnp.ones(2)}
      >>> jax.tree_util.tree_map(bool, jax.jit(finite_leaves)(grads))
      {'b': True, 'w': False}
    """
    return jax.tree_util.tree_map(_leaf_finite, grads)


def _report(grads: Any) -> tuple[Any, Any]:
    def max_abs(g: Any) -> jax.Array:
        g = jnp.asarray(g)
        if g.size == 0:
            return jnp.zeros((), jnp.float32)
        return jnp.max(jnp.abs(g)).astype(jnp.float32)

    return finite_leaves(grads), jax.tree_util.tree_map(max_abs, grads)


_report_jit = jax.jit(_report)


def nonfinite_paths(grads: Any) -> list[tuple[str, float]]:
    """``(path, max |g|)`` of every gradient leaf that holds a NaN or an inf, in tree order.

    The path is :func:`jax.tree_util.keystr` of the leaf's key path (``"['dense']['kernel']"``,
    ``".w"`` for an attribute); ``max |g|`` is ``inf`` or ``nan`` (as torch's
    ``nonfinite_gradients`` reports). Pass the gradients you want to examine: the scaled ones
    that went to ``update`` after a skipped step, or the unscaled ones of
    :func:`scaled_value_and_grad`. Costs nothing unless called; when called, one compiled
    reduction per leaf and one device-to-host read of all the flags together (host side: call
    it outside ``jit``; inside, use :func:`finite_leaves`). Under ``pmap``, a leaf is reported
    when any replica's copy is non-finite.

    Raises:
      TypeError: called on traced values (inside ``jit``).

    Example:
      >>> import jax.numpy as jnp
      >>> from lossscale.jax import nonfinite_paths
      >>> nonfinite_paths({"dense": {"kernel": jnp.array([1.0, jnp.nan]), "bias": jnp.ones(2)},
      ...                  "out": jnp.array([-jnp.inf], jnp.float16)})
      [("['dense']['kernel']", nan), ("['out']", inf)]
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(grads)):
        raise TypeError(
            "nonfinite_paths reads the gradients on the host: call it outside jax.jit; "
            "inside, use finite_leaves(grads)"
        )
    flags, maxes = jax.device_get(_report_jit(grads))  # one transfer for every leaf
    paths = jax.tree_util.tree_flatten_with_path(flags)[0]
    report = []
    for (path, ok), m in zip(paths, jax.tree_util.tree_leaves(maxes), strict=True):
        if not np.all(ok):
            values = np.asarray(m, np.float64)
            value = float(np.nan if np.isnan(values).any() else np.max(values))
            report.append((jax.tree_util.keystr(path), value))
    return report
