"""One protocol for what lossscale's tools read of a scaler (``lossscale.torch.ScaleReader``):
every scaler lossscale ships satisfies it, the frameworks' own are read through
``scale_reader``, and ``NumericsMonitor`` takes them all, and dtypes as formats."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lossscale.torch import (  # noqa: E402
    GradScaler,
    LossScaleOptimizer,
    NumericsMonitor,
    NumericsNoGradientsWarning,
    ScaleReader,
    ShardedGradScaler,
    scale_reader,
)


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _lossscale_scalers(model: Any) -> dict[str, Any]:
    from lossscale.megatron import ConstantGradScaler, DynamicGradScaler

    scalers = {
        "GradScaler": GradScaler("cpu", init_scale=2.0**10),
        "GradScaler disabled": GradScaler("cpu", enabled=False),
        "ShardedGradScaler": ShardedGradScaler("cpu", init_scale=2.0**10),
        "LossScaleOptimizer": LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=2.0**10
        ),
        "megatron DynamicGradScaler": DynamicGradScaler(2.0**10, device="cpu"),
        "megatron ConstantGradScaler": ConstantGradScaler(2.0**10, device="cpu"),
    }
    try:
        from lossscale.accelerate import AcceleratorGradScaler, AcceleratorShardedGradScaler
    except ImportError:
        pass
    else:
        scalers["AcceleratorGradScaler"] = AcceleratorGradScaler("cpu", init_scale=2.0**10)
        scalers["AcceleratorShardedGradScaler"] = AcceleratorShardedGradScaler("cpu", 2.0**10)
    try:
        from lossscale.deepspeed import DeepSpeedLossScaler
    except ImportError:
        return scalers
    scalers["DeepSpeedLossScaler"] = DeepSpeedLossScaler(initial_scale=2.0**10)
    return scalers


def test_every_scaler_lossscale_ships_is_a_scale_reader() -> None:
    scalers = _lossscale_scalers(_model())
    assert len(scalers) >= 6
    for name, scaler in scalers.items():
        assert isinstance(scaler, ScaleReader), name
        assert scale_reader(scaler) is scaler
        expected = 1.0 if "disabled" in name else 2.0**10
        assert float(scaler.current_loss_scale()) == expected, name
        assert scaler.read_last_step_applied() is True, name  # before any step


def test_read_last_step_applied_follows_a_skip() -> None:
    from lossscale.megatron import ConstantGradScaler, DynamicGradScaler

    for scaler in (DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 10, 1, device="cpu"),
                   ConstantGradScaler(8.0, device="cpu")):  # fmt: skip
        scaler.update(torch.tensor([1.0]))
        assert scaler.read_last_step_applied() is False
        scaler.update(False)
        assert scaler.read_last_step_applied() is True
    deepspeed = pytest.importorskip("lossscale.deepspeed")
    ds = deepspeed.DeepSpeedLossScaler(initial_scale=8.0)
    ds.update_scale(True)
    assert ds.read_last_step_applied() is False and ds.current_loss_scale() == 4.0


def test_framework_scalers_are_read_through_the_adapter() -> None:
    amp = scale_reader(torch.amp.GradScaler("cpu", init_scale=64.0))
    assert amp is not None and isinstance(amp, ScaleReader)
    assert float(amp.current_loss_scale()) == 64.0
    with pytest.raises(TypeError, match="does not report whether a step was skipped"):
        amp.read_last_step_applied()
    disabled = scale_reader(torch.amp.GradScaler("cpu", enabled=False))
    assert disabled is not None and disabled.current_loss_scale() == 1.0
    from lossscale.megatron._testing import MegatronDynamicPort  # Megatron's own, ported

    megatron = scale_reader(MegatronDynamicPort(512.0, 1.0, 2.0, 0.5, 10, 2))
    assert megatron is not None and megatron.current_loss_scale().shape == ()
    assert float(megatron.current_loss_scale()) == 512.0
    assert scale_reader(None) is None
    with pytest.raises(
        TypeError, match=r"scaler must be a lossscale GradScaler, .* got builtins\.object"
    ):
        scale_reader(object())


def test_deepspeeds_own_scaler_is_read_through_the_adapter() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    for own, scale in (
        (DynamicLossScaler(2.0**8, 1000, 1.0, 2, False), 256.0),
        (LossScaler(4.0), 4.0),
    ):
        reader = scale_reader(own)
        assert reader is not None and reader.current_loss_scale() == scale


def _record(scaler: Any, **kwargs: Any) -> list[Any]:
    model = _model()
    monitor = NumericsMonitor(model, scaler, every=1, **kwargs)
    model(torch.full((3, 4), 1e-3)).sum().backward()
    assert monitor.record()
    return monitor.report.rows


def test_the_monitor_takes_every_scaler() -> None:
    for name, scaler in _lossscale_scalers(_model()).items():
        rows = _record(scaler)
        assert rows and {r.loss_scale for r in rows} == {1.0 if "disabled" in name else 1024.0}
    from lossscale.megatron._testing import MegatronDynamicPort

    assert {r.loss_scale for r in _record(MegatronDynamicPort(8.0, 1.0, 2.0, 0.5, 10, 2))} == {8.0}
    assert {r.loss_scale for r in _record(torch.amp.GradScaler("cpu", init_scale=4.0))} == {4.0}
    with pytest.raises(TypeError, match=r"got builtins\.str"):
        NumericsMonitor(_model(), "GradScaler")


def test_formats_may_be_dtypes() -> None:
    by_name = _record(None, formats=("float16", "bfloat16"))
    assert _record(None, formats=(torch.float16, torch.bfloat16)) == by_name
    assert _record(None, formats=(np.float16, "bfloat16")) == by_name
    assert _record(None, formats=torch.float16) == [r for r in by_name if r.format == "float16"]
    jnp = pytest.importorskip("jax.numpy")
    assert _record(None, formats=(jnp.float16, jnp.bfloat16)) == by_name
    assert _record(None, formats=(np.dtype("float16"), jnp.dtype("bfloat16"))) == by_name
    with pytest.raises(ValueError, match="unknown format 'int32'"):
        NumericsMonitor(_model(), formats=(torch.int32,))
    with pytest.raises(TypeError, match="a format is a name, a FloatFormat or a dtype"):
        NumericsMonitor(_model(), formats=(3,))


def test_a_sampled_step_without_gradients_says_so() -> None:
    model = _model()
    monitor = NumericsMonitor(model, every=1)
    with pytest.warns(NumericsNoGradientsWarning, match="step 0 was sampled but no gradient"):
        assert monitor.record()
    assert monitor.report.rows == []
    sparse = NumericsMonitor(model, every=2)
    with pytest.warns(NumericsNoGradientsWarning):
        sparse.record()  # step 0: sampled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sparse.record() is False  # step 1: not sampled, nothing to say


def test_gradients_come_from_where_the_caller_says() -> None:
    model = _model()
    grads = [("g", torch.full((3,), 2.0**-30))]
    monitor = NumericsMonitor(model, every=1, gradients=lambda: grads)
    assert monitor.record()
    [row] = monitor.report.rows
    assert (row.tensor, row.underflow) == ("g", 1.0)
    with pytest.raises(TypeError, match="gradients must be a function"):
        NumericsMonitor(model, gradients=grads)
