"""Issue 18 for the JAX front end: jmp-style arrays, equality, non-float gradients, shapes, and
one home for validation (no stateful class behind the JAX values)."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lossscale.core import DynamicState
from lossscale.jax import (
    DynamicLossScale,
    FixedLossScale,
    loss_scale_optimizer,
    scaled_value_and_grad,
)

# -- item 5: every hyperparameter as a concrete 0-d array, and equality -------------------------


def test_every_hyperparameter_may_be_a_concrete_0d_array_as_in_jmp() -> None:
    ls = DynamicLossScale(
        jnp.asarray(2**15),
        increment_period=jnp.asarray(10),
        multiplier=np.asarray(4.0),
        min_loss_scale=np.asarray(1.0),
        max_loss_scale=jnp.asarray(2.0**20, jnp.float32),
        hysteresis=np.int64(2),
    )
    plain = DynamicLossScale(
        2**15, 10, 4.0, min_loss_scale=1.0, max_loss_scale=2.0**20, hysteresis=2
    )
    assert ls.rule == plain.rule and ls == plain
    assert type(ls.increment_period) is int and type(ls.multiplier) is float
    assert FixedLossScale(np.asarray(128.0)) == FixedLossScale(128)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"increment_period": jnp.asarray(10.0)}, "increment_period"),  # a float for an int
        ({"increment_period": jnp.asarray([10, 10])}, "increment_period"),  # a shape
        ({"multiplier": np.ones(2)}, "multiplier"),
        ({"min_loss_scale": jnp.asarray(True)}, "min_loss_scale"),  # bool is not a number
        ({"hysteresis": np.asarray(1.5)}, "hysteresis"),
        ({"max_loss_scale": jnp.zeros((1,))}, "max_loss_scale"),
    ],
)
def test_wrong_array_hyperparameters_are_type_errors_naming_them(
    kwargs: dict[str, object], name: str
) -> None:
    with pytest.raises(TypeError, match=name):
        DynamicLossScale(**kwargs)  # type: ignore[arg-type]


def test_array_hyperparameters_are_range_checked_like_numbers() -> None:
    with pytest.raises(ValueError, match="increment_period"):
        DynamicLossScale(increment_period=jnp.asarray(0))
    with pytest.raises(ValueError, match="multiplier"):
        DynamicLossScale(multiplier=np.asarray(1.0))
    with pytest.raises(ValueError, match="loss_scale_value"):
        FixedLossScale(jnp.asarray(0.5))


@pytest.mark.parametrize("name", ["increment_period", "multiplier", "min_loss_scale"])
def test_traced_hyperparameters_are_a_clear_type_error(name: str) -> None:
    value = {"increment_period": 10, "multiplier": 2.0, "min_loss_scale": 1.0}[name]
    with pytest.raises(TypeError, match=rf"{name} must be a concrete number.*outside jax\.jit"):
        jax.jit(lambda x: DynamicLossScale(**{name: x}).loss_scale)(jnp.asarray(value))


def test_fixed_values_compare_by_value() -> None:
    assert FixedLossScale(2) == FixedLossScale(2)
    assert FixedLossScale(2) == FixedLossScale(2.0)
    assert FixedLossScale(2) != FixedLossScale(4)
    ls = FixedLossScale(8)
    assert jax.tree_util.tree_map(lambda x: x, ls) == ls
    assert FixedLossScale(2) != DynamicLossScale(2)  # different kinds are never equal
    assert FixedLossScale(2) != 2.0


def test_dynamic_values_compare_by_rule_and_state() -> None:
    ls = DynamicLossScale(8, increment_period=2)
    assert ls == DynamicLossScale(8, increment_period=2)
    assert jax.tree_util.tree_map(lambda x: x, ls) == ls
    after = ls.adjust(True)
    built = DynamicLossScale.from_state(
        DynamicState(jnp.float32(8), jnp.int32(1), jnp.int32(0)), ls.rule
    )
    assert after == built and after != ls
    assert jax.jit(lambda s: s.adjust(jnp.asarray(True)))(ls) == after  # jit round trip
    assert ls != DynamicLossScale(8, increment_period=3)  # same state, other rule
    assert ls.adjust(True).adjust(True) == DynamicLossScale(16, increment_period=2)


def test_equality_of_traced_values_is_a_clear_type_error() -> None:
    ls = DynamicLossScale(8)

    def eq(a: DynamicLossScale) -> bool:
        return a == ls

    with pytest.raises(TypeError, match=r"traced arrays.*jnp\.array_equal"):
        jax.jit(eq)(ls)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda a: a == FixedLossScale(2))(FixedLossScale(2))


def test_values_are_unhashable_like_their_arrays() -> None:
    for ls in (DynamicLossScale(), FixedLossScale(2)):
        with pytest.raises(TypeError, match="unhashable"):
            hash(ls)


# -- item 6: non-float gradient leaves ----------------------------------------------------------


def _int_grads() -> dict[str, Any]:
    return {"w": jnp.full(2, 2.0**15), "count": jnp.asarray([3, 4], jnp.int32)}


@pytest.mark.parametrize("dynamic", [True, False])
def test_optimizer_update_rejects_integer_gradients_naming_the_leaf(dynamic: bool) -> None:
    opt = loss_scale_optimizer(optax.sgd(1.0), dynamic=dynamic, initial_scale=2.0**15)
    params = {"w": jnp.ones(2), "count": jnp.zeros(2, jnp.int32)}
    state = opt.init(params)
    for update in (opt.update, jax.jit(opt.update)):
        with pytest.raises(TypeError, match=r"\['count'\] has dtype int32"):
            update(_int_grads(), state, params)


def test_bool_and_python_int_leaves_are_rejected_too() -> None:
    ls = DynamicLossScale(4.0)
    with pytest.raises(TypeError, match=r"\[1\] has dtype bool"):
        ls.unscale([jnp.ones(1), jnp.asarray([True])])
    with pytest.raises(TypeError, match=r"\[0\] has type int"):
        FixedLossScale(4).unscale([3])


def test_float0_leaves_pass_through_as_no_update() -> None:
    def loss(params: dict[str, Any]) -> Any:
        return jnp.sum(params["w"] * params["n"])

    params = {"w": jnp.ones(2), "n": jnp.asarray([1, 2], jnp.int32)}
    grads = jax.grad(loss, allow_int=True)(params)
    assert grads["n"].dtype == jax.dtypes.float0
    ls = DynamicLossScale(8.0)
    scaled = jax.grad(lambda p: ls.scale(loss(p)), allow_int=True)(params)
    unscaled = ls.unscale(scaled)
    assert unscaled["n"] is scaled["n"]  # untouched
    np.testing.assert_array_equal(unscaled["w"], grads["w"])
    new, ok = ls.update(unscaled)  # float0 is not read by the check
    assert bool(ok) and new == ls.adjust(True)


def test_scaled_value_and_grad_gets_only_float_gradients_from_jax() -> None:
    # jax.grad refuses integer inputs itself (allow_int is not passed through): nothing to
    # unscale wrongly.
    f = scaled_value_and_grad(lambda n: jnp.sum(n * 1.0), DynamicLossScale(8.0))
    with pytest.raises(TypeError, match="integer"):
        f(jnp.asarray([1, 2], jnp.int32))


# -- item 7: shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [DynamicLossScale, FixedLossScale])
def test_adjust_with_a_vector_flag_is_a_clear_error(cls: type) -> None:
    ls = cls(8.0)
    with pytest.raises(ValueError, match=r"grads_finite must be 0-d.*shape \(2,\)"):
        ls.adjust(jnp.asarray([True, False]))
    with pytest.raises(ValueError, match="grads_finite must be 0-d"):  # at trace time too
        jax.jit(lambda s, f: s.adjust(f))(ls, jnp.asarray([True, True]))


@pytest.mark.parametrize("flag", [0.5, jnp.float32(1.0), jnp.asarray(1, jnp.int32)])
def test_adjust_with_a_non_bool_flag_is_a_type_error(flag: object) -> None:
    with pytest.raises(TypeError, match="grads_finite must be a bool"):
        DynamicLossScale(8.0).adjust(flag)


def test_adjust_accepts_python_numpy_and_jax_bools() -> None:
    ls = DynamicLossScale(8.0, increment_period=1)
    for flag in (True, np.bool_(True), np.asarray(True), jnp.asarray(True)):
        assert float(ls.adjust(flag).loss_scale) == 16.0


# -- item 9: one home for validation ------------------------------------------------------------


def test_jax_package_imports_no_other_front_end() -> None:
    import lossscale.jax

    root = pathlib.Path(lossscale.jax.__file__).parent
    for path in root.glob("*.py"):
        if path.name.endswith("_test.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(
                    ("lossscale.stateful", "lossscale.torch", "lossscale.keras")
                ), f"{path.name} imports {name}"


def test_fixed_value_messages_come_from_core() -> None:
    from lossscale.core import fixed_value

    for bad in (0.5, float("inf"), 1e39):
        with pytest.raises(ValueError) as want:
            fixed_value("loss_scale_value", bad)
        with pytest.raises(ValueError) as got:
            FixedLossScale(bad)
        assert str(got.value) == str(want.value)


def test_loss_scale_optimizer_takes_concrete_0d_arrays_too() -> None:
    opt = loss_scale_optimizer(
        optax.sgd(1.0),
        initial_scale=jnp.asarray(2.0**10),
        dynamic_growth_steps=np.asarray(7),
        min_loss_scale=jnp.asarray(0.5),
        hysteresis=np.int32(2),
        multiplier=jnp.asarray(4.0),
        backoff_factor=np.asarray(0.5),
    )
    ls = opt.init(jnp.ones(2)).loss_scale
    assert (ls.increment_period, ls.multiplier, ls.backoff_factor, ls.hysteresis) == (
        7,
        4.0,
        0.5,
        2,
    )
    assert float(ls.loss_scale) == 2.0**10 and ls.min_loss_scale == 0.5
    with pytest.raises(TypeError, match="dynamic_growth_steps must be an integer"):
        loss_scale_optimizer(optax.sgd(1.0), dynamic_growth_steps=jnp.asarray(7.0))
    with pytest.raises(
        TypeError, match=r"initial_scale must be a concrete number.*outside jax\.jit"
    ):
        jax.jit(lambda s: loss_scale_optimizer(optax.sgd(1.0), initial_scale=s).init(1.0))(
            jnp.asarray(8.0)
        )
