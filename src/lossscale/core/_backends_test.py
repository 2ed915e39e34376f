"""Tests of the array namespaces: lazy recognition and the operations the rule relies on."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from lossscale.core import namespace_of
from lossscale.core._backends import FLOAT_DTYPES, NUMPY, NUMPY_SCALARS, NumpyNamespace
from lossscale.core._rule import DynamicState, dynamic_rule, dynamic_update
from lossscale.core._stall import stall_update
from lossscale.core._validation import FLOAT32_MAX

with np.errstate(over="ignore"):
    F16_FROM_70000 = np.array([70000], np.float32).astype(np.float16)  # inf


def test_float_dtypes_are_tensorflows_is_finite_set() -> None:
    assert frozenset({"float16", "bfloat16", "float32", "float64"}) == FLOAT_DTYPES


@pytest.mark.parametrize(
    "x", [np.ones(2), np.float32(1), np.float64(1), np.int64(1), np.array(1.0)]
)
def test_numpy_arrays_and_scalars_are_numpy(x: Any) -> None:
    assert namespace_of(x) is NUMPY


@pytest.mark.parametrize("x", [1.0, 1, None, [np.ones(1)], "a", object()])
def test_non_arrays_have_no_namespace(x: Any) -> None:
    assert namespace_of(x) is None


# -- NumPy namespace --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [("float32", 2.5, np.float32), ("int", 3, np.int64), ("bool", True, np.bool_)],
)
def test_numpy_scalar(dtype: str, value: Any, expected: Any) -> None:
    out = NUMPY.scalar(value, dtype, None)
    assert isinstance(out, np.ndarray)
    assert out.shape == ()
    assert out.dtype == expected
    assert out == value


def test_numpy_full_like_takes_the_dtype() -> None:
    out = NUMPY.full_like(np.asarray(1, np.float16), 3)
    assert out.dtype == np.float16
    assert out.shape == ()
    assert float(out) == 3.0


def test_numpy_ops_return_arrays() -> None:
    a, b = np.asarray(np.float32(1)), np.asarray(np.float32(np.nan))
    assert isinstance(NUMPY.where(np.asarray(True), a, b), np.ndarray)
    assert np.isnan(NUMPY.maximum(b, a))  # NaN propagates


@pytest.mark.parametrize(
    ("leaves", "expected"),
    [
        ([], True),
        ([np.zeros(0)], True),
        ([np.ones((2, 3))], True),
        ([np.array([1.0, np.nan])], False),
        ([np.array([np.inf, 1.0])], False),
        ([np.array([-np.inf])], False),
        ([np.array([np.nan, np.inf, -np.inf])], False),
        ([np.ones(4), np.array([[1.0], [np.nan]])], False),
        ([np.array([65504], np.float16)], True),
        ([F16_FROM_70000], False),
        ([np.array([1e300])], True),
        ([np.array([3e38], np.float32)], True),
        ([np.float64(1e300)], True),
        ([np.array(np.nan)], False),
    ],
)
def test_numpy_all_finite(leaves: list[Any], expected: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from the reductions
        out = NUMPY.all_finite([np.asarray(x) for x in leaves], None)
    assert out.dtype == np.bool_
    assert out.shape == ()
    assert bool(out) is expected


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("where", [0, 65535, 65536, 200_000 - 1])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_numpy_all_finite_large_arrays_chunk_by_chunk(dtype: Any, where: int, bad: float) -> None:
    """Arrays longer than one chunk (64Ki elements): a non-finite value at a chunk's first or
    last element, or the array's last, is found; non-contiguous arrays too."""
    flat = np.ones(200_000, dtype)
    assert bool(NUMPY.all_finite([np.ones(3), flat], flat))
    flat[where] = bad
    assert not bool(NUMPY.all_finite([np.ones(3), flat], flat))
    strided = np.ones((400, 1000), dtype)[:, ::2]  # 200k elements, not contiguous
    assert bool(NUMPY.all_finite([strided], strided))
    strided[where // 500, where % 500] = bad
    assert not bool(NUMPY.all_finite([strided], strided))


def test_numpy_all_finite_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "invalid value encountered in reduce"
        assert bool(NUMPY.all_finite([np.array([3e38, -1.0], bf16)], None))
        assert not bool(NUMPY.all_finite([np.array([1.0, np.nan], bf16)], None))
        assert not bool(NUMPY.all_finite([np.array([np.inf], bf16)], None))


def test_numpy_errstate_silences_overflow() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with NUMPY.errstate():
            out = np.float32(3e38) * np.float32(2)
    assert np.isinf(out)


def test_numpy_divide_is_correctly_rounded() -> None:
    out = NUMPY.divide(np.asarray(np.float32(10)), np.asarray(np.float32(3)))
    assert float(out) == 3.3333332538604736


def test_numpy_copy_is_independent() -> None:
    x = np.asarray(np.float32(8))
    y = NUMPY.copy(x)
    y[...] = 1
    assert float(x) == 8.0


def _random_rule(rng: np.random.Generator) -> Any:
    """A rule with TF's or torch's factors, hysteresis, a floor below or above 1, a maximum."""
    kwargs: dict[str, Any] = {
        "increment_period": int(rng.choice([1, 2, 5])),
        "multiplier": float(rng.choice([2.0, 3.0, 1.5, 2**0.5])),
        "hysteresis": int(rng.choice([1, 2, 3])),
        "min_loss_scale": float(rng.choice([1.0, 2.0**-3, 4.0])),
        "max_loss_scale": float(rng.choice([FLOAT32_MAX, 2.0**20])),
    }
    if rng.random() < 0.5:
        kwargs["backoff_factor"] = float(rng.choice([0.5, 0.3, 0.25]))
    return dynamic_rule(**kwargs)


@pytest.mark.parametrize("wide", [False, True], ids=["float32", "float64"])
def test_numpy_scalars_run_the_rule_bit_for_bit_as_arrays(wide: bool) -> None:
    """The rule (and the stall count) on NumPy scalars gives the 0-d array rule's values,
    bit for bit, as scalars: random rules, flags and initial scales, growth to float32's
    maximum (refused) included; ``wide``: the scale held in float64, as torch's host home
    runs rules with inexact factors."""
    rng = np.random.default_rng(0)
    ftype = np.float64 if wide else np.float32
    for _ in range(40):
        rule = _random_rule(rng)
        initial = float(rng.choice([1.0, 2.0**-2, 1000.0, 2.0**126, 3e38]))
        arrays = DynamicState(np.asarray(initial, ftype), np.asarray(0), np.asarray(0))
        scalars = DynamicState(ftype(initial), np.int64(0), np.int64(0))
        count_a, count_s = np.asarray(0), np.int64(0)
        for finite in rng.random(60) < rng.random():
            flag = np.bool_(finite)
            count_a = stall_update(count_a, flag, arrays.loss_scale, rule)
            count_s = stall_update(count_s, flag, scalars.loss_scale, rule, NUMPY_SCALARS)
            arrays = dynamic_update(arrays, flag, rule)
            scalars = dynamic_update(scalars, flag, rule, NUMPY_SCALARS)
            assert type(scalars.loss_scale) is ftype
            assert type(scalars.good_steps) is type(scalars.nonfinite_steps) is np.int64
            assert scalars.loss_scale.tobytes() == arrays.loss_scale.tobytes()
            assert int(scalars.good_steps) == int(arrays.good_steps)
            assert int(scalars.nonfinite_steps) == int(arrays.nonfinite_steps)
            assert type(count_s) is np.int64 and int(count_s) == int(count_a)


def test_numpy_scalars_ops() -> None:
    """Constants take the operand's type; a select of two types promotes as ``np.where``."""
    xs = NUMPY_SCALARS
    assert type(xs.scalar(2, "float32", None)) is np.float32
    assert type(xs.scalar(2, "int", None)) is np.int64
    assert type(xs.full_like(np.float64(1), 3)) is np.float64
    assert xs.full_like(np.float32(1), 0.1) == np.float32(0.1)
    assert xs.where(np.bool_(False), np.float32(1), np.float32(2)) == 2
    mixed = xs.where(np.bool_(True), np.float32(1), np.float64(2))
    assert type(mixed) is np.float64 and mixed == 1
    assert np.isnan(xs.maximum(np.float32(np.nan), np.float32(1)))
    assert xs.owns(np.float32(1)) and not xs.owns(np.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with xs.errstate():
            assert np.isinf(np.float32(3e38) * np.float32(2))


def test_numpy_host_reads() -> None:
    assert NUMPY.to_host_float(np.asarray(np.float32(0.1))) == 0.10000000149011612
    assert NUMPY.to_host_int(np.asarray(7)) == 7
    assert not NUMPY.is_traced(np.ones(1))


def test_namespace_repr() -> None:
    assert repr(NumpyNamespace()) == "<ArrayNamespace numpy>"


# -- torch ------------------------------------------------------------------------------------


def test_torch_namespace() -> None:
    torch = pytest.importorskip("torch")
    ns = namespace_of(torch.ones(1))
    assert ns is not None
    assert ns.name == "torch"
    assert namespace_of(torch.ones(1, dtype=torch.float16)) is ns  # cached
    assert ns.dtype_name(torch.ones(1, dtype=torch.bfloat16)) == "bfloat16"
    assert ns.dtype_name(torch.ones(1, dtype=torch.int32)) == "int32"
    like = torch.zeros(3, dtype=torch.float16)
    s = ns.scalar(2.5, "float32", like)
    assert (s.dtype, s.shape, s.device, s.item()) == (torch.float32, (), like.device, 2.5)
    assert ns.scalar(3, "int", like).dtype == torch.int64
    assert ns.scalar(True, "bool", None).dtype == torch.bool
    copy = ns.copy(s)
    copy.fill_(0)
    assert s.item() == 2.5
    assert ns.to_host_float(s) == 2.5
    assert ns.same_place(s, like)


def test_torch_rule_constants_are_shared_but_never_escape() -> None:
    """The torch namespace caches the rule's 0-d constants; no output of the rule may alias
    one, or an in-place change of a state tensor would corrupt every later update."""
    torch = pytest.importorskip("torch")
    from lossscale.core import dynamic_rule, dynamic_state, dynamic_update, namespace_of

    xp = namespace_of(torch.ones(()))
    one = torch.ones(())
    assert xp.full_like(one, 2.0) is xp.full_like(one, 2.0)
    assert xp.full_like(one, 2.0) is not xp.full_like(one, 3.0)
    assert xp.full_like(one, 2) is not xp.full_like(one, 2.0)  # keyed by type too (2 == 2.0)
    assert xp.full_like(torch.ones((), dtype=torch.float64), 2.0).dtype == torch.float64

    rule = dynamic_rule(increment_period=2, hysteresis=2)
    state = dynamic_state(8.0, rule, xp=xp, like=one)
    for finite in (True, True, False, False, True):
        state = dynamic_update(state, torch.tensor(finite), rule, xp)
        for out in state:
            out.add_(100)  # a caller mutating its state in place
            out.sub_(100)
    reference = dynamic_state(8.0, rule, xp=xp, like=one)
    for finite in (True, True, False, False, True):
        reference = dynamic_update(reference, torch.tensor(finite), rule, xp)
    assert [x.item() for x in state] == [x.item() for x in reference] == [8.0, 1, 0]
    assert xp.full_like(one, 0).item() == 0 and xp.full_like(one, 2.0).item() == 2.0


def test_torch_all_finite() -> None:
    torch = pytest.importorskip("torch")
    ns = namespace_of(torch.ones(1))
    assert ns is not None
    like = torch.zeros(())
    nan = float("nan")
    assert bool(ns.all_finite([], like))
    assert bool(ns.all_finite([torch.zeros(0)], like))
    assert bool(ns.all_finite([torch.tensor([65504.0], dtype=torch.float16)], like))
    assert not bool(ns.all_finite([torch.tensor([70000.0]).to(torch.float16)], like))
    assert not bool(ns.all_finite([torch.ones(2), torch.tensor([1.0, nan])], like))
    assert not bool(ns.all_finite([torch.tensor([-float("inf")], dtype=torch.bfloat16)], like))
    out = ns.all_finite([torch.ones(2), torch.ones(3, dtype=torch.float64)], like)
    assert out.dtype == torch.bool
    assert out.shape == ()
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, nan]), (4,), check_invariants=True
    )
    assert not bool(ns.all_finite([sparse], like))


# -- JAX --------------------------------------------------------------------------------------


def test_jax_namespace() -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    ns = namespace_of(jnp.ones(1))
    assert ns is not None
    assert ns.name == "jax"
    assert ns.dtype_name(jnp.ones(1, jnp.bfloat16)) == "bfloat16"
    s = ns.scalar(2.5, "float32", jnp.ones(2))
    assert isinstance(s, jax.Array)
    assert (s.dtype, s.shape, float(s)) == (jnp.float32, (), 2.5)
    assert ns.scalar(1, "int", None).dtype == jax.dtypes.canonicalize_dtype(jnp.int64)
    assert not ns.is_traced(s)
    assert bool(ns.all_finite([], s))
    assert not bool(ns.all_finite([jnp.ones(2), jnp.array([jnp.nan])], s))
    assert bool(ns.all_finite([jnp.array([65504], jnp.float16)], s))

    seen = []

    @jax.jit
    def f(x: Any) -> Any:
        seen.append(ns.is_traced(x))
        return x

    f(jnp.ones(1))
    assert seen == [True]

    divide = jax.jit(lambda a: ns.divide(a, jnp.full_like(a, 3.0)))
    assert float(divide(jnp.float32(10))) == 3.3333332538604736  # not 3.3333335


def test_namespaces_pickle_and_copy_as_the_shared_instance() -> None:
    import copy
    import pickle

    spaces = [NUMPY, NUMPY_SCALARS]
    for name in ("torch", "jax"):
        module = pytest.importorskip(name)
        spaces.append(namespace_of(module.numpy.ones(1) if name == "jax" else module.ones(1)))
    for ns in spaces:
        assert pickle.loads(pickle.dumps(ns)) is ns and copy.deepcopy(ns) is ns
