"""The three executions of the skip (``_skip``) compute the same thing, bit for bit.

``select_at_definition`` (``skip_strategy='select'``) replays the inner update's jaxpr with each
new state value selected where it is defined; ``select_outputs`` (its fallback) selects the
outputs; ``cond_skip`` (``'cond'``) branches. On every step, finite or not, the updates and the
inner state of the three are compared byte for byte, over random gradient sequences with
non-finite steps, for the inner transformations the issue names and a few with unusual states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend import core as jex

from lossscale.jax import _skip, loss_scale_optimizer

SKIPS = {
    "select_at_definition": _skip.select_at_definition,
    "select_outputs": _skip.select_outputs,
    "cond_skip": _skip.cond_skip,
}


def keeps_last_grads() -> optax.GradientTransformation:
    """A state that *is* the gradients (an input passed through), a constant leaf, and one
    value stored in two leaves: the state outputs ``select_at_definition`` selects at the end."""

    def init(params: Any) -> Any:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return {"last": zeros, "const": jnp.float32(0), "twice": (zeros, zeros)}

    def update(grads: Any, state: Any, params: Any = None) -> Any:
        doubled = jax.tree_util.tree_map(lambda g: 2 * g, grads)
        new = {"last": grads, "const": jnp.float32(7), "twice": (doubled, doubled)}
        return jax.tree_util.tree_map(lambda g: -0.1 * g, grads), new

    return optax.GradientTransformation(init, update)


INNERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "chain(clip_by_global_norm, adamw)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-2)
    ),
    "inject_hyperparams(adam)": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "MultiSteps(adam)": lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    "lion + bfloat16 moments": lambda: optax.lion(1e-3, mu_dtype=jnp.bfloat16),
    "keeps_last_grads": keeps_last_grads,
}


def params0() -> dict[str, Any]:
    return {"w": jnp.arange(12.0).reshape(3, 4) / 10, "b": jnp.ones(4, jnp.float32)}


def bits(tree: Any) -> list[tuple[str, bytes]]:
    return [
        (str(np.asarray(x).dtype), np.asarray(x).tobytes()) for x in jax.tree_util.tree_leaves(tree)
    ]


@pytest.mark.parametrize("name", list(INNERS))
def test_every_skip_gives_the_same_bits(name: str) -> None:
    inner = INNERS[name]()
    params = params0()

    def step(skip: Any) -> Any:
        @jax.jit
        def run(grads: Any, state: Any, finite: jax.Array) -> Any:
            return skip(inner.update, finite, grads, state, params, {})

        return run

    runs = {k: step(skip) for k, skip in SKIPS.items()}
    states = dict.fromkeys(SKIPS, inner.init(params))
    rng = np.random.default_rng(1)
    for i in range(12):
        grads = jax.tree_util.tree_map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params
        )
        finite = i % 3 != 1
        if not finite:  # what a skipped step gets: non-finite gradients
            grads["w"] = grads["w"].at[0, 1].set(jnp.nan if i % 2 else jnp.inf)
        outs = {k: runs[k](grads, states[k], jnp.asarray(finite)) for k in SKIPS}
        reference = bits(outs["select_outputs"])
        for k, (updates, state) in outs.items():
            assert bits((updates, state)) == reference, (k, i)
            if not finite:
                assert bits(state) == bits(states[k]), (k, i)  # the old state, bit for bit
                assert all(not np.asarray(u).any() for u in jax.tree_util.tree_leaves(updates))
            states[k] = state


def test_state_values_are_selected_where_they_are_defined() -> None:
    """In the replayed program the updates are computed from the *selected* moments: the
    select sits between the moment's definition and its use (what lets XLA update the moment
    buffers in place), not only on the outputs."""
    inner = optax.adam(1e-2)
    params = params0()
    state = inner.init(params)

    def run(grads: Any, s: Any, finite: jax.Array) -> Any:
        return _skip.select_at_definition(inner.update, finite, grads, s, params, {})

    jaxpr = jax.make_jaxpr(run)(params, state, jnp.asarray(True)).jaxpr
    selects = [e for e in jaxpr.eqns if e.primitive is lax.select_n_p]
    selected = {v for e in selects for v in e.outvars}
    used_by_math = {
        v
        for e in jaxpr.eqns
        if e.primitive is not lax.select_n_p
        for v in e.invars
        if not isinstance(v, jex.Literal)
    }
    # mu and nu of both leaves (4 values) are selected and then read by the update's math.
    assert len(selected & used_by_math) >= 4


def test_untraceable_inner_falls_back_and_reports_its_own_error() -> None:
    """An inner update that fails to trace is run directly (``select_outputs``), so the user
    sees the inner transformation's own error, not one from the replay."""

    def update(grads: Any, state: Any, params: Any = None) -> Any:
        raise ValueError("the inner transformation's own message")

    inner = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    opt = loss_scale_optimizer(inner)
    state = opt.init(params0())
    with pytest.raises(ValueError, match="own message"):
        opt.update(params0(), state, params0())


def test_extra_args_reach_the_replayed_update() -> None:
    """``**extra_args`` (optax's GradientTransformationExtraArgs) are closed over by the traced
    update: a traced array extra argument works under jit and changes the result."""

    def update(grads: Any, state: Any, params: Any = None, *, lr: Any = 1.0) -> Any:
        new = state + 1
        return jax.tree_util.tree_map(lambda g: -lr * g * new, grads), new

    inner = optax.GradientTransformationExtraArgs(lambda p: jnp.float32(0), update)
    opt = loss_scale_optimizer(inner, initial_scale=2.0)
    state = opt.init(params0())
    step = jax.jit(lambda g, s, lr: opt.update(g, s, params0(), lr=lr))
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 2), params0())
    updates, state = step(grads, state, jnp.float32(0.5))
    assert float(updates["w"][0, 0]) == -0.5 and float(state.inner_state) == 1.0
    bad = {"w": grads["w"].at[0, 0].set(jnp.inf), "b": grads["b"]}
    updates, state2 = step(bad, state, jnp.float32(0.5))
    assert float(state2.inner_state) == 1.0 and not np.asarray(updates["w"]).any()


def test_a_replay_that_fails_falls_back_to_selecting_the_outputs(monkeypatch: Any) -> None:
    """The replay binds each traced equation again; should one not replay (a primitive this
    JAX version cannot re-bind from its jaxpr), the outputs are selected instead, with the
    same bits, rather than the step failing."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("no replay")

    inner = optax.adam(1e-2)
    params = params0()
    grads = jax.tree_util.tree_map(lambda p: p * 0.5, params)
    state = inner.init(params)
    want = _skip.select_outputs(inner.update, jnp.asarray(True), grads, state, params, {})
    monkeypatch.setattr(_skip, "_replay", broken)
    got = _skip.select_at_definition(inner.update, jnp.asarray(True), grads, state, params, {})
    assert bits(got) == bits(want)
