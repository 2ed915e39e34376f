"""NumericsCallback on this process's Keras backend: the gradients a scaled backward pass
produces at the optimizer's scale, counted exactly, on sampled batches only."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from lossscale.keras import (  # noqa: E402
    LossScaleOptimizer,
    NumericsCallback,
    _numerics,
)
from lossscale.numerics import tensor_stats  # noqa: E402

FORMATS = ("float16", "float8_e5m2")
TARGET = 2.0**-30  # d mean((0 - y)**2) / dw = -2 * y for x = 1: 2**-29, below float16's range


def _fit(optimizer: Any, callback: NumericsCallback, batches: int = 3) -> Any:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=optimizer, loss="mse")
    x = np.ones((4 * batches, 4), "float32")
    y = np.full((4 * batches, 1), TARGET, "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False, callbacks=[callback])
    return model


@pytest.mark.parametrize("scaled", [True, False])
def test_sampled_batches_report_the_scaled_gradients(
    scaled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = (np.ones((4, 4), "float32"), np.full((4, 1), TARGET, "float32"))
    callback = NumericsCallback(data, every=2, formats=FORMATS)
    seen: list[list[Any]] = []
    real = _numerics.scaled_gradients

    def spy(*args: Any) -> list[Any]:
        seen.append([np.asarray(keras.ops.convert_to_numpy(g)) for g in real(*args)])
        return real(*args)

    monkeypatch.setattr(_numerics, "scaled_gradients", spy)
    sgd = keras.optimizers.SGD(0.0)  # no update: every batch sees the zero kernel
    _fit(LossScaleOptimizer(sgd, initial_scale=2.0**15) if scaled else sgd, callback)
    report = callback.report
    assert report.steps == [0, 2] and len(seen) == 2  # batch 1 computed nothing
    scale = 2.0**15 if scaled else 1.0
    rows = [r for r in report.rows if r.step == 0]
    assert sorted(r.tensor.rsplit("/", 1)[1] for r in rows) == ["bias", "bias", "kernel", "kernel"]
    for r in rows:
        assert r.loss_scale == scale
        grad = seen[0][0 if r.tensor.endswith("kernel") else 1]
        assert tuple(r[4:]) == tuple(tensor_stats(grad, formats=r.format)[r.format])
        if r.format == "float16":  # -2**-29 * scale: lost at 1, a normal at 2**15
            assert (r.underflow, r.amax) == ((0.0, 2.0**-14) if scaled else (1.0, 2.0**-29))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="data must be an"):
        NumericsCallback(np.ones(3))
    with pytest.raises(ValueError, match="every must be at least 1"):
        NumericsCallback((1, 2), every=0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss=["mse"])
    with pytest.raises(ValueError, match="needs one loss function"):
        _numerics._loss_fn(model, None)
