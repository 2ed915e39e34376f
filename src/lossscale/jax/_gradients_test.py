"""Tests of the finite check and the scale/unscale helpers (:mod:`lossscale.jax._gradients`).

The CPU check sums rows of ``g - g`` instead of reducing ``isfinite(g)`` element by element;
these tests hold it to the element-wise answer (NumPy's), position by position, dtype by dtype,
and check that the compiled CPU program really takes the row-sum path.
"""

from __future__ import annotations

import doctest
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lossscale._testing import run_on_host_devices
from lossscale.jax import _gradients, all_finite, loss_scale_optimizer
from lossscale.jax._gradients import (
    MIN_ROW,
    ROW,
    SUMMED,
    _finite_by_element,
    _finite_by_rows,
    _row_length,
    unscaled_all_finite,
)

F32_MAX = float(np.finfo(np.float32).max)
SHAPES = [(), (1,), (3,), (1024,), (1025,), (2048,), (7, 5, 3), (256, 320), (64, 288)]
SHAPES += [(257, 321), (100_003,), (3, 40_009), (40_009, 3), (0,), (4, 0)]
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64]
checks = {
    "all_finite (jit)": jax.jit(all_finite),
    "rows (jit)": jax.jit(_finite_by_rows),
    "elements (jit)": jax.jit(_finite_by_element),
    "all_finite (eager)": all_finite,
}


def test_doctests() -> None:
    assert doctest.testmod(_gradients).failed == 0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_row_length_divides_the_leaf_and_is_long_enough(shape: tuple[int, ...]) -> None:
    size = int(np.prod(shape))
    row = _row_length(shape, size)
    if size == 0:
        return
    assert size % row == 0
    assert row == size or row >= MIN_ROW  # the whole leaf, a power of two or trailing axes
    assert row <= ROW or row == size or size & -size < MIN_ROW
    # a reshape to (-1, row) must be free: row is a product of trailing axes or divides one
    np.empty(shape).reshape(-1, row)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_one_non_finite_element_anywhere_is_found(
    shape: tuple[int, ...], dtype: Any, value: float
) -> None:
    size = int(np.prod(shape))
    rng = np.random.default_rng(size)
    clean = rng.standard_normal(size).astype(np.float32)
    leaves = [jnp.asarray(clean.reshape(shape), dtype), jnp.ones(5, jnp.float32)]
    for name, check in checks.items():
        assert bool(check(leaves)), (name, "clean")
    if size == 0:
        return
    positions = {0, size - 1, int(rng.integers(size)), min(size - 1, ROW), min(size - 1, ROW - 1)}
    for pos in positions:
        bad = clean.copy()
        bad[pos] = value
        leaf = jnp.asarray(bad.reshape(shape), dtype)
        if dtype == jnp.complex64 and pos % 2:  # also a non-finite imaginary part
            leaf = jnp.asarray(clean.reshape(shape), dtype).reshape(-1).at[pos].set(1j * value)
            leaf = leaf.reshape(shape)
        for name, check in checks.items():
            assert not bool(check([leaves[1], leaf])), (name, pos)


def same_size_leaves(size: int) -> list[jax.Array]:
    """Leaves of one size in several shapes and dtypes, more of them than one kernel sums; the
    values are huge (a sum of the values themselves would overflow; of ``g - g`` cannot)."""
    shapes = [(size,), (2, size // 2), (size // 64, 64)]
    dtypes = [jnp.float32] * (2 * SUMMED + 3) + [jnp.float16] * 3 + [jnp.bfloat16] * 2
    rng = np.random.default_rng(size)
    leaves = []
    for i, dtype in enumerate(dtypes):
        big = float(jnp.finfo(dtype).max) / 2
        values = rng.choice([big, -big, 1.0], size).reshape(shapes[i % len(shapes)])
        leaves.append(jnp.asarray(values, dtype))
    return leaves


def test_a_non_finite_element_in_any_leaf_of_a_same_size_group_is_found() -> None:
    """Leaves of one size are summed element-wise before the row sums: a NaN or inf in any one
    of them, at any position, still makes the check False; the clean group is True."""
    size = 4096
    leaves = same_size_leaves(size)
    for name, check in checks.items():
        assert bool(check(leaves)), (name, "clean")
    values = [np.nan, np.inf, -np.inf]
    for i in range(len(leaves)):
        pos = (i * 997) % size
        bad = list(leaves)
        flat = bad[i].reshape(-1).at[pos].set(values[i % 3])
        bad[i] = flat.reshape(leaves[i].shape)
        for name, check in checks.items():
            assert not bool(check(bad)), (name, i, pos)
    # +inf in one leaf and -inf in another at the same position: NaN, not a cancellation
    bad = list(leaves)
    bad[0] = bad[0].reshape(-1).at[5].set(np.inf).reshape(leaves[0].shape)
    bad[1] = bad[1].reshape(-1).at[5].set(-np.inf).reshape(leaves[1].shape)
    for name, check in checks.items():
        assert not bool(check(bad)), (name, "inf and -inf")


def reduce_sums(leaves: list[jax.Array]) -> int:
    """How many row-sum reductions the CPU check traces for ``leaves``."""
    jaxpr = jax.make_jaxpr(_finite_by_rows)(leaves)
    return sum(eqn.primitive.name == "reduce_sum" for eqn in jaxpr.eqns)


def test_same_size_leaves_share_a_row_sum_kernel() -> None:
    """One reduction per SUMMED leaves of one size, row length and dtype; one per leaf when
    the sizes differ (nothing to sum element-wise)."""
    leaves = same_size_leaves(4096)  # 2*SUMMED+3 float32, 3 float16, 2 bfloat16
    assert reduce_sums(leaves) == 3 + 1 + 1
    assert reduce_sums([jnp.ones((256, 320))] * 100 + [jnp.ones((64, 288))] * 100) == 13 + 13
    assert reduce_sums([jnp.ones(1024 + i) for i in range(10)]) == 10


def test_every_position_of_a_leaf_is_covered() -> None:
    """vmap over 3000 copies of a (3000,) leaf, copy i with inf at position i."""
    n = 3000
    batch = jnp.where(jnp.eye(n, dtype=bool), jnp.inf, 1.0).astype(jnp.float32)
    flags = jax.jit(jax.vmap(lambda g: all_finite([g])))(batch)
    assert not np.asarray(flags).any()
    assert bool(all_finite([jnp.ones(n)]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_huge_finite_values_are_finite_row_sums_cannot_overflow(dtype: Any) -> None:
    """1024 copies of the largest finite value: a plain row sum would be inf."""
    big = float(jnp.finfo(dtype).max)
    leaves = [jnp.full((4, ROW), big, dtype), jnp.full((ROW,), -big, dtype)]
    for name, check in checks.items():
        assert bool(check(leaves)), name


def test_empty_trees_and_non_float_leaves() -> None:
    assert bool(all_finite([]))
    assert bool(all_finite({"i": jnp.arange(3), "b": jnp.array([True]), "e": jnp.zeros(0)}))
    assert bool(all_finite([1.0, 2])) and not bool(all_finite([float("nan")]))


def test_the_cpu_program_sums_rows_and_writes_no_mask() -> None:
    """The compiled CPU check reads each leaf once into row sums: no boolean array the size of
    a leaf (the per-element check's mask) appears in the optimized program."""
    leaves = [jnp.ones((256, 320)), jnp.ones((64, 288), jnp.float16)]
    text = jax.jit(all_finite).lower(leaves).compile().as_text() or ""
    assert not re.search(r"pred\[(256,320|64,288)\]", text)
    assert "reduce" in text
    element = jax.jit(_finite_by_element).lower(leaves).compile().as_text() or ""
    assert re.search(r"pred\[(256,320|64,288)\]", element)  # the control: the mask is there


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscaled_all_finite_is_the_check_of_the_unscaled_grads(dtype: Any) -> None:
    big = float(jnp.finfo(dtype).max)
    cases = [
        ([1.0, 2.0], 2.0**15),
        ([1.0, np.inf], 2.0**15),
        ([big, -big], 1.0),
        ([big / 3, 1.0], 0.5),  # unscaled 2/3 of the max: finite
        ([big, 1.0], 0.5),  # unscaled: twice the max, inf
        ([np.nan, 1.0], 0.5),
    ]
    for values, scale in cases:
        grads = {"w": jnp.asarray(values, dtype)}
        unscaled = _gradients.unscale_tree(grads, jnp.float32(scale))
        expected = bool(np.isfinite(np.asarray(unscaled["w"], np.float32)).all())
        got = jax.jit(unscaled_all_finite, static_argnames="scale_at_least_one")(
            grads, jnp.float32(scale), scale_at_least_one=False
        )
        assert bool(got) == expected, (values, scale)
        if scale >= 1:  # reading the scaled grads gives the same answer
            got = unscaled_all_finite(grads, jnp.float32(scale), scale_at_least_one=True)
            assert bool(got) == expected, (values, scale)


def test_a_scale_below_one_where_none_was_expected_skips() -> None:
    """A caller promised scale >= 1 but the state says 0.5: skip (never an unchecked step)."""
    grads = [jnp.ones(3)]
    assert not bool(unscaled_all_finite(grads, jnp.float32(0.5), scale_at_least_one=True))
    assert bool(unscaled_all_finite(grads, jnp.float32(0.5), scale_at_least_one=False))


@pytest.mark.parametrize(
    ("initial_scale", "min_loss_scale"), [(0.5, 1.0), (2.0, 0.25)], ids=["initial", "min"]
)
def test_optimizer_with_scales_below_one_checks_the_unscaled_grads(
    initial_scale: float, min_loss_scale: float
) -> None:
    """TensorFlow semantics below 1: a scaled gradient that is finite but overflows when
    unscaled is skipped; a finite unscaled one is applied (no spurious skip)."""
    opt = loss_scale_optimizer(
        optax.sgd(1.0), initial_scale=initial_scale, min_loss_scale=min_loss_scale
    )
    params = jnp.zeros(2)
    state = opt.init(params)
    update = jax.jit(opt.update)
    scale = float(state.loss_scale.loss_scale)
    while scale >= 1:  # back off until the scale is below 1 (min case)
        _, state = update(jnp.array([np.nan, 0.0]), state, params)
        scale = float(state.loss_scale.loss_scale)
    finite_grads = jnp.array([F32_MAX * scale / 2, 1.0], jnp.float32)  # unscaled: finite
    updates, new = update(finite_grads, state, params)
    assert bool(new.last_step_applied) and np.isfinite(np.asarray(updates)).all()
    overflowing = jnp.array([F32_MAX, 1.0], jnp.float32)  # unscaled: F32_MAX / scale = inf
    updates, new = update(overflowing, state, params)
    assert not bool(new.last_step_applied)
    np.testing.assert_array_equal(np.asarray(updates), 0.0)


SHARDED = """
import re, numpy as np, jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
from lossscale.jax import all_finite, loss_scale_optimizer

def collectives(text):
    kinds = ("all-gather", "all-to-all")
    return {k: len(re.findall(" " + k + r"(-start)?\\(", text)) for k in kinds}

for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(kind,))
    for spec in (P(None, "d"), P("d", None)):
        put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
        leaves = [put(jnp.ones((256, 320))), put(jnp.ones((64, 288), jnp.bfloat16))]
        check = jax.jit(all_finite)
        assert bool(check(leaves)) and bool(all_finite(leaves))
        for pos in [(0, 0), (5, 7), (63, 287), (8, 36)]:
            bad = [leaves[0], put(jnp.ones((64, 288), jnp.bfloat16).at[pos].set(jnp.nan))]
            assert not bool(check(bad)), (kind, spec, pos)
        # no gradient data moves between devices: one scalar all-reduce, no gathers
        text = check.lower(leaves).compile().as_text()
        assert collectives(text) == {"all-gather": 0, "all-to-all": 0}
        # the optimizer on sharded params and grads, explicit sharding included
        opt = loss_scale_optimizer(optax.sgd(0.5), initial_scale=4.0)
        params = put(jnp.ones((64, 288)))
        state = opt.init(params)
        grads = put(jnp.full((64, 288), 8.0))
        updates, state = jax.jit(opt.update)(grads, state, params)
        assert bool(state.last_step_applied) and np.allclose(np.asarray(updates), -1.0)
        updates, state = jax.jit(opt.update)(put(jnp.full((64, 288), jnp.inf)), state, params)
        assert not bool(state.last_step_applied) and float(state.loss_scale.loss_scale) == 2.0
    print(kind.name, "ok")

# inside shard_map the per-device values are not split: they take the row-sum path
mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
f = jax.shard_map(lambda x: all_finite([x])[None], mesh=mesh, in_specs=P("d"), out_specs=P("d"))
x = jax.device_put(jnp.ones((8 * 256, 320)).at[300, 3].set(jnp.inf), NamedSharding(mesh, P("d")))
assert np.asarray(jax.jit(f)(x)).tolist() == [True, False] + [True] * 6
assert not re.search(r"pred\\[256,320\\]", jax.jit(f).lower(x).compile().as_text())
print("shard_map ok")
"""


def test_leaves_split_across_devices_are_checked_in_place() -> None:
    """8 forced host devices: GSPMD (auto) and explicit sharding along either axis. A row
    regrouping would cross shard boundaries (an all-gather, or a ShardingTypeError under
    explicit sharding); split leaves take the per-element check instead."""
    words = run_on_host_devices(SHARDED)
    assert words == ["Auto", "ok", "Explicit", "ok", "shard_map", "ok"]
