"""Tests of the functional JAX loss-scale values (:mod:`lossscale.jax._values`)."""

from __future__ import annotations

import doctest
import pickle
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale
from lossscale.core import FLOAT32_MAX, DynamicRule, DynamicState, dynamic_rule
from lossscale.jax import (
    DynamicLossScale,
    FixedLossScale,
    _grad,
    _state,
    _transform,
    _values,
    all_finite,
)

NAN = float("nan")
INF = float("inf")


def ok_grads() -> dict[str, Any]:
    return {"w": jnp.ones((2, 3)), "b": jnp.zeros(3, jnp.float16), "i": jnp.arange(3)}


def bad_grads(value: float = NAN) -> dict[str, Any]:
    g = ok_grads()
    g["b"] = g["b"].at[1].set(value)
    return g


def snapshot(ls: DynamicLossScale) -> tuple[float, int, int]:
    return float(ls.loss_scale), int(ls.good_steps), int(ls.nonfinite_steps)


def test_doctests() -> None:
    for module in (_values, _state, _transform, _grad):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, module.__name__
        assert result.attempted > 0, module.__name__


# -- construction -------------------------------------------------------------------------------


def test_defaults_are_tensorflow_and_state_dtypes() -> None:
    ls = DynamicLossScale()
    assert ls.rule == DynamicRule(2000, 2.0, 1.0, FLOAT32_MAX, 1)
    assert snapshot(ls) == (32768.0, 0, 0)
    assert ls.loss_scale.dtype == jnp.float32
    assert jnp.issubdtype(ls.good_steps.dtype, jnp.integer)
    assert ls.loss_scale.shape == ()
    assert float(ls()) == 32768.0


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"initial_loss_scale": "1"}, TypeError),
        ({"initial_loss_scale": 0}, ValueError),
        ({"initial_loss_scale": INF}, ValueError),
        ({"increment_period": 0}, ValueError),
        ({"increment_period": 2.5}, TypeError),
        ({"multiplier": 1.0}, ValueError),
        ({"min_loss_scale": 0}, ValueError),
        ({"min_loss_scale": 8, "max_loss_scale": 4, "initial_loss_scale": 4}, ValueError),
        ({"hysteresis": 0}, ValueError),
        ({"initial_loss_scale": 1e39}, ValueError),
    ],
)
def test_validation_matches_the_stateful_class(kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error) as ours:
        DynamicLossScale(**kwargs)
    with pytest.raises(error) as theirs:
        lossscale.DynamicLossScale(**kwargs)
    assert str(ours.value) == str(theirs.value)


def test_fixed_validation_matches_the_stateful_class() -> None:
    for bad in (0.5, NAN, INF, 1e39):
        with pytest.raises(ValueError):
            FixedLossScale(bad)
    with pytest.raises(TypeError):
        FixedLossScale(True)
    ls = FixedLossScale(1024)
    assert ls.loss_scale.dtype == jnp.float32 and float(ls()) == 1024.0


def test_concrete_0d_arrays_are_numbers_as_in_jmp() -> None:
    ls = DynamicLossScale(jnp.asarray(2.0**15))  # how jmp users write it
    assert float(ls()) == 2.0**15 and ls.rule == DynamicLossScale().rule
    assert float(FixedLossScale(jnp.asarray(128, jnp.int32))()) == 128.0
    with pytest.raises(ValueError, match="initial_loss_scale"):
        DynamicLossScale(jnp.asarray(-1.0))  # and validated like a number
    for bad in (jnp.ones(2), jnp.asarray(True)):
        with pytest.raises(TypeError, match="initial_loss_scale"):
            DynamicLossScale(bad)
    with pytest.raises(TypeError, match="loss_scale_value"):
        FixedLossScale(jnp.ones(2))


def test_a_traced_initial_scale_is_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"outside jax\.jit"):
        jax.jit(lambda s: DynamicLossScale(s).loss_scale)(jnp.asarray(8.0))
    with pytest.raises(TypeError, match=r"outside jax\.jit"):
        jax.jit(lambda s: FixedLossScale(s).loss_scale)(jnp.asarray(8.0))


def test_values_are_immutable() -> None:
    ls = DynamicLossScale()
    with pytest.raises(AttributeError):
        ls._state = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        FixedLossScale(2)._loss_scale = 3  # type: ignore[misc]
    new = ls.adjust(False)
    assert float(ls.loss_scale) == 32768.0 and float(new.loss_scale) == 16384.0


# -- the trajectory ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"increment_period": 3, "multiplier": 4.0},
        {"increment_period": 2, "min_loss_scale": 0.25, "max_loss_scale": 64.0},
        {"increment_period": 2, "hysteresis": 3},
    ],
)
def test_same_trajectory_as_the_stateful_class_eager_and_jit(kwargs: dict[str, Any]) -> None:
    rng = random.Random(0)
    steps = [rng.random() < 0.7 for _ in range(120)]
    initial = 8.0
    ref = lossscale.DynamicLossScale(initial, **kwargs)
    eager = DynamicLossScale(initial, **kwargs)
    jitted = DynamicLossScale(initial, **kwargs)
    step = jax.jit(lambda ls, g: ls.update(g))
    for i, finite in enumerate(steps):
        g = ok_grads() if finite else bad_grads(INF if i % 2 else NAN)
        _, ref_ok = ref.update([np.asarray(g["w"]), np.asarray(g["b"])])
        eager, ok_e = eager.update(g)
        jitted, ok_j = step(jitted, g)
        assert bool(ok_e) == bool(ok_j) == bool(ref_ok) == finite
        expected = (float(ref()), ref.num_good_steps, int(ref.state.nonfinite_steps))
        assert snapshot(eager) == expected
        assert snapshot(jitted) == expected


def test_growth_and_back_off_and_bounds() -> None:
    ls = DynamicLossScale(4.0, increment_period=2, min_loss_scale=2.0, max_loss_scale=16.0)
    seen = []
    for finite in [True, True, True, True, True, True, False, False, False, False]:
        ls = ls.adjust(finite)
        seen.append(float(ls.loss_scale))
    assert seen == [4, 8, 8, 16, 16, 16, 8, 4, 2, 2]


# -- dtypes (jmp#47) ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_stays_float32_whatever_the_compute_dtype(dtype: Any) -> None:
    ls = DynamicLossScale(2.0**10, increment_period=1)
    grads = {"w": jnp.ones(4, dtype)}
    for _ in range(3):
        ls, _ = ls.update(grads)
        assert ls.loss_scale.dtype == jnp.float32
    ls, _ = ls.update({"w": jnp.full(4, jnp.inf, dtype)})
    assert ls.loss_scale.dtype == jnp.float32
    assert float(ls.loss_scale) == 2.0**12


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(jnp.float16, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32)],
)
def test_scale_returns_at_least_float32(dtype: Any, expected: Any) -> None:
    ls = DynamicLossScale(2.0**16)
    out = ls.scale(jnp.asarray(65504.0, dtype) if dtype == jnp.float16 else jnp.ones((), dtype))
    assert out.dtype == expected
    assert bool(jnp.isfinite(out))  # 65504 * 65536 would be inf in float16
    assert FixedLossScale(4).scale(jnp.ones((), dtype)).dtype == expected


def test_unscale_half_grads_in_float32() -> None:
    # 1/3 in float16 is 0.33325195: float16 math gives 0.99975586, float32 math 1.0.
    ls = FixedLossScale(3)
    out = ls.unscale({"h": jnp.asarray([3.0], jnp.float16), "f": jnp.asarray([3.0])})
    assert out["h"].dtype == jnp.float16 and out["f"].dtype == jnp.float32
    assert float(out["h"][0]) == 1.0
    # 2**-25 is 0 in float16: a float16 reciprocal would zero every gradient.
    big = DynamicLossScale(2.0**25)
    for dtype in (jnp.float16, jnp.bfloat16):
        g = big.unscale(jnp.asarray([2.0**10], dtype))
        assert g.dtype == dtype and float(g[0]) == 2.0**-15


def test_unscale_rejects_integer_leaves_and_passes_float0_through() -> None:
    with pytest.raises(TypeError, match=r"\['i'\] has dtype int32"):
        DynamicLossScale(4.0).unscale({"i": jnp.arange(3), "f": jnp.full(2, 8.0)})
    zero = np.zeros((3,), jax.dtypes.float0)
    g = DynamicLossScale(4.0).unscale({"z": zero, "f": jnp.full(2, 8.0), "n": None})
    assert g["z"] is zero and list(g["f"]) == [2.0, 2.0] and g["n"] is None


def test_all_finite() -> None:
    assert bool(all_finite(ok_grads()))
    assert not bool(all_finite(bad_grads()))
    assert not bool(all_finite(bad_grads(-INF)))
    assert bool(all_finite({})) and bool(all_finite([None]))
    assert bool(all_finite({"i": jnp.arange(3), "e": jnp.zeros((0,))}))
    assert all_finite(ok_grads()).dtype == jnp.bool_


def test_fixed_update_never_skips_and_returns_itself() -> None:
    ls = FixedLossScale(8)
    new, ok = ls.update(bad_grads())
    assert new is ls and bool(ok) and ok.dtype == jnp.bool_
    assert ls.adjust(False) is ls


# -- pytree round trips -------------------------------------------------------------------------


def test_every_config_field_survives_flatten_unflatten_jit_and_tree_map() -> None:
    # jmp's tree_unflatten drops min_loss_scale, so under jit the floor is back to 1.
    ls = DynamicLossScale(8.0, 7, 3.0, min_loss_scale=4.0, max_loss_scale=1e6, hysteresis=2)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 3
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.rule == ls.rule
    assert jax.tree_util.tree_map(lambda x: x, ls).rule == ls.rule

    @jax.jit
    def many_bad_steps(ls: DynamicLossScale) -> DynamicLossScale:
        for _ in range(20):
            ls = ls.adjust(False)
        return ls

    out = many_bad_steps(ls)
    assert out.rule == ls.rule
    assert float(out.loss_scale) == 4.0  # the floor survived jit
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert paths == [".loss_scale", ".good_steps", ".nonfinite_steps"]


def test_vmap_over_a_batch_of_loss_scales() -> None:
    base = DynamicLossScale(8.0, increment_period=1)
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, x, x]), base)
    grads = jnp.asarray([[1.0, 2.0], [NAN, 1.0], [1.0, INF]])
    new, ok = jax.vmap(lambda ls, g: ls.update(g))(batch, grads)
    assert new.rule == base.rule
    assert list(np.asarray(ok)) == [True, False, False]
    assert list(np.asarray(new.loss_scale)) == [16.0, 4.0, 4.0]


def test_checkpoint_round_trip_pure_pytree(tmp_path: Any) -> None:
    """The pure-pytree checkpoint: save the leaves, restore into a fresh template."""
    ls = DynamicLossScale(8.0, increment_period=3, min_loss_scale=0.5).adjust(True).adjust(False)
    leaves = jax.tree_util.tree_leaves(ls)
    np.savez(tmp_path / "ckpt.npz", *[np.asarray(x) for x in leaves])
    template = DynamicLossScale(8.0, increment_period=3, min_loss_scale=0.5)
    with np.load(tmp_path / "ckpt.npz") as data:
        restored_leaves = [jnp.asarray(data[f"arr_{i}"]) for i in range(len(leaves))]
    restored = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), restored_leaves)
    assert snapshot(restored) == snapshot(ls) == (4.0, 0, 0)
    assert restored.rule == ls.rule
    assert restored.loss_scale.dtype == jnp.float32
    again = pickle.loads(pickle.dumps(ls))
    assert snapshot(again) == snapshot(ls) and again.rule == ls.rule
    fixed = pickle.loads(pickle.dumps(FixedLossScale(16)))
    assert float(fixed.loss_scale) == 16.0


def test_from_state_accepts_any_leaves() -> None:
    rule = dynamic_rule(5)
    ls = DynamicLossScale.from_state(DynamicState(None, None, None), rule)
    assert ls.rule == rule and ls.state == DynamicState(None, None, None)
    shapes = jax.eval_shape(lambda: DynamicLossScale(4.0, 5))
    assert shapes.loss_scale.shape == () and shapes.rule == rule


# -- no recompiles ------------------------------------------------------------------------------


def test_changing_the_scale_never_retraces_or_recompiles() -> None:
    traces: list[int] = []

    @jax.jit
    def step(ls: Any, g: Any) -> Any:
        traces.append(1)
        return ls.update(g)

    ls: Any = DynamicLossScale(8.0, increment_period=1)
    scales = set()
    for i in range(8):
        ls, _ = step(ls, ok_grads() if i % 3 else bad_grads())
        scales.add(float(ls.loss_scale))
    assert len(scales) > 2 and len(traces) == 1
    for value in (2, 1024, 2.0**20):  # a fixed scale is a leaf too (jmp: static, recompiles)
        step(FixedLossScale(value), ok_grads())
    assert len(traces) == 2
    assert step._cache_size() == 2


def test_repr() -> None:
    text = repr(DynamicLossScale(4.0, min_loss_scale=0.5))
    assert "min_loss_scale=0.5" in text and "loss_scale=" in text
    assert "FixedLossScale" in repr(FixedLossScale(2))


# -- the anchors' bugs ---------------------------------------------------------------------------


def test_scale_never_reaches_zero_or_inf_unlike_keras3() -> None:
    # Keras 3: 200 non-finite steps from 1.0 give 0.0; growing from 2**127 gives inf.
    step = jax.jit(lambda ls, finite: ls.adjust(finite))
    low: Any = DynamicLossScale(1.0)
    tiny: Any = DynamicLossScale(1.0, min_loss_scale=2.0**-10)
    for _ in range(200):
        low, tiny = step(low, False), step(tiny, False)
    assert float(low.loss_scale) == 1.0 and float(tiny.loss_scale) == 2.0**-10
    high: Any = DynamicLossScale(2.0**127, increment_period=1)
    for _ in range(5):
        high = step(high, True)
    assert float(high.loss_scale) == 2.0**127 and bool(jnp.isfinite(high.loss_scale))


def test_import_lossscale_alone_does_not_import_jax() -> None:
    import subprocess
    import sys

    code = (
        "import sys, lossscale; assert 'jax' not in sys.modules and 'optax' not in sys.modules; "
        "import lossscale.jax; assert 'jax' in sys.modules and 'optax' in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
