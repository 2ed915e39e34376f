""":func:`lossscale.jax.loss_scale_optimizer` with flax (``TrainState`` and ``nnx``) and orbax.

Tested examples of the integrations, and what they do on a skipped step:

* ``flax.training.train_state.TrainState(tx=loss_scale_optimizer(...))``:
  ``state.apply_gradients(grads=scaled_grads)`` works unchanged (it calls
  ``tx.update(grads, opt_state, params)``). A skipped step leaves ``params`` and the inner
  optimizer state bit-identical, but **``TrainState.step`` still counts it** (TrainState adds 1
  on every ``apply_gradients``); the inner state's own count (e.g. Adam's ``count``, which
  drives optax schedules) does not move. Applied updates = ``step - skipped_steps(opt_state)``.
* ``nnx.Optimizer(model, loss_scale_optimizer(...), wrt=nnx.Param)``: ``optimizer.update(model,
  scaled_grads)`` inside ``nnx.jit``; ``optimizer.step`` also counts skipped steps. nnx wraps
  the state's arrays in ``OptArray`` variables: read them through ``nnx.as_pure(opt_state)``
  (or ``[...]``) outside ``jit``; the read helpers (``current_scale`` ...) unwrap them.
* orbax: a ``TrainState`` (params + ``LossScaleState``) saved mid-run and restored into an
  abstract target resumes bit for bit. The loss-scale *config* (``min_loss_scale``,
  ``hysteresis``, ...) is static pytree data, not saved in the checkpoint: it comes back from
  the restore target (restored without a target, a ``DynamicLossScale`` is a plain dict of its
  three leaves). To make a checkpoint self-describing, save ``ls.rule._asdict()`` as orbax
  ``custom_metadata`` (tested below).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402
from flax import linen, nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

from lossscale._testing import bits  # noqa: E402
from lossscale.core import DynamicState, dynamic_rule  # noqa: E402
from lossscale.jax import (  # noqa: E402
    DynamicLossScale,
    FixedLossScale,
    LossScaleState,
    current_scale,
    last_step_applied,
    loss_scale_optimizer,
    scale_loss,
    skipped_steps,
)

N_IN, N_HIDDEN, N_OUT, BATCH = 4, 16, 2, 32
INIT = jax.nn.initializers.normal(0.5)  # not truncated_normal: much faster to compile on CPU

#: Non-default settings, so that a checkpoint that lost one of them would show.
LS_CONFIG = {
    "initial_scale": 4.0,
    "dynamic_growth_steps": 3,
    "min_loss_scale": 0.5,
    "hysteresis": 2,
}
#: The same rule, for the functional DynamicLossScale.
LS_RULE = dynamic_rule(3, min_loss_scale=0.5, hysteresis=2)
#: One transformation for every test: TrainState and nnx.Optimizer hold it as static data, so
#: sharing it lets the jitted steps compile once.
TX = loss_scale_optimizer(optax.adam(1e-2), **LS_CONFIG)
# With LS_CONFIG (scale 4, growth after 3 finite steps, back-off on the 2nd overflow, floor 0.5):
# overflows that back the scale off to the floor and hold it there, growth, and a save point
# (after step SAVE_AFTER - 1) where scale is 1 and both counters are nonzero (good 1,
# non-finite 1).
POISONS = [True, True, True, True, True, True, False, False, False, True, False]
POISONS += [True, False, False, True, True, True, True, False, False, False]
SAVE_AFTER = 11


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, N_IN), dtype=np.float32)
    y = np.tanh(x @ rng.standard_normal((N_IN, N_OUT), dtype=np.float32))
    return x, y


def loss_state(opt_state: Any) -> tuple[float, int, int, int, bool]:
    """The loss-scale part of an optimizer state: scale, good/non-finite counters, skipped
    steps and whether the last update was applied."""
    state: LossScaleState = opt_state
    ls = state.loss_scale
    assert isinstance(ls, DynamicLossScale)
    return (
        float(ls.loss_scale),
        int(ls.good_steps),
        int(ls.nonfinite_steps),
        int(state.skipped_steps),
        bool(state.last_step_applied),
    )


# -- flax.training.train_state.TrainState (linen) --------------------------------------------


class LinenMLP(linen.Module):
    """float16 compute, float32 parameters."""

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = linen.tanh(linen.Dense(N_HIDDEN, dtype=jnp.float16, kernel_init=INIT)(x))
        return linen.Dense(N_OUT, dtype=jnp.float16, kernel_init=INIT)(x)


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


LINEN = LinenMLP()


def make_train_state() -> train_state.TrainState:
    params = LINEN.init(jax.random.key(0), jnp.zeros((1, N_IN)))["params"]
    return train_state.TrainState.create(apply_fn=LINEN.apply, params=params, tx=TX)


@jax.jit
def train_state_step(
    state: train_state.TrainState, x: jax.Array, y: jax.Array, poison: jax.Array
) -> train_state.TrainState:
    """One TrainState step on the scaled loss; ``poison`` turns it into inf (an overflow)."""

    def scaled_loss(params: Any) -> jax.Array:
        loss = mse(state.apply_fn({"params": params}, x), y)
        return jnp.where(poison, jnp.inf, 1.0) * scale_loss(loss, state.opt_state)

    scaled_grads = jax.grad(scaled_loss)(state.params)
    return state.apply_gradients(grads=scaled_grads)  # tx unscales, checks, applies or skips


def test_train_state_skipped_step_leaves_params_and_inner_state_but_counts_step() -> None:
    x, y = data()
    state = train_state_step(make_train_state(), x, y, False)
    assert loss_state(state.opt_state) == (4.0, 1, 0, 0, True)

    first = train_state_step(state, x, y, True)
    assert loss_state(first.opt_state) == (4.0, 0, 1, 1, False)  # skipped; hysteresis 2
    second = train_state_step(first, x, y, True)
    assert loss_state(second.opt_state) == (2.0, 0, 0, 2, False)  # skipped, backed off
    for skipped in (first, second):
        assert bits(skipped.params) == bits(state.params)
        assert bits(skipped.opt_state.inner_state) == bits(state.opt_state.inner_state)
    # TrainState counts every apply_gradients call, the skipped ones too; Adam's own count
    # (what optax schedules read) does not move. Applied updates = step - skipped_steps.
    assert int(second.step) == 3
    assert int(second.opt_state.inner_state[0].count) == 1
    assert int(second.step) - int(skipped_steps(second.opt_state)) == 1

    resumed = train_state_step(second, x, y, False)
    assert loss_state(resumed.opt_state) == (2.0, 1, 0, 2, True)
    assert bits(resumed.params) != bits(second.params)
    assert int(resumed.opt_state.inner_state[0].count) == 2


def assert_close(a: Any, b: Any) -> None:
    """Same structure and dtypes, values within a few float32 ulps."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)


def test_train_state_matches_a_hand_written_loop() -> None:
    """TrainState + loss_scale_optimizer follows the functional DynamicLossScale and optax.adam
    by hand (unscale, check, update, select) through skips, back-offs and growth: the same
    decisions and scales exactly, the same parameters and moments up to float32 rounding (the
    two programs are different XLA programs, fused differently: 1-ulp differences)."""
    x, y = data()
    state = make_train_state()
    initial_loss = mse(state.apply_fn({"params": state.params}, x), y)
    adam = optax.adam(1e-2)

    @jax.jit
    def reference_step(
        params: Any, inner: Any, ls: DynamicLossScale, poison: jax.Array
    ) -> tuple[Any, Any, DynamicLossScale]:
        def scaled_loss(params: Any) -> jax.Array:
            loss = mse(state.apply_fn({"params": params}, x), y)
            return jnp.where(poison, jnp.inf, 1.0) * ls.scale(loss)

        grads = ls.unscale(jax.grad(scaled_loss)(params))
        new_ls, finite = ls.update(grads)
        updates, new_inner = adam.update(grads, inner, params)
        new_params = optax.apply_updates(params, updates)

        def keep(new: Any, old: Any) -> Any:  # the update if finite, else the old values
            return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)

        return keep(new_params, params), keep(new_inner, inner), new_ls

    ls = DynamicLossScale(4.0, 3, min_loss_scale=0.5, hysteresis=2)
    params, inner = state.params, adam.init(state.params)
    for step, poison in enumerate(POISONS):
        state = train_state_step(state, x, y, poison)
        params, inner, ls = reference_step(params, inner, ls, poison)
        assert bits(state.opt_state.loss_scale) == bits(ls), step
        assert bool(last_step_applied(state.opt_state)) == (not poison), step
        assert_close(state.params, params)
        assert_close(state.opt_state.inner_state[0], inner[0])
    assert int(skipped_steps(state.opt_state)) == sum(POISONS)
    assert int(state.step) == len(POISONS)
    assert float(current_scale(state.opt_state)) == 1.0  # 4, 2, 1, 0.5 (floor), 1, 0.5, 1
    assert mse(state.apply_fn({"params": state.params}, x), y) < initial_loss


# -- flax nnx --------------------------------------------------------------------------------


class NnxMLP(nnx.Module):
    """float16 compute, float32 parameters."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(N_IN, N_HIDDEN, dtype=jnp.float16, kernel_init=INIT, rngs=rngs)
        self.out = nnx.Linear(N_HIDDEN, N_OUT, dtype=jnp.float16, kernel_init=INIT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


@nnx.jit
def nnx_step(
    model: NnxMLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array, poison: jax.Array
) -> jax.Array:
    """One nnx step on the scaled loss; returns the unscaled loss."""

    def scaled_loss(model: NnxMLP) -> tuple[jax.Array, jax.Array]:
        loss = mse(model(x), y)
        scaled = scale_loss(loss, optimizer.opt_state)  # reads the scale inside the trace
        return jnp.where(poison, jnp.inf, 1.0) * scaled, loss

    (_, loss), scaled_grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
    optimizer.update(model, scaled_grads)
    return loss


def nnx_params(model: nnx.Module) -> Any:
    return nnx.as_pure(nnx.state(model, nnx.Param))


def test_nnx_optimizer_skips_backs_off_and_grows() -> None:
    x, y = data()
    model = NnxMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    assert isinstance(nnx.as_pure(optimizer.opt_state), LossScaleState)

    def read() -> tuple[float, int, int, int, bool]:
        return loss_state(nnx.as_pure(optimizer.opt_state))  # plain arrays outside jit

    first_loss = float(nnx_step(model, optimizer, x, y, False))
    for _ in range(2):
        nnx_step(model, optimizer, x, y, False)
    assert read() == (8.0, 0, 0, 0, True)  # grew after 3 finite steps

    params = jax.tree.map(np.array, nnx_params(model))
    inner = jax.tree.map(np.array, nnx.as_pure(optimizer.opt_state).inner_state)
    nnx_step(model, optimizer, x, y, True)
    assert read() == (8.0, 0, 1, 1, False)  # skipped; hysteresis 2
    nnx_step(model, optimizer, x, y, True)
    assert read() == (4.0, 0, 0, 2, False)  # skipped, backed off
    assert bits(nnx_params(model)) == bits(params)
    assert bits(nnx.as_pure(optimizer.opt_state).inner_state) == bits(inner)
    assert int(nnx.as_pure(optimizer.opt_state).inner_state[0].count) == 3
    assert int(optimizer.step[...]) == 5  # nnx.Optimizer counts the skipped steps too

    for _ in range(3):
        loss = float(nnx_step(model, optimizer, x, y, False))
    assert read() == (8.0, 0, 0, 2, True)  # grew again
    assert bits(nnx_params(model)) != bits(params)
    assert loss < first_loss
    # the helpers also take nnx's wrapped state, and return plain arrays from it
    scale = current_scale(optimizer.opt_state)
    assert isinstance(scale, jax.Array) and float(scale) == 8.0
    assert bool(last_step_applied(optimizer.opt_state)) is True
    assert int(skipped_steps(optimizer.opt_state)) == 2


# -- orbax -----------------------------------------------------------------------------------


def abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def test_orbax_train_state_resume_is_bit_exact(tmp_path: Any) -> None:
    x, y = data()
    state = make_train_state()
    uninterrupted = []
    for poison in POISONS:
        state = train_state_step(state, x, y, poison)
        uninterrupted.append(state)
    saved = uninterrupted[SAVE_AFTER - 1]
    assert loss_state(saved.opt_state)[1:3] == (1, 1)  # mid-run: both counters nonzero
    assert float(current_scale(saved.opt_state)) == 1.0
    assert min(float(current_scale(s.opt_state)) for s in uninterrupted) == 0.5  # the floor

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", saved)
        checkpointer.wait_until_finished()
        # a fresh state's shapes, dtypes and config (eval_shape: step is an int32 array there,
        # as in the saved state, where TrainState.create's Python int 0 would be int64)
        target = jax.eval_shape(make_train_state)
        restored = checkpointer.restore(tmp_path / "state", target)

    assert isinstance(restored, train_state.TrainState)
    assert isinstance(restored.opt_state, LossScaleState)
    assert restored.opt_state.loss_scale.rule == saved.opt_state.loss_scale.rule == LS_RULE
    assert restored.opt_state.loss_scale.min_loss_scale == 0.5
    assert restored.opt_state.loss_scale.hysteresis == 2
    assert bits(restored) == bits(saved)
    state = restored
    for step in range(SAVE_AFTER, len(POISONS)):
        state = train_state_step(state, x, y, POISONS[step])
        assert bits(state) == bits(uninterrupted[step]), step
    assert int(skipped_steps(state.opt_state)) == sum(POISONS)
    assert float(current_scale(state.opt_state)) == 1.0


@jax.jit
def update(ls: DynamicLossScale, grad: jax.Array) -> DynamicLossScale:
    return ls.update(grad)[0]


def advance(ls: DynamicLossScale, poisons: list[bool]) -> DynamicLossScale:
    """``ls`` after one update per entry: an inf gradient where True, a finite one else."""
    for poison in poisons:
        ls = update(ls, np.float32(np.inf if poison else 1.0))
    return ls


def test_orbax_dynamic_loss_scale_round_trip_keeps_state_and_config(tmp_path: Any) -> None:
    kwargs = {"min_loss_scale": 0.5, "max_loss_scale": 64.0, "hysteresis": 2}
    ls = advance(DynamicLossScale(4.0, 3, 4.0, **kwargs), POISONS[:SAVE_AFTER])
    # multiplier 4: 4 -> 1 -> 0.5 (floor) -> 0.5 -> grown to 2; then good 1, non-finite 1
    assert (float(ls.loss_scale), int(ls.good_steps), int(ls.nonfinite_steps)) == (2.0, 1, 1)
    fixed = FixedLossScale(128)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(
            tmp_path / "ls",
            {"dynamic": ls, "fixed": fixed},
            custom_metadata={"loss_scale_rule": ls.rule._asdict()},
        )
        checkpointer.wait_until_finished()
        fresh = {"dynamic": DynamicLossScale(4.0, 3, 4.0, **kwargs), "fixed": FixedLossScale(1)}
        restored = checkpointer.restore(tmp_path / "ls", abstract(fresh))
        raw = checkpointer.restore(tmp_path / "ls")
        metadata = checkpointer.metadata(tmp_path / "ls").custom_metadata

    # into a target: the values, with the target's config (the checkpoint holds no config)
    assert isinstance(restored["dynamic"], DynamicLossScale)
    assert restored["dynamic"].rule == ls.rule
    assert (restored["dynamic"].multiplier, restored["dynamic"].max_loss_scale) == (4.0, 64.0)
    assert bits(restored) == bits({"dynamic": ls, "fixed": fixed})
    rest = POISONS[SAVE_AFTER:]
    assert bits(advance(restored["dynamic"], rest)) == bits(advance(ls, rest))
    assert float(restored["fixed"].loss_scale) == 128.0

    # without a target: plain dicts of the leaves; the config from custom_metadata
    assert set(raw["dynamic"]) == {"loss_scale", "good_steps", "nonfinite_steps"}
    rule = dynamic_rule(**metadata["loss_scale_rule"])
    rebuilt = DynamicLossScale.from_state(DynamicState(**raw["dynamic"]), rule)
    assert rebuilt.rule == ls.rule
    assert bits(rebuilt) == bits(ls)
    assert bits(advance(rebuilt, rest)) == bits(advance(ls, rest))


def test_orbax_nnx_resume_is_bit_exact(tmp_path: Any) -> None:
    x, y = data()

    def build() -> tuple[NnxMLP, nnx.Optimizer]:
        model = NnxMLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, TX, wrt=nnx.Param)

    model, optimizer = build()
    trajectory = []
    for step, poison in enumerate(POISONS):
        nnx_step(model, optimizer, x, y, poison)
        trajectory.append(bits(nnx.as_pure(nnx.state((model, optimizer)))))
        if step == SAVE_AFTER - 1:
            saved = nnx.as_pure(nnx.state((model, optimizer)))
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(tmp_path / "nnx", saved)
                checkpointer.wait_until_finished()

    model2, optimizer2 = build()
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(
            tmp_path / "nnx", abstract(nnx.as_pure(nnx.state((model2, optimizer2))))
        )
    nnx.update((model2, optimizer2), restored)
    assert bits(nnx.as_pure(nnx.state((model2, optimizer2)))) == trajectory[SAVE_AFTER - 1]
    # the config lives in the optimizer object (the tx), not in the state
    assert nnx.as_pure(optimizer2.opt_state).loss_scale.rule == LS_RULE
    for step in range(SAVE_AFTER, len(POISONS)):
        nnx_step(model2, optimizer2, x, y, POISONS[step])
        assert bits(nnx.as_pure(nnx.state((model2, optimizer2)))) == trajectory[step], step
