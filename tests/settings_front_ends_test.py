"""Issue 18 item 4, per front end: TensorFlow's optimizer arguments are checked by the one
function in core (``lossscale.core.scale_settings``), so a string ``dynamic`` says what to pass
and a float ``dynamic_growth_steps`` is named by the front end's own name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lossscale.core import scale_settings

STRING_DYNAMIC = r"dynamic must be a bool, got the string 'dynamic'\. dynamic=True \(the default\)"
FLOAT_STEPS = r"^{} must be an integer >= 1, got 3\.0 of type float$"


def _torch_optimizer(**kwargs: Any) -> Any:
    torch = pytest.importorskip("torch")
    from lossscale.torch import LossScaleOptimizer

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    dynamic = kwargs.pop("dynamic", True)
    return LossScaleOptimizer(sgd, dynamic, **kwargs)


def _jax_optimizer(**kwargs: Any) -> Any:
    optax = pytest.importorskip("optax")
    from lossscale.jax import loss_scale_optimizer

    dynamic = kwargs.pop("dynamic", True)
    return loss_scale_optimizer(optax.sgd(1.0), dynamic, **kwargs)


def _core(**kwargs: Any) -> Any:
    return scale_settings(kwargs.pop("dynamic", True), **kwargs)


FRONT_ENDS: dict[str, Callable[..., Any]] = {
    "core": _core,
    "torch": _torch_optimizer,
    "jax": _jax_optimizer,
}


@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_a_string_dynamic_says_what_to_pass(front_end: str) -> None:
    with pytest.raises(TypeError, match=STRING_DYNAMIC) as err:
        FRONT_ENDS[front_end](dynamic="dynamic")
    assert "loss_scale='dynamic'" in str(err.value)
    # only the front ends that have one point to an experimental form
    assert ("experimental.LossScaleOptimizer" in str(err.value)) == (front_end != "jax")


@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_a_float_growth_steps_names_dynamic_growth_steps(front_end: str) -> None:
    with pytest.raises(TypeError, match=FLOAT_STEPS.format("dynamic_growth_steps")):
        FRONT_ENDS[front_end](dynamic_growth_steps=3.0)


@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_a_non_bool_dynamic_is_a_type_error(front_end: str) -> None:
    with pytest.raises(TypeError, match="dynamic must be a bool, got 1"):
        FRONT_ENDS[front_end](dynamic=1)


def test_grad_scaler_uses_torchs_names() -> None:
    pytest.importorskip("torch")
    from lossscale.torch import GradScaler

    with pytest.raises(TypeError, match=FLOAT_STEPS.format("growth_interval")):
        GradScaler(growth_interval=3.0)  # type: ignore[arg-type]


# -- a user's subclass of a supported loss-scale class, on every experimental form --------------
def _logged_dynamic() -> Any:
    """A user's ``DynamicLossScale`` with a logging hook (TensorFlow accepts subclasses)."""
    import lossscale

    class LoggedDynamicLossScale(lossscale.DynamicLossScale):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.log: list[bool] = []

        def update(self, grads: Any) -> Any:
            result = super().update(grads)
            self.log.append(bool(result[1]))
            return result

    return LoggedDynamicLossScale(initial_loss_scale=256, increment_period=7)


def test_a_user_subclass_on_the_torch_experimental_form() -> None:
    torch = pytest.importorskip("torch")
    from lossscale.torch import experimental

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    opt = experimental.LossScaleOptimizer(sgd, _logged_dynamic())
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 256.0, 7)


def test_a_user_subclass_on_the_keras_experimental_form() -> None:
    keras = pytest.importorskip("keras")
    from lossscale.keras import experimental

    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), _logged_dynamic())
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 256.0, 7)


def test_a_user_subclass_of_the_jax_values_passes_through_jit() -> None:
    """lossscale.jax has no experimental optimizer form; its loss-scale values are what a user
    subclasses: the subclass is a pytree too and comes back from ``adjust`` as itself."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from lossscale.jax import DynamicLossScale, FixedLossScale, scaled_value_and_grad

    class Logged(DynamicLossScale):
        def describe(self) -> str:
            return f"scale {float(self.loss_scale)}"

    class Fixed(FixedLossScale):
        pass

    @jax.jit
    def step(params: Any, ls: Any) -> Any:
        _, grads, finite = scaled_value_and_grad(lambda p: (p**2).sum(), ls)(params)
        return grads, ls.adjust(finite)

    grads, ls = step(jnp.ones(2), Logged(initial_loss_scale=8.0, increment_period=1))
    assert type(ls) is Logged and ls.describe() == "scale 16.0"
    assert grads.tolist() == [2.0, 2.0]
    grads, fixed = step(jnp.ones(2), Fixed(4.0))
    assert type(fixed) is Fixed and float(fixed.loss_scale) == 4.0
