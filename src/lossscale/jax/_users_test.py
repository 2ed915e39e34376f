"""Tests of the optax transformation's user switches: the stall alarm (``stall_steps``,
``on_stall``, :func:`check_stall`), ``enabled=False`` and the separate growth/back-off factors."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from lossscale._testing import bits
from lossscale.core import (
    LossScaleStalledError,
    LossScaleStalledWarning,
    StallAlarm,
)
from lossscale.jax import (
    LossScaleState,
    StallCount,
    check_stall,
    current_scale,
    last_step_applied,
    loss_scale_optimizer,
    scale_loss,
    skipped_steps,
    stalled_steps,
)

INF = float("inf")
NAN = float("nan")


def run(opt: Any, grads_seq: list[Any], params: Any) -> list[LossScaleState]:
    """Jitted updates over ``grads_seq``; the state after each."""
    update = jax.jit(opt.update)
    state, states = opt.init(params), []
    for g in grads_seq:
        _, state = update(g, state, params)
        states.append(state)
    return states


def scan_counts(opt: Any, finite: np.ndarray) -> tuple[LossScaleState, np.ndarray]:
    """``len(finite)`` updates in one ``lax.scan`` (a NaN gradient where ``finite`` is False);
    the last state and the stall count after every step."""
    params = jnp.ones(3)

    def body(state: Any, ok: Any) -> tuple[Any, Any]:
        g = jnp.where(ok, jnp.ones(3), jnp.full(3, NAN))
        _, state = opt.update(g, state, params)
        return state, stalled_steps(state)

    state, counts = jax.jit(lambda s, f: lax.scan(body, s, f))(opt.init(params), finite)
    return state, np.asarray(counts)


# -- the count -----------------------------------------------------------------------------


def test_the_count_starts_at_the_floor_and_a_finite_step_resets_it() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=4.0, stall_steps=3)
    seq = [jnp.array([INF])] * 5 + [jnp.array([1.0])] + [jnp.array([NAN])] * 2
    states = run(opt, seq, jnp.ones(1))
    # scales used: 4, 2 (back-offs), then 1 = the floor: skipped at the floor from step 3 on
    assert [int(stalled_steps(s)) for s in states] == [0, 0, 1, 2, 3, 0, 1, 2]
    assert [float(current_scale(s)) for s in states] == [2, 1, 1, 1, 1, 1, 1, 1]
    assert [bool(s.stall.stalled) for s in states] == [0, 0, 0, 0, 1, 0, 0, 0]


def test_the_floor_is_min_loss_scale_and_hysteresis_keeps_counting() -> None:
    opt = loss_scale_optimizer(
        optax.sgd(0.1), initial_scale=0.5, min_loss_scale=0.25, hysteresis=2, stall_steps=None
    )
    states = run(opt, [jnp.array([NAN])] * 6, jnp.ones(1))
    assert [float(current_scale(s)) for s in states] == [0.5, 0.25, 0.25, 0.25, 0.25, 0.25]
    assert [int(stalled_steps(s)) for s in states] == [0, 0, 1, 2, 3, 4]


def test_the_alarm_is_static_data_and_survives_pytree_round_trips() -> None:
    opt = loss_scale_optimizer(optax.adam(0.1), stall_steps=7, on_stall="raise")
    state = opt.init({"w": jnp.ones(2)})
    assert state.stall.alarm == StallAlarm(7, "raise")
    leaves, treedef = jax.tree_util.tree_flatten(state)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(back.stall, StallCount) and back.stall.alarm == StallAlarm(7, "raise")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    assert ".stall.count" in paths
    with pytest.raises(AttributeError):
        state.stall.count = 1  # type: ignore[misc]


# -- the host check: warn, raise, off ------------------------------------------------------


def test_check_stall_warns_once_with_the_scale_and_count_and_rearms() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=2.0, stall_steps=4)
    bad, good = jnp.array([NAN]), jnp.array([1.0])
    seq = [bad] * 8 + [good] + [bad] * 4
    warned, fired_at = False, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, state in enumerate(run(opt, seq, jnp.ones(1))):
            before = len(caught)
            warned = check_stall(state, warned=warned)
            if len(caught) > before:
                fired_at.append(i)
            assert warned == bool(state.stall.stalled)
    # step 0 uses scale 2; steps 1.. are at the floor: count 4 at step 4; re-armed by step 8
    assert fired_at == [4, 12]
    assert all(w.category is LossScaleStalledWarning for w in caught)
    message = str(caught[0].message)
    assert "loss_scale_optimizer" in message and "last 4 steps" in message and "1.0" in message


def test_check_stall_raises_when_asked() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=3, on_stall="raise")
    states = run(opt, [jnp.array([INF])] * 3, jnp.ones(1))
    assert not check_stall(states[1])
    with pytest.raises(LossScaleStalledError, match="last 3 steps"):
        check_stall(states[2])


def test_check_stall_is_silent_when_off_fixed_or_disabled() -> None:
    bad = [jnp.array([NAN])] * 5
    for opt in (
        loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=None),
        loss_scale_optimizer(optax.sgd(0.1), dynamic=False, initial_scale=1.0, stall_steps=1),
        loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=1, enabled=False),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for state in run(opt, bad, jnp.ones(1)):
                assert check_stall(state) is False
                assert not bool(state.stall.stalled)
    off = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=None)
    assert int(stalled_steps(run(off, bad, jnp.ones(1))[-1])) == 5  # still counted
    fixed = loss_scale_optimizer(optax.sgd(0.1), dynamic=False, initial_scale=1.0)
    assert int(stalled_steps(run(fixed, bad, jnp.ones(1))[-1])) == 0


def test_the_default_fires_at_1000_stalled_steps() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0)  # stall_steps=1000 default
    state, counts = scan_counts(opt, np.zeros(999, bool))
    assert counts[-1] == 999
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_stall(state) is False
    state, _ = scan_counts(opt, np.zeros(1000, bool))
    with pytest.warns(LossScaleStalledWarning, match="last 1000 steps"):
        assert check_stall(state) is True


def test_a_healthy_run_with_rare_overflows_stays_silent() -> None:
    # U1: an ordinary run (default settings) with an overflow every ~50 steps, checked each
    # step; also one starting at the floor, where each overflow is a skipped step at the floor.
    rng = np.random.default_rng(0)
    finite = rng.random(5000) > 0.02
    for initial_scale in (None, 1.0):
        opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=initial_scale)
        state, counts = scan_counts(opt, finite)
        assert counts.max() <= 3, counts.max()
        assert int(skipped_steps(state)) == int((~finite).sum())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert check_stall(state) is False


def test_check_stall_finds_the_state_in_a_chain_and_refuses_tracers() -> None:
    opt = optax.chain(
        optax.clip(1.0), loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=1)
    )
    params = jnp.ones(1)
    _, state = opt.update(jnp.array([NAN]), opt.init(params), params)
    with pytest.warns(LossScaleStalledWarning):
        check_stall(state)
    with pytest.raises(TypeError, match=r"outside jax\.jit"):
        jax.jit(check_stall)(state)


def test_stall_arguments_are_validated() -> None:
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match="stall_steps must be an integer >= 1, got 0"):
        loss_scale_optimizer(sgd, stall_steps=0)
    with pytest.raises(TypeError, match="stall_steps"):
        loss_scale_optimizer(sgd, stall_steps=10.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_stall must be 'warn' or 'raise', got 'log'"):
        loss_scale_optimizer(sgd, on_stall="log")


# -- enabled=False -------------------------------------------------------------------------


def random_grads(n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    seq = []
    for i in range(n):
        g = {
            "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
            "h": jnp.asarray(rng.normal(size=5), jnp.bfloat16),
        }
        if i == 7:  # disabled: a non-finite gradient is applied, as the inner optimizer does
            g["w"] = g["w"].at[0, 0].set(INF)
        seq.append(g)
    return seq


def test_disabled_is_the_inner_update_bit_for_bit() -> None:
    inner = optax.adamw(1e-2, weight_decay=0.1)
    opt = loss_scale_optimizer(inner, enabled=False)
    params = {"w": jnp.ones((3, 4)), "h": jnp.ones(5, jnp.bfloat16)}
    step_ref = jax.jit(lambda p, s, g: inner.update(g, s, p))
    step_opt = jax.jit(lambda p, s, g: opt.update(g, s, p))
    p_ref, s_ref = params, inner.init(params)
    p_opt, s_opt = params, opt.init(params)
    for g in random_grads(12):
        u_ref, s_ref = step_ref(p_ref, s_ref, g)
        u_opt, s_opt = step_opt(p_opt, s_opt, g)
        assert bits(u_ref) == bits(u_opt)
        p_ref, p_opt = optax.apply_updates(p_ref, u_ref), optax.apply_updates(p_opt, u_opt)
        assert bits(p_ref) == bits(p_opt) and bits(s_ref) == bits(s_opt.inner_state)
    assert not np.isfinite(np.asarray(p_opt["w"])).all()  # the inf step was applied


def test_disabled_adds_no_operation_to_the_step() -> None:
    # U2: the traced update holds exactly the inner update's equations (no scale, no check).
    inner = optax.adam(1e-3)
    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    opt = loss_scale_optimizer(inner, enabled=False)
    ref = jax.make_jaxpr(lambda g, s, p: inner.update(g, s, p))(params, inner.init(params), params)
    got = jax.make_jaxpr(lambda g, s, p: opt.update(g, s, p))(params, opt.init(params), params)
    assert [e.primitive for e in got.eqns] == [e.primitive for e in ref.eqns]
    enabled = loss_scale_optimizer(inner)
    on = jax.make_jaxpr(lambda g, s, p: enabled.update(g, s, p))(
        params, enabled.init(params), params
    )
    assert len(on.eqns) > len(ref.eqns)  # the comparison can fail: enabled adds the check


def test_disabled_state_answers_the_helpers() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1024.0, enabled=False)
    params = jnp.ones(2)
    state = opt.init(params)
    _, state = jax.jit(opt.update)(jnp.array([1.0, NAN]), state, params)
    assert isinstance(state, LossScaleState)
    assert float(current_scale(state)) == 1.0 and int(skipped_steps(state)) == 0
    assert bool(last_step_applied(state)) and int(stalled_steps(state)) == 0
    assert float(scale_loss(jnp.float32(3.5), state)) == 3.5


def test_disabled_still_validates_every_argument() -> None:
    sgd = optax.sgd(0.1)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        loss_scale_optimizer(sgd, enabled="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="initial_scale"):
        loss_scale_optimizer(sgd, initial_scale=-1.0, enabled=False)
    with pytest.raises(ValueError, match="on_stall"):
        loss_scale_optimizer(sgd, on_stall="x", enabled=False)


# -- growth and back-off factors -----------------------------------------------------------


def test_separate_growth_and_backoff_factors() -> None:
    opt = loss_scale_optimizer(
        optax.sgd(0.1),
        initial_scale=64.0,
        dynamic_growth_steps=2,
        multiplier=4.0,
        backoff_factor=0.25,
    )
    ok, bad = jnp.array([1.0]), jnp.array([INF])
    states = run(opt, [ok, ok, bad, bad, ok], jnp.ones(1))
    assert [float(current_scale(s)) for s in states] == [64, 256, 64, 16, 16]
    assert find_rule(states[0]).backoff_factor == 0.25
    tf_like = loss_scale_optimizer(optax.sgd(0.1), initial_scale=64.0, multiplier=4.0)
    assert [float(current_scale(s)) for s in run(tf_like, [bad], jnp.ones(1))] == [16]


def find_rule(state: LossScaleState) -> Any:
    return state.loss_scale.rule  # type: ignore[union-attr]


def test_factor_arguments_are_validated() -> None:
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"backoff_factor must be > 0 and < 1, got 1\.5"):
        loss_scale_optimizer(sgd, backoff_factor=1.5)
    with pytest.raises(ValueError, match="multiplier must be finite and > 1"):
        loss_scale_optimizer(sgd, multiplier=1.0)
    with pytest.raises(ValueError, match="dynamic scale only"):
        loss_scale_optimizer(sgd, dynamic=False, initial_scale=8.0, backoff_factor=0.5)


# -- the alarm through flax nnx and pmap ---------------------------------------------------


def test_check_stall_reads_an_nnx_optimizer_state() -> None:
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=2)
    optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)
    nan_grads = jax.tree.map(lambda p: jnp.full_like(p, NAN), nnx.state(model, nnx.Param))
    for _ in range(2):
        optimizer.update(model, nan_grads)
    assert int(stalled_steps(optimizer.opt_state)) == 2
    with pytest.warns(LossScaleStalledWarning):
        assert check_stall(optimizer.opt_state) is True


PMAP_STALL = r"""
import warnings, numpy as np, jax, jax.numpy as jnp, optax
from lossscale.jax import check_stall, loss_scale_optimizer, stalled_steps
n = jax.device_count()
opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=2, axis_name="i",
                           on_stall="raise")
params = jnp.zeros((n, 3))
state = jax.pmap(opt.init)(params)
g = np.ones((n, 3), np.float32)
g[1, 0] = np.nan  # one replica overflows: all skip, all count
step = jax.pmap(lambda g, s, p: opt.update(g, s, p)[1], axis_name="i")
state = step(jnp.asarray(g), state, params)
print("counts", np.asarray(stalled_steps(state)).tolist(), check_stall(state))
state = step(jnp.asarray(g), state, params)
try:
    check_stall(state)
except Exception as e:
    print(type(e).__name__)
"""


def test_check_stall_on_a_pmap_state() -> None:
    from lossscale._testing import run_on_host_devices

    words = run_on_host_devices(PMAP_STALL, devices=2)
    assert words == ["counts", "[1,", "1]", "False", "LossScaleStalledError"], words


def test_the_warning_points_at_the_line_that_called_check_stall() -> None:
    opt = loss_scale_optimizer(optax.sgd(0.1), initial_scale=1.0, stall_steps=1)
    params = jnp.ones(1)
    _, state = opt.update(jnp.array([NAN]), opt.init(params), params)
    with pytest.warns(LossScaleStalledWarning) as caught:
        check_stall(state)
    assert caught[0].filename == __file__


def test_factors_match_flax_dynamic_scale() -> None:
    # flax's DynamicScale side by side: growth_factor 4, backoff_factor 0.5 (not 1/4),
    # growth_interval 3 (grows on the 4th finite step), minimum_scale 1; random overflows.
    dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
    ds = dynamic_scale.DynamicScale(
        growth_factor=4.0, backoff_factor=0.5, growth_interval=3, scale=2.0**10, minimum_scale=1.0
    )
    opt = loss_scale_optimizer(
        optax.sgd(0.1),
        initial_scale=2.0**10,
        dynamic_growth_steps=3 + 1,
        multiplier=4.0,
        backoff_factor=0.5,
    )
    finite = np.random.default_rng(2).random(300) > 0.3
    w = jnp.ones(3)

    def body(carry: Any, ok: Any) -> tuple[Any, Any]:
        ds, state = carry
        c = jnp.where(ok, jnp.array([1.0, 2.0, 3.0]), jnp.array([1.0, INF, 3.0]))
        ds, flax_finite, _, _ = ds.value_and_grad(lambda w: jnp.sum(w * c))(w)
        _, state = opt.update(c * current_scale(state), state, w)
        return (ds, state), (ds.scale, current_scale(state), flax_finite, last_step_applied(state))

    _, (flax_scales, scales, flax_ok, ok) = jax.jit(lambda c, f: lax.scan(body, c, f))(
        (ds, opt.init(w)), finite
    )
    np.testing.assert_array_equal(np.asarray(flax_ok), finite)
    np.testing.assert_array_equal(np.asarray(ok), finite)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(flax_scales))
    assert len(set(np.asarray(scales).tolist())) > 3  # it grew and backed off
