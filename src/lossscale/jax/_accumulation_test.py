"""Gradient accumulation with ``optax.MultiSteps`` and :func:`loss_scale_optimizer`.

``loss_scale_optimizer(optax.MultiSteps(inner, k))`` (loss scaling outside) checks every
micro-batch: a non-finite one is skipped before it reaches the accumulator. The other order is
unsafe with optax 0.2.8, whose accumulator keeps a NaN forever; a tripwire test pins that, so
the documentation's warning is updated when optax changes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lossscale._testing import bits
from lossscale.jax import (
    current_scale,
    last_step_applied,
    loss_scale_optimizer,
    scale_loss,
    skipped_steps,
)

K = 3
LR = 0.25
#: Micro-batches: the gradient of sum(w * x) is x, so each one's gradient is known exactly.
MICRO = [1.0, 2.0, 3.0, np.inf, 1.0, 5.0, np.nan, 2.0, 3.0, 4.0, -np.inf, 6.0, 7.0]


def loss_fn(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.sum(params["w"] * x)


def make_step(opt: Any) -> Any:
    @jax.jit
    def step(params: Any, state: Any, x: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(lambda p: scale_loss(loss_fn(p, x), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def micro_batch(value: float) -> jax.Array:
    return jnp.asarray([value, value / 2, -value], jnp.float32)


@pytest.mark.parametrize("wrap", ["MultiSteps", "gradient_transformation()"])
def test_loss_scaling_outside_multisteps_accumulates_only_finite_micro_batches(wrap: str) -> None:
    """The same parameters, bit for bit, as plain MultiSteps over the finite micro-batches;
    each non-finite micro-batch is skipped (the accumulator does not move) and halves the
    scale at once, also in the middle of a window."""
    multi = optax.MultiSteps(optax.sgd(LR), every_k_schedule=K)
    inner = multi if wrap == "MultiSteps" else multi.gradient_transformation()
    opt = loss_scale_optimizer(inner, initial_scale=2.0**10, dynamic_growth_steps=1000)
    params = {"w": jnp.ones(3, jnp.float32)}
    state = opt.init(params)
    step = make_step(opt)

    reference = optax.MultiSteps(optax.sgd(LR), every_k_schedule=K)
    ref_params, ref_state = params, reference.init(params)
    ref_step = jax.jit(reference.update)

    bad = 0
    for value in MICRO:
        before = state
        params, state = step(params, state, micro_batch(value))
        if np.isfinite(value):
            # powers of two: unscaling is exact, so the reference sees the same gradients
            updates, ref_state = ref_step({"w": micro_batch(value)}, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, updates)
            assert bool(last_step_applied(state))
        else:
            bad += 1
            assert not bool(last_step_applied(state))
            assert bits(state.inner_state) == bits(before.inner_state)  # accumulator unmoved
        assert bits(params) == bits(ref_params), value
        assert int(state.inner_state.mini_step) == int(ref_state.mini_step)
        assert float(current_scale(state)) == 2.0**10 / 2**bad
    assert int(skipped_steps(state)) == bad == 3
    assert int(state.inner_state.gradient_step) == int(ref_state.gradient_step) == 3
    assert np.isfinite(np.asarray(state.inner_state.acc_grads["w"])).all()


def test_multisteps_outside_keeps_a_nan_forever_tripwire() -> None:
    """optax 0.2.8's MultiSteps clears its accumulator as ``(1 - emit) * acc``; NaN * 0 is NaN,
    so after one non-finite micro-batch every later window is non-finite and skipped. This is
    why the docs say to put loss scaling outside. If this test fails, optax changed: update
    the warning in ``loss_scale_optimizer``'s docstring and in docs/getting-started.md."""
    opt = optax.MultiSteps(loss_scale_optimizer(optax.sgd(LR), initial_scale=8.0), 2)
    params = {"w": jnp.ones(3, jnp.float32)}
    state = opt.init(params)
    step = make_step(opt)
    decisions = []
    for value in [1.0, np.inf, 1.0, 1.0, 2.0, 2.0]:  # windows: [1, inf], [1, 1], [2, 2]
        params, state = step(params, state, micro_batch(value))
        if int(state.mini_step) == 0:  # a window was emitted
            decisions.append(bool(last_step_applied(state)))
    assert decisions == [False, False, False]  # the finite windows are skipped too
    assert np.isnan(np.asarray(state.acc_grads["w"])).all()
    assert np.asarray(params["w"]).tolist() == [1.0, 1.0, 1.0]


def test_an_object_without_gradient_transformation_is_still_refused() -> None:
    class NotATransformation:
        gradient_transformation = None

    with pytest.raises(TypeError, match="inner"):
        loss_scale_optimizer(NotATransformation())  # type: ignore[arg-type]
