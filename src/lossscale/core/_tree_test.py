"""Tests of :func:`flatten_grads`: ``tf.nest`` order, ``None`` entries, and type errors that
name the offending entry."""

from __future__ import annotations

import re
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest

from lossscale.core import flatten_grads
from lossscale.core._backends import NUMPY

Pair = namedtuple("Pair", ["b", "a"])


def values(leaves: list[Any]) -> list[float]:
    return [float(np.asarray(x).reshape(-1)[0]) for x in leaves]


def test_nesting_order_follows_tf_nest() -> None:
    grads = {
        "b": [np.array([1.0]), None, (np.array([2.0]), None)],
        "a": Pair(b=np.array([3.0]), a={"z": np.array([4.0]), "y": None}),
        "c": None,
    }
    # dicts in sorted key order; lists, tuples and namedtuples in field order; None skipped
    leaves = flatten_grads(grads)
    assert values(leaves.arrays) == [3.0, 4.0, 1.0, 2.0]
    assert leaves.namespace is NUMPY


def test_ordered_dict_is_also_sorted() -> None:
    grads = OrderedDict([("z", np.array([1.0])), ("a", np.array([2.0]))])
    assert values(flatten_grads(grads).arrays) == [2.0, 1.0]


def test_single_array_is_one_leaf() -> None:
    leaf = np.ones((2, 3), np.float16)
    leaves = flatten_grads(leaf)
    assert len(leaves.arrays) == 1
    assert leaves.arrays[0] is leaf


@pytest.mark.parametrize(
    "grads", [None, [], (), {}, [None], [[], {}, ()], {"a": None}, Pair(None, None)]
)
def test_empty_structures_have_no_leaves(grads: object) -> None:
    leaves = flatten_grads(grads)
    assert leaves.arrays == []
    assert leaves.namespace is None


def test_python_floats_become_float32() -> None:
    leaves = flatten_grads([1.5, np.ones(2, np.float16)])
    assert leaves.arrays[0].dtype == np.float32
    assert float(leaves.arrays[0]) == 1.5
    assert leaves.arrays[1].dtype == np.float16
    assert leaves.namespace is NUMPY


def test_python_floats_alone_have_no_namespace() -> None:
    leaves = flatten_grads([1.0, 2.0])
    assert leaves.namespace is None
    assert [a.dtype for a in leaves.arrays] == [np.float32, np.float32]


def test_python_float_beyond_float32_is_inf_without_warning(
    recwarn: pytest.WarningsRecorder,
) -> None:
    leaves = flatten_grads([1e39])
    assert np.isinf(leaves.arrays[0])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_numpy_float64_scalar_keeps_its_dtype() -> None:
    # np.float64 subclasses float, but it is a NumPy scalar judged in float64 (1e300 is finite)
    leaves = flatten_grads([np.float64(1e300)])
    assert leaves.namespace is NUMPY
    assert np.asarray(leaves.arrays[0]).dtype == np.float64
    assert float(leaves.arrays[0]) == 1e300


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, np.float64, "bfloat16"], ids=["f16", "f32", "f64", "bf16"]
)
def test_float_dtypes_accepted(dtype: Any) -> None:
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    leaves = flatten_grads([np.ones(3, dtype)])
    assert leaves.arrays[0].dtype == np.dtype(dtype)


@pytest.mark.parametrize(
    ("grads", "path", "what"),
    [
        ([1.0, 1], "grads[1]", "int"),
        ([True], "grads[0]", "bool"),
        ((1j,), "grads[0]", "complex"),
        (["0.5"], "grads[0]", "str"),
        ([b"x"], "grads[0]", "bytes"),
        ([np.ones(2), {"w": np.ones(2, np.int32)}], "grads[1]['w']", "int32"),
        ({"a": [None, np.ones(2, np.int64)]}, "grads['a'][1]", "int64"),
        ([np.array([True])], "grads[0]", "bool"),
        ([np.bool_(True)], "grads[0]", "bool"),
        ([np.int64(3)], "grads[0]", "int64"),
        ([np.ones(2, np.complex64)], "grads[0]", "complex64"),
        ([np.array(["a"])], "grads[0]", "str"),
        ([np.array([1.0], dtype=object)], "grads[0]", "object"),
        ([object()], "grads[0]", "object"),
        ([[1.0, 2.0], [[3]]], "grads[1][0][0]", "int"),
        (Pair(b=None, a=np.ones(1, np.uint8)), "grads[1]", "uint8"),
        (7, "grads ", "int"),
    ],
)
def test_non_float_leaves_raise_naming_the_entry(grads: object, path: str, what: str) -> None:
    with pytest.raises(TypeError, match=re.escape(path) + r".*" + re.escape(what)):
        flatten_grads(grads)


def test_error_message_is_truncated_for_huge_values() -> None:
    with pytest.raises(TypeError, match=r"grads\[0\] is 'xxx.*\.\.\. of type str") as info:
        flatten_grads(["x" * 1000])
    assert len(str(info.value)) < 200


def test_unsortable_dict_keys_raise() -> None:
    with pytest.raises(TypeError, match=r"grads\['outer'\]: dict keys must be sortable"):
        flatten_grads({"outer": {1: np.ones(1), "a": np.ones(1)}})


def test_two_libraries_raise() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"grads\[1\] is a torch array.*numpy"):
        flatten_grads([np.ones(2), torch.ones(2)])
    with pytest.raises(TypeError, match=r"grads\['b'\] is a numpy array.*torch"):
        flatten_grads({"a": torch.ones(2), "b": np.ones(2)})
    # a NumPy float64 scalar is NumPy, not a Python float
    with pytest.raises(TypeError, match=r"grads\[1\] is a numpy array"):
        flatten_grads([torch.ones(2), np.float64(1.0)])


def test_python_floats_follow_the_array_library() -> None:
    torch = pytest.importorskip("torch")
    leaves = flatten_grads([1.0, torch.ones(2, dtype=torch.bfloat16), 1e39])
    assert leaves.namespace is not None
    assert leaves.namespace.name == "torch"
    assert all(isinstance(a, torch.Tensor) for a in leaves.arrays)
    assert leaves.arrays[0].dtype == torch.float32
    assert leaves.arrays[0].item() == 1.0
    assert leaves.arrays[2].item() == float("inf")


def test_torch_integer_tensor_raises() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"grads\['w'\] has dtype int32"):
        flatten_grads({"w": torch.ones(2, dtype=torch.int32)})
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype complex64"):
        flatten_grads([torch.ones(2, dtype=torch.complex64)])


def test_jax_integer_array_raises() -> None:
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError, match=r"grads\[0\]\[1\] has dtype int32"):
        flatten_grads([[jnp.ones(2), jnp.ones(2, jnp.int32)]])


@pytest.mark.parametrize(
    ("leaf", "kind"), [(1, "int"), (True, "bool"), (1j, "complex"), ("g", "str")]
)
def test_python_non_float_message_says_floating_point(leaf: object, kind: str) -> None:
    with pytest.raises(
        TypeError, match=rf"grads\[0\] is .* of type {kind}; gradients must be floating"
    ):
        flatten_grads([leaf])
