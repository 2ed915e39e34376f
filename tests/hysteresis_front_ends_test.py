"""``hysteresis_refill`` on every front end: the same trajectory as the core rule, a clear error
for a bad value, and the setting kept by the front end's config and checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from lossscale.core import dynamic_rule, dynamic_state, dynamic_update

# W=3, H=2, initial 64: the three refills give three different trajectories (core tests).
FLAGS = [False, True, False, True, False, False, False, True, True, True, True, True, True]
KW = {"hysteresis": 2}


def core_scales(refill: str) -> list[float]:
    rule = dynamic_rule(3, hysteresis=2, hysteresis_refill=refill)
    state, out = dynamic_state(64.0, rule), []
    for finite in FLAGS:
        state = dynamic_update(state, np.asarray(finite), rule)
        out.append(float(state.loss_scale))
    return out


def grad(finite: bool) -> np.ndarray:
    return np.array([1.0 if finite else np.inf, 1.0], np.float32)


def _stateful(refill: str) -> list[float]:
    import lossscale

    ls = lossscale.DynamicLossScale(64, 3, hysteresis_refill=refill, **KW)
    out = []
    for finite in FLAGS:
        ls.update([grad(finite)])
        out.append(float(ls()))
    config = ls.get_config()
    assert config["hysteresis_refill"] == refill
    assert lossscale.DynamicLossScale.from_config(config).hysteresis_refill == refill
    return out


def _torch_optimizer(refill: str) -> list[float]:
    torch = pytest.importorskip("torch")
    from lossscale.torch import LossScaleOptimizer

    w = torch.nn.Parameter(torch.zeros(2))
    opt = LossScaleOptimizer(
        torch.optim.SGD([w], lr=0.1), initial_scale=64, dynamic_growth_steps=3,
        hysteresis_refill=refill, **KW,
    )  # fmt: skip
    out = []
    for finite in FLAGS:
        w.grad = torch.from_numpy(grad(finite)) * opt.loss_scale  # scaled by hand
        opt.step()
        out.append(float(opt.loss_scale))
    assert opt.get_config()["hysteresis_refill"] == refill
    return out


def _torch_scaler(refill: str, sharded: bool = False) -> list[float]:
    torch = pytest.importorskip("torch")
    from lossscale.torch import GradScaler, ShardedGradScaler

    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([w], lr=0.1)
    cls = ShardedGradScaler if sharded else GradScaler
    scaler = cls("cpu", 64.0, growth_interval=3, hysteresis_refill=refill, **KW)
    out = []
    for finite in FLAGS:
        w.grad = torch.from_numpy(grad(finite))
        scaler.step(sgd)
        scaler.update()
        out.append(scaler.get_scale())
    # the counter rides in the checkpoint; the setting is the loading object's own
    fresh = cls("cpu", 64.0, growth_interval=3, hysteresis_refill=refill, **KW)
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.state_dict() == scaler.state_dict()
    return out


def _jax_transform(refill: str) -> list[float]:
    pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    from lossscale.jax import current_scale, loss_scale_optimizer

    opt = loss_scale_optimizer(
        optax.sgd(0.1), initial_scale=64.0, dynamic_growth_steps=3,
        hysteresis_refill=refill, **KW,
    )  # fmt: skip
    params = jnp.zeros(2)
    state, out = opt.init(params), []
    for finite in FLAGS:
        _, state = opt.update(jnp.asarray(grad(finite)), state, params)
        out.append(float(current_scale(state)))
    return out


def _jax_value(refill: str) -> list[float]:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from lossscale.jax import DynamicLossScale

    ls = DynamicLossScale(64, 3, hysteresis_refill=refill, **KW)
    out = []
    for finite in FLAGS:
        ls, _ = ls.update(jnp.asarray(grad(finite)))
        out.append(float(ls.loss_scale))
    assert ls.hysteresis_refill == refill
    return out


FRONT_ENDS: dict[str, Callable[[str], list[float]]] = {
    "stateful": _stateful,
    "torch.LossScaleOptimizer": _torch_optimizer,
    "torch.GradScaler": _torch_scaler,
    "torch.ShardedGradScaler": lambda refill: _torch_scaler(refill, sharded=True),
    "jax.loss_scale_optimizer": _jax_transform,
    "jax.DynamicLossScale": _jax_value,
}


@pytest.mark.parametrize("refill", ["on_growth", "on_finite_step"])
@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_front_end_follows_the_core_rule(front_end: str, refill: str) -> None:
    assert FRONT_ENDS[front_end](refill) == core_scales(refill)


@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_front_end_rejects_an_unknown_refill(front_end: str) -> None:
    with pytest.raises(ValueError, match=r"hysteresis_refill must be one of .*'sometimes'"):
        FRONT_ENDS[front_end]("sometimes")


def test_keras_optimizer_follows_the_core_rule() -> None:
    keras = pytest.importorskip("keras")
    from lossscale.keras import LossScaleOptimizer

    for refill in ("on_growth", "on_finite_step"):
        opt = LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=64.0, dynamic_growth_steps=3,
            hysteresis_refill=refill, **KW,
        )  # fmt: skip
        w = keras.Variable(np.zeros(2, np.float32))
        out: list[Any] = []
        for finite in FLAGS:
            opt.apply([keras.ops.convert_to_tensor(grad(finite))], [w])
            out.append(float(keras.ops.convert_to_numpy(opt.loss_scale)))
        assert out == core_scales(refill)
        assert opt.get_config()["hysteresis_refill"] == refill
