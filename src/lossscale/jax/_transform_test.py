"""Tests of :func:`lossscale.jax.loss_scale_optimizer` and its helpers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from lossscale._testing import run_on_host_devices
from lossscale.jax import (
    DynamicLossScale,
    FixedLossScale,
    LossScaleState,
    current_scale,
    last_applied,
    last_step_applied,
    loss_scale_optimizer,
    scale_loss,
    skipped_steps,
    unscale_grads,
)

NAN = float("nan")
INF = float("inf")
STRATEGIES = ["select", "cond"]


def params0() -> dict[str, Any]:
    return {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.float32)}


def grads_like(params: dict[str, Any], value: float = 1.0, bad: float | None = None) -> Any:
    g = jax.tree_util.tree_map(lambda p: jnp.full_like(p, value), params)
    if bad is not None:
        g["b"] = g["b"].at[0].set(bad)
    return g


def assert_trees_equal(a: Any, b: Any) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- construction -------------------------------------------------------------------------------


def test_validation() -> None:
    sgd = optax.sgd(0.1)
    with pytest.raises(TypeError, match="GradientTransformation"):
        loss_scale_optimizer(lambda g: g)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dynamic"):
        loss_scale_optimizer(sgd, dynamic=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="initial_scale"):
        loss_scale_optimizer(sgd, dynamic=False)
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
        loss_scale_optimizer(sgd, dynamic=False, initial_scale=4, dynamic_growth_steps=10)
    with pytest.raises(ValueError, match="min_loss_scale"):
        loss_scale_optimizer(sgd, dynamic=False, initial_scale=4, min_loss_scale=2)
    with pytest.raises(ValueError, match="skip_strategy"):
        loss_scale_optimizer(sgd, skip_strategy="multiply")
    with pytest.raises(ValueError):
        loss_scale_optimizer(sgd, initial_scale=0)
    with pytest.raises(ValueError):
        loss_scale_optimizer(sgd, dynamic_growth_steps=0)
    with pytest.raises(TypeError):
        loss_scale_optimizer(sgd, dynamic_growth_steps=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        loss_scale_optimizer(sgd, initial_scale=8, max_loss_scale=4)
    with pytest.raises(ValueError):
        loss_scale_optimizer(sgd, dynamic=False, initial_scale=0.5)
    assert isinstance(loss_scale_optimizer(sgd), optax.GradientTransformationExtraArgs)


def test_init_state() -> None:
    state = loss_scale_optimizer(optax.adam(1e-3), dynamic_growth_steps=7).init(params0())
    assert isinstance(state, LossScaleState)
    assert isinstance(state.loss_scale, DynamicLossScale)
    assert state.loss_scale.increment_period == 7
    assert float(current_scale(state)) == 2.0**15
    assert int(skipped_steps(state)) == 0 and bool(last_step_applied(state))
    assert state.skipped_steps.dtype == jnp.int32
    fixed = loss_scale_optimizer(optax.sgd(1.0), dynamic=False, initial_scale=64).init(params0())
    assert isinstance(fixed.loss_scale, FixedLossScale) and float(current_scale(fixed)) == 64.0


# -- semantics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_trajectory_as_the_stateful_class(strategy: str) -> None:
    steps = [True, True, False, True, True, True, False, False, True, True, True, True]
    opt = loss_scale_optimizer(
        optax.sgd(0.1), initial_scale=16.0, dynamic_growth_steps=2, skip_strategy=strategy
    )
    ref = lossscale.DynamicLossScale(16.0, 2)
    params = params0()
    state = opt.init(params)
    update = jax.jit(opt.update)
    for finite in steps:
        scale = float(current_scale(state))
        grads = grads_like(params, scale, None if finite else INF)
        updates, state = update(grads, state, params)
        _, ok = ref.update([np.asarray(x) for x in jax.tree_util.tree_leaves(grads)])
        assert bool(state.last_step_applied) == bool(ok) == finite
        assert float(current_scale(state)) == float(ref())
        assert int(state.loss_scale.good_steps) == ref.num_good_steps
        # unscaled by the scale the loss was scaled with: grads of 1.0, even on growth steps
        expected = -0.1 if finite else 0.0
        assert_trees_equal(updates, grads_like(params, expected))
    assert int(skipped_steps(state)) == steps.count(False)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_skip_leaves_params_inner_state_and_count_unchanged(strategy: str) -> None:
    opt = loss_scale_optimizer(optax.adam(0.1), initial_scale=4.0, skip_strategy=strategy)
    params = params0()
    state = opt.init(params)
    step = jax.jit(
        lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(*opt.update(g, s, p))
    )
    params, state = step(params, state, grads_like(params, 4.0))
    assert int(state.inner_state[0].count) == 1
    before_params, before_inner = params, state.inner_state
    for bad in (NAN, INF, -INF):
        params, state = step(params, state, grads_like(params, 4.0, bad))
        assert_trees_equal(params, before_params)
        assert_trees_equal(state.inner_state, before_inner)  # mu, nu and count untouched
        assert not bool(state.last_step_applied)
    assert int(state.inner_state[0].count) == 1
    assert float(current_scale(state)) == 0.5 or float(current_scale(state)) == 1.0
    params, state = step(params, state, grads_like(params, float(current_scale(state))))
    assert int(state.inner_state[0].count) == 2 and bool(state.last_step_applied)


#: Common optax inner transformations, with states of different shapes: moments, factored
#: moments (adafactor), injected hyperparameters, masked leaves, chains and accumulation.
INNERS: dict[str, Any] = {
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: optax.lion(1e-3),
    "lamb": lambda: optax.lamb(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2, centered=True),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "inject_hyperparams(adam)": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "masked(adam)": lambda: optax.masked(optax.adam(1e-2), {"w": True, "b": False}),
    "chain(clip_by_global_norm, adam, schedule)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(),
        optax.scale_by_schedule(optax.cosine_decay_schedule(1e-2, 100)),
        optax.scale(-1.0),
    ),
    "MultiSteps(adam)": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(INNERS))
def test_common_inner_optimizers_apply_like_the_inner_and_skip_without_a_trace(
    name: str, strategy: str
) -> None:
    """A finite step gives the inner transformation's own updates and state for the unscaled
    gradients (a power-of-two scale: unscaling is exact; the programs differ, so values agree
    to float32 rounding); an overflowing step gives zero updates and leaves every leaf of the
    inner state bit for bit as it was."""
    inner = INNERS[name]()
    reference = (
        inner.gradient_transformation() if hasattr(inner, "gradient_transformation") else inner
    )
    opt = loss_scale_optimizer(INNERS[name](), initial_scale=2.0**8, skip_strategy=strategy)
    update = jax.jit(opt.update)
    ref_update = jax.jit(reference.update)
    params = params0()
    state, ref_state = opt.init(params), reference.init(params)
    rng = np.random.default_rng(0)
    for step, bad in enumerate([None, None, INF, None, NAN, -INF, None, None]):
        g = jax.tree_util.tree_map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
        )
        scaled = {k: v * float(current_scale(state)) for k, v in g.items()}
        if bad is not None:
            scaled["w"] = scaled["w"].at[1, 2].set(bad)
        before = state.inner_state
        updates, state = update(scaled, state, params)
        if bad is None:
            ref_updates, ref_state = ref_update(g, ref_state, params)
            for a, b in zip(
                jax.tree_util.tree_leaves((updates, state.inner_state)),
                jax.tree_util.tree_leaves((ref_updates, ref_state)),
                strict=True,
            ):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
            assert bool(last_step_applied(state)), step
            params = optax.apply_updates(params, updates)
        else:
            assert not bool(last_step_applied(state)), step
            assert_trees_equal(updates, jax.tree_util.tree_map(jnp.zeros_like, updates))
            assert_trees_equal(state.inner_state, before)
    assert int(skipped_steps(state)) == 3
    assert float(current_scale(state)) == 2.0**5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_never_reaches_params_unlike_apply_if_finite(strategy: str) -> None:
    # optax.apply_if_finite(inner, N) applies the (N+1)-th consecutive non-finite update.
    params = params0()
    aif = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)
    s = aif.init(params)
    p = params
    for _ in range(5):
        u, s = aif.update(grads_like(params, 1.0, NAN), s, p)
        p = optax.apply_updates(p, u)
    assert not bool(jnp.all(jnp.isfinite(p["b"])))  # the anchor's bug, reproduced

    opt = loss_scale_optimizer(optax.sgd(0.1), skip_strategy=strategy)
    state = opt.init(params)
    update = jax.jit(opt.update)
    p = params
    for _ in range(50):
        u, state = update(grads_like(params, 1.0, NAN), state, p)
        p = optax.apply_updates(p, u)
    assert_trees_equal(p, params)
    assert int(skipped_steps(state)) == 50
    assert float(current_scale(state)) == 1.0  # bounded at min_loss_scale, never 0


def test_fixed_scale_applies_everything_like_tensorflow() -> None:
    opt = loss_scale_optimizer(optax.sgd(1.0), dynamic=False, initial_scale=4)
    params = params0()
    state = opt.init(params)
    u, state = opt.update(grads_like(params, 8.0), state, params)
    assert_trees_equal(u, grads_like(params, -2.0))
    u, state = opt.update(grads_like(params, 8.0, NAN), state, params)
    assert bool(jnp.isnan(u["b"][0])) and bool(state.last_step_applied)
    assert int(state.skipped_steps) == 0 and float(current_scale(state)) == 4.0


def test_half_grads_unscaled_in_float32() -> None:
    opt = loss_scale_optimizer(optax.sgd(1.0), initial_scale=3.0)
    params = {"h": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.bfloat16)}
    state = opt.init(params)
    grads = {"h": jnp.full(2, 3.0, jnp.float16), "b": jnp.full(2, 3.0, jnp.bfloat16)}
    u, state = opt.update(grads, state, params)
    assert u["h"].dtype == jnp.float16 and float(u["h"][0]) == -1.0
    assert u["b"].dtype == jnp.bfloat16 and float(u["b"][0]) == -1.0
    assert state.loss_scale.loss_scale.dtype == jnp.float32
    # a finite float16 gradient that overflows when unscaled by a scale < 1 is a skip
    small = loss_scale_optimizer(optax.sgd(1.0), initial_scale=0.25, min_loss_scale=0.125)
    s = small.init(params)
    u, s = small.update({"h": jnp.full(2, 60000.0, jnp.float16), "b": grads["b"]}, s, params)
    assert not bool(s.last_step_applied) and float(u["h"][0]) == 0.0


def test_extra_args_are_forwarded() -> None:
    seen: dict[str, Any] = {}

    def init(params: Any) -> optax.EmptyState:
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        seen.update(extra)
        return jax.tree_util.tree_map(lambda g: -extra["value"] * g, updates), state

    inner = optax.GradientTransformationExtraArgs(init, update)
    opt = loss_scale_optimizer(inner, initial_scale=2.0)
    params = params0()
    u, _ = opt.update(grads_like(params, 2.0), opt.init(params), params, value=jnp.float32(3))
    assert "value" in seen
    assert_trees_equal(u, grads_like(params, -3.0))
    # a plain GradientTransformation ignores extra args
    opt2 = loss_scale_optimizer(optax.sgd(1.0), initial_scale=2.0)
    opt2.update(grads_like(params, 2.0), opt2.init(params), params, value=1.0)


def test_scale_loss_of_python_ints_of_any_size() -> None:
    state = loss_scale_optimizer(optax.sgd(1.0), initial_scale=4.0).init(params0())
    for loss in (3, 2**31, 2**70, -(2**100)):  # as the Python float of the same value
        out = scale_loss(loss, state)
        assert out.dtype == jnp.asarray(float(loss)).dtype
        assert float(out) == float(np.float32(float(loss)) * np.float32(4.0))
    assert float(scale_loss({"a": 2**40, "b": True}, state)["a"]) == 2.0**42
    with pytest.raises(ValueError, match=r"loss=1000000.*beyond float64's range"):
        scale_loss(10**400, state)


def test_helpers_work_on_chained_states() -> None:
    opt = optax.chain(optax.clip(1e9), loss_scale_optimizer(optax.sgd(1.0), initial_scale=8.0))
    params = params0()
    state = opt.init(params)
    assert float(current_scale(state)) == 8.0
    assert scale_loss(jnp.float16(2), state).dtype == jnp.float32
    assert float(scale_loss(jnp.float16(2), state)) == 16.0
    g = unscale_grads({"x": jnp.full(2, 8.0, jnp.float16)}, state)
    assert g["x"].dtype == jnp.float16 and float(g["x"][0]) == 1.0
    _, state = opt.update(grads_like(params, 1.0, NAN), state, params)
    assert int(skipped_steps(state)) == 1 and not bool(last_step_applied(state))
    with pytest.raises(ValueError, match="exactly one"):
        current_scale((state, state))
    with pytest.raises(ValueError, match="exactly one"):
        skipped_steps(optax.sgd(1.0).init(params))


def test_last_applied_is_the_former_name_of_last_step_applied() -> None:
    opt = optax.chain(optax.clip(1e9), loss_scale_optimizer(optax.sgd(1.0), initial_scale=8.0))
    params = params0()
    state = opt.init(params)
    for grads, applied in ((grads_like(params, 1.0, NAN), False), (grads_like(params), True)):
        _, state = opt.update(grads, state, params)
        ls_state = state[1]
        assert bool(last_applied(state)) is bool(last_step_applied(state)) is applied
        assert ls_state.last_applied is ls_state.last_step_applied  # a property of the field
    # the field keeps its name: pytrees and checkpoints of earlier versions still match
    assert "last_applied" in LossScaleState._fields
    assert "last_step_applied" not in LossScaleState._fields
    with pytest.raises(AttributeError):
        ls_state.last_step_applied = jnp.ones((), jnp.bool_)  # type: ignore[misc]
    with pytest.raises(ValueError, match="last_step_applied"):  # not a field: read-only
        ls_state._replace(last_step_applied=jnp.ones((), jnp.bool_))


def test_state_changes_never_recompile_and_state_keeps_its_types() -> None:
    traces: list[int] = []
    opt = loss_scale_optimizer(optax.adam(1e-3), initial_scale=2.0**4, dynamic_growth_steps=1)

    @jax.jit
    def step(params: Any, state: Any, grads: Any) -> Any:
        traces.append(1)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = params0()
    state = opt.init(params)

    def types(state: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        return treedef, [(x.shape, x.dtype, x.weak_type) for x in leaves]

    shapes = types(state)
    scales = set()
    for i in range(6):
        params, state = step(params, state, grads_like(params, 1.0, NAN if i % 3 == 2 else None))
        scales.add(float(current_scale(state)))
        assert types(state) == shapes
    assert len(scales) >= 3 and len(traces) == 1


def test_works_with_lax_scan_and_donation() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.5), initial_scale=4.0, dynamic_growth_steps=2)
    params = params0()

    def body(carry: Any, bad: Any) -> Any:
        p, s = carry
        g = jax.tree_util.tree_map(lambda x: jnp.where(bad, NAN, 1.0) * current_scale(s), p)
        u, s = opt.update(g, s, p)
        return (optax.apply_updates(p, u), s), s.last_step_applied

    run = jax.jit(lambda p, s, bads: jax.lax.scan(body, (p, s), bads), donate_argnums=(0, 1))
    bads = jnp.asarray([False, True, False, False, True])
    (p, s), applied = run(params, opt.init(params), bads)
    assert list(np.asarray(applied)) == [True, False, True, True, False]
    assert_trees_equal(p, jax.tree_util.tree_map(lambda x: x - 1.5, params0()))
    assert float(current_scale(s)) == 2.0  # 4 -> 4 -> 2 (skip) -> 2 -> 4 (growth) -> 2 (skip)


def test_loss_scale_state_is_a_pytree_with_rule_static() -> None:
    opt = loss_scale_optimizer(optax.sgd(1.0), min_loss_scale=0.5, dynamic_growth_steps=3)
    state = opt.init(params0())
    leaves, treedef = jax.tree_util.tree_flatten(state)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.loss_scale.rule == state.loss_scale.rule
    assert back.loss_scale.min_loss_scale == 0.5


# -- multiple devices (a subprocess: the device count must be set before jax starts) -------------

MULTI_DEVICE = r"""
import numpy as np, jax, jax.numpy as jnp, optax
from functools import partial
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from lossscale.jax import loss_scale_optimizer, current_scale
assert jax.device_count() == 8, jax.devices()
n = 8

def grads_with_nan_on(device):
    g = np.ones((n, 4), np.float32) * 8.0
    g[device, 1] = np.nan
    return jnp.asarray(g)

# 1. pmap with axis_name: the NaN on device 3 makes every replica skip.
opt = loss_scale_optimizer(optax.sgd(1.0), initial_scale=8.0, axis_name="i")
params = jnp.zeros((n, 4))
state = jax.pmap(opt.init)(params)
def pstep(g, s, p):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
p2, s2 = jax.pmap(pstep, axis_name="i")(grads_with_nan_on(3), state, params)
assert not np.asarray(s2.last_step_applied).any(), s2.last_step_applied
assert np.all(np.asarray(current_scale(s2)) == 4.0), current_scale(s2)
assert np.all(np.asarray(p2) == 0.0)
p3, s3 = jax.pmap(pstep, axis_name="i")(jnp.ones((n, 4)) * 4.0, s2, p2)
assert np.asarray(s3.last_step_applied).all() and np.all(np.asarray(p3) == -1.0)
print("pmap ok")

# 2. shard_map with axis_name, and without it (the anchors' bug: scales diverge).
mesh = Mesh(np.array(jax.devices()), ("d",))
def run_shard_map(axis_name, strategy):
    opt = loss_scale_optimizer(optax.sgd(1.0), initial_scale=8.0, axis_name=axis_name,
                               skip_strategy=strategy)
    def local(g, p):
        s = opt.init(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), current_scale(s)[None], s.last_step_applied[None]
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d")),
                              out_specs=(P("d"), P("d"), P("d"))))
    return f(grads_with_nan_on(5), jnp.zeros((n, 4)))
for strategy in ("select", "cond"):
    p, scales, applied = run_shard_map("d", strategy)
    assert np.all(np.asarray(scales) == 4.0) and not np.asarray(applied).any(), scales
    assert np.all(np.asarray(p) == 0.0)
p, scales, applied = run_shard_map(None, "select")
assert sorted(set(np.asarray(scales).tolist())) == [4.0, 8.0]  # without axis_name: diverged
print("shard_map ok")

# 3. GSPMD: jit on a globally sharded array needs nothing extra.
sharding = NamedSharding(mesh, P("d"))
opt = loss_scale_optimizer(optax.adam(0.1), initial_scale=8.0)
params = jax.device_put(jnp.zeros((n, 4)), sharding)
state = opt.init(params)
@jax.jit
def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
g = jax.device_put(grads_with_nan_on(6), sharding)
p2, s2 = step(params, state, g)
assert not bool(s2.last_step_applied) and float(current_scale(s2)) == 4.0
assert np.all(np.asarray(p2) == 0.0) and int(s2.inner_state[0].count) == 0
assert p2.sharding.is_equivalent_to(sharding, 2)
p3, s3 = step(p2, s2, jax.device_put(jnp.ones((n, 4)) * 4.0, sharding))
assert bool(s3.last_step_applied) and int(s3.inner_state[0].count) == 1
print("gspmd ok")
"""


def test_multi_device_every_replica_skips_together() -> None:
    words = run_on_host_devices(MULTI_DEVICE)
    assert words == ["pmap", "ok", "shard_map", "ok", "gspmd", "ok"]
