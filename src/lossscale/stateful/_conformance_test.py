"""Issue 18 for the stateful classes: float0 leaves are no gradient, non-float leaves are a
TypeError naming the entry (state unchanged), and the classes keep TensorFlow's identity
semantics (unlike the JAX values, which compare by value)."""

from __future__ import annotations

import numpy as np
import pytest

import lossscale


def _float0(n: int) -> np.ndarray:
    # JAX's float0 is this NumPy dtype; built here without JAX so the test runs without it.
    return np.zeros(n, np.dtype([("float0", "V")]))


def test_float0_leaves_are_no_gradient() -> None:
    ls = lossscale.DynamicLossScale(8, increment_period=1)
    _, ok = ls.update({"w": np.ones(2, np.float32), "n": _float0(2)})
    assert bool(ok) and float(ls()) == 16.0
    _, ok = ls.update({"w": np.array([np.nan], np.float32), "n": _float0(2)})
    assert not bool(ok) and float(ls()) == 8.0
    _, ok = ls.update([_float0(3)])  # nothing but float0: like an empty structure, finite
    assert bool(ok)


def test_float0_from_jax_grad_allow_int() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    grads = jax.grad(lambda p: jnp.sum(p["w"] * p["n"]), allow_int=True)(
        {"w": jnp.ones(2), "n": jnp.asarray([1, 2], jnp.int32)}
    )
    ls = lossscale.DynamicLossScale(8)
    _, ok = ls.update(grads)
    assert bool(ok) and int(ls.num_good_steps) == 1


@pytest.mark.parametrize(
    "grads, where",
    [
        ({"w": np.ones(2, np.float32), "n": np.arange(2)}, r"grads\['n'\] has dtype int64"),
        ([np.ones(1, np.float32), np.array([True])], r"grads\[1\] has dtype bool"),
        ([np.ones(1, np.float32), 3], r"grads\[1\] is 3 of type int"),
    ],
)
def test_non_float_gradients_are_type_errors_and_change_nothing(grads: object, where: str) -> None:
    ls = lossscale.DynamicLossScale(8, increment_period=1)
    before = ls.state_dict()
    with pytest.raises(TypeError, match=where):
        ls.update(grads)
    assert ls.state_dict() == before


def test_stateful_classes_keep_identity_semantics() -> None:
    a, b = lossscale.FixedLossScale(2), lossscale.FixedLossScale(2)
    assert a == a and a != b and hash(a) != hash(b)
    c, d = lossscale.DynamicLossScale(), lossscale.DynamicLossScale()
    assert c == c and c != d and len({c, d}) == 2
