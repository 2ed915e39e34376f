"""Tests of :func:`lossscale.jax.scaled_value_and_grad`."""

from __future__ import annotations

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
    scaled_value_and_grad,
)


def loss_fn(params: Any, x: Any) -> Any:
    return jnp.sum((x @ params["w"] + params["b"]) ** 2)


def inputs() -> tuple[dict[str, Any], Any]:
    params = {"w": jnp.arange(6.0).reshape(3, 2) / 10, "b": jnp.ones(2)}
    return params, jnp.arange(3.0).reshape(1, 3)


@pytest.mark.parametrize("ls", [DynamicLossScale(2.0**10), FixedLossScale(8)])
def test_matches_value_and_grad(ls: Any) -> None:
    params, x = inputs()
    loss, grads, finite = jax.jit(scaled_value_and_grad(loss_fn, ls))(params, x)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x)
    assert bool(finite) and finite.dtype == jnp.bool_
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_has_aux_argnums_and_kwargs() -> None:
    params, x = inputs()

    def f(p: Any, x: Any, *, k: float = 1.0) -> Any:
        return k * loss_fn(p, x), {"k": k}

    wrapped = scaled_value_and_grad(f, DynamicLossScale(4.0), has_aux=True, argnums=(0, 1))
    (loss, aux), (gp, gx), finite = wrapped(params, x, k=2.0)
    assert aux == {"k": 2.0} and bool(finite)
    ref_loss, (rp, rx) = jax.value_and_grad(lambda p, x: f(p, x, k=2.0)[0], argnums=(0, 1))(
        params, x
    )
    np.testing.assert_allclose(loss, ref_loss)
    np.testing.assert_allclose(gx, rx, rtol=1e-6)
    np.testing.assert_allclose(gp["w"], rp["w"], rtol=1e-6)


def test_overflow_is_reported_not_hidden() -> None:
    params, x = inputs()
    big = DynamicLossScale(3e38)
    loss, _, finite = scaled_value_and_grad(loss_fn, big)(params, x)
    assert bool(jnp.isfinite(loss))  # the returned loss is unscaled
    assert not bool(finite)
    new = big.adjust(finite)
    assert float(new.loss_scale) == pytest.approx(1.5e38)


def test_half_precision_params_loss_scaled_in_float32() -> None:
    # float16 loss of 60000 * 2**15 would overflow float16; scaled in float32 it does not.
    w = jnp.asarray([60000.0], jnp.float16)
    wrapped = scaled_value_and_grad(lambda w: jnp.sum(w), DynamicLossScale(2.0**15))
    loss, grads, finite = wrapped(w)
    assert loss.dtype == jnp.float16 and float(loss) == 60000.0
    assert grads.dtype == jnp.float16 and float(grads[0]) == 1.0 and bool(finite)


def test_unscales_with_the_scale_used_for_the_loss_on_growth_steps() -> None:
    # mpx adjusts first and unscales with the new scale: grads halve on every growth step.
    ls = DynamicLossScale(4.0, increment_period=1)
    for _ in range(3):
        _, grads, finite = scaled_value_and_grad(lambda w: jnp.sum(3.0 * w), ls)(jnp.ones(2))
        assert list(np.asarray(grads)) == [3.0, 3.0]
        ls = ls.adjust(finite)
    assert float(ls.loss_scale) == 32.0


def test_accepts_an_optimizer_state() -> None:
    params, x = inputs()
    opt = loss_scale_optimizer(optax.sgd(1.0), initial_scale=16.0)
    state = opt.init(params)
    _, grads, _ = scaled_value_and_grad(loss_fn, state)(params, x)
    ref = jax.grad(loss_fn)(params, x)
    np.testing.assert_allclose(grads["w"], ref["w"], rtol=1e-6)
    # the optimizer path: scaled grads in, the same update out
    scaled = jax.grad(lambda p: loss_fn(p, x) * 16.0)(params)
    u, _ = opt.update(scaled, state, params)
    np.testing.assert_allclose(u["w"], -grads["w"], rtol=1e-6)


# -- axis_name: the flag agrees across devices ----------------------------------------------

AXIS_NAME = r"""
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from lossscale.jax import DynamicLossScale, scaled_value_and_grad
n = jax.device_count()
assert n == 2, jax.devices()

def loss_fn(w, x):
    return jnp.sum(w * x)

x = np.ones((n, 3), np.float32)
x[1, 2] = np.inf  # device 1's gradient holds an inf, device 0's is finite

def local(w, x, ls, axis_name):
    _, grads, finite = scaled_value_and_grad(loss_fn, ls, axis_name=axis_name)(w, x)
    return finite, ls.adjust(finite).loss_scale

ls = DynamicLossScale(8.0)
w = jnp.ones((n, 3))

# pmap
for axis_name in ("i", None):
    finite, scale = jax.pmap(lambda w, x: local(w, x, ls, axis_name), axis_name="i")(w, x)
    print("pmap", axis_name, np.asarray(finite).tolist(), np.asarray(scale).tolist())

# shard_map
mesh = Mesh(np.array(jax.devices()), ("d",))
for axis_name in ("d", None):
    f = jax.jit(jax.shard_map(
        lambda w, x: tuple(a[None] for a in local(w[0], x[0], ls, axis_name)),
        mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P("d"), P("d"))))
    finite, scale = f(w, x)
    print("shard_map", axis_name, np.asarray(finite).tolist(), np.asarray(scale).tolist())
"""


def test_axis_name_makes_every_device_agree() -> None:
    from lossscale._testing import run_on_host_devices

    lines = " ".join(run_on_host_devices(AXIS_NAME, devices=2))
    for kind, axis in (("pmap", "i"), ("shard_map", "d")):
        assert f"{kind} {axis} [False, False] [4.0, 4.0]" in lines, lines
        # without axis_name each device decides alone: the scales diverge
        assert f"{kind} None [True, False] [8.0, 4.0]" in lines, lines
