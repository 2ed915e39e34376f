"""Tests of :func:`lossscale.jax.finite_leaves` and :func:`lossscale.jax.nonfinite_paths`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lossscale.jax import (
    all_finite,
    finite_leaves,
    last_step_applied,
    loss_scale_optimizer,
    nonfinite_paths,
)

NAN, INF = float("nan"), float("inf")


def grads() -> dict[str, object]:
    return {
        "dense": {"kernel": jnp.array([[1.0, NAN], [2.0, 3.0]]), "bias": jnp.ones(2)},
        "embed": jnp.array([1.0, -INF], jnp.float16),
        "head": [jnp.array([2.0, -7.5], jnp.bfloat16), None, jnp.zeros((0,))],
        "steps": jnp.array([3], jnp.int32),
    }


def test_finite_leaves_is_a_pytree_of_flags_under_jit() -> None:
    flags = jax.jit(finite_leaves)(grads())
    assert jax.tree_util.tree_structure(flags) == jax.tree_util.tree_structure(grads())
    got = {jax.tree_util.keystr(p): bool(f) for p, f in jax.tree_util.tree_leaves_with_path(flags)}
    assert got == {
        "['dense']['bias']": True,
        "['dense']['kernel']": False,
        "['embed']": False,
        "['head'][0]": True,
        "['head'][2]": True,
        "['steps']": True,
    }
    # the flags agree with the one flag of all_finite
    assert all(jax.tree_util.tree_leaves(flags)) == bool(all_finite(grads()))
    assert all(jax.tree_util.tree_leaves(finite_leaves({"a": jnp.ones(3)})))


def test_nonfinite_paths_names_the_leaves_and_their_max_abs() -> None:
    report = nonfinite_paths(grads())
    assert [path for path, _ in report] == ["['dense']['kernel']", "['embed']"]
    assert math.isnan(report[0][1]) and report[1][1] == INF
    assert nonfinite_paths({"w": jnp.ones(3)}) == []


def test_nonfinite_paths_after_a_skipped_step_and_refuses_tracers() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0**15)
    params = {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.float16)}
    scaled = {"a": jnp.array([1.0, 2.0], jnp.float16), "b": jnp.array([6e4, 3e4], jnp.float16) * 2}
    _, state = opt.update(scaled, opt.init(params), params)
    assert not bool(last_step_applied(state))
    assert nonfinite_paths(scaled) == [("['b']", INF)]  # 6e4 * 2 overflows float16
    with pytest.raises(TypeError, match="finite_leaves"):
        jax.jit(nonfinite_paths)(scaled)


def test_nonfinite_paths_on_replicated_arrays_reports_any_replica() -> None:
    g = np.ones((jax.local_device_count(), 3), np.float32)
    g[-1, 0] = NAN
    stacked = {"w": jnp.asarray(g), "v": jnp.ones((g.shape[0], 2))}
    assert [p for p, _ in nonfinite_paths(stacked)] == ["['w']"]
