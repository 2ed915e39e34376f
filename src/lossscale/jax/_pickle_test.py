"""Pickle and deepcopy of every JAX state and value class (checkpointing with pickle, copying a
train state): the copy has the same tree structure (static data included) and equal leaves."""

from __future__ import annotations

import copy
import functools
import pickle
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lossscale.jax import (
    DynamicLossScale,
    FixedLossScale,
    loss_scale_optimizer,
    stalled_steps,
)

COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
}


def _same(a: Any, b: Any) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _advanced_state(opt: Any) -> Any:
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    state = opt.init(params)
    for g in (1.0, jnp.inf, 2.0):
        grads = jax.tree_util.tree_map(lambda p, g=g: jnp.full_like(p, g), params)
        _, state = opt.update(grads, state, params)
    return state


@functools.cache
def _optimizer_and_state(which: str) -> tuple[Any, Any]:
    opt = OPTIMIZERS[which]()
    return opt, _advanced_state(opt)


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "dynamic_adam": lambda: loss_scale_optimizer(optax.adam(1e-3), initial_scale=8.0),
    "extensions": lambda: loss_scale_optimizer(
        optax.sgd(0.1), hysteresis=2, multiplier=1.1, backoff_factor=0.3, stall_steps=5
    ),
    "fixed": lambda: loss_scale_optimizer(optax.sgd(0.1), dynamic=False, initial_scale=8.0),
    "disabled": lambda: loss_scale_optimizer(optax.sgd(0.1), enabled=False),
}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("which", OPTIMIZERS)
def test_optimizer_state_pickles_and_copies(which: str, how: str) -> None:
    opt, state = _optimizer_and_state(which)
    copied = COPIES[how](state)
    _same(copied, state)
    assert stalled_steps(copied) == stalled_steps(state)
    # the copy keeps working: one more step from each gives the same state
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _same(opt.update(grads, copied, params)[1], opt.update(grads, state, params)[1])


@pytest.mark.parametrize("how", COPIES)
def test_value_classes_pickle_and_copy(how: str) -> None:
    dynamic = DynamicLossScale(64.0, 3, 1.5, hysteresis=2)
    dynamic = dynamic.adjust(jnp.asarray(False))
    for value in (dynamic, FixedLossScale(8.0)):
        copied = COPIES[how](value)
        assert copied == value and type(copied) is type(value)
        _same(copied, value)
    assert COPIES[how](dynamic).rule == dynamic.rule
    stall = _optimizer_and_state("dynamic_adam")[1].stall
    copied_stall = COPIES[how](stall)
    assert copied_stall.alarm == stall.alarm and int(copied_stall.count) == int(stall.count)
