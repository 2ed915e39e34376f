"""The Keras optimizer against TensorFlow's rule over random sequences, on this process's
backend (scripts/dev.sh runs this directory once per backend).

Each case: a gradient dtype (float16, bfloat16, float32, float64: float64 on JAX with x64
enabled for the case), an initial scale log-uniform over float32's range or within a few
doublings of its maximum, a growth period, and "true" gradients (magnitudes 1e-40..1e4, some
inf/NaN) that each side scales by its own current scale (in float64, rounded to the dtype: the
overflow of real scaled gradients). Both protocols are checked: the trainers' ``apply`` of
scaled gradients and TensorFlow's ``get_unscaled_gradients`` + ``apply_gradients``. The oracle
is TensorFlow's ``DynamicLossScale`` where TensorFlow is installed, else the core rule on NumPy
(itself checked against TensorFlow in ``lossscale/stateful``). Variables must stay finite.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 gradients need ml_dtypes")

from lossscale.core import FLOAT32_MAX  # noqa: E402
from lossscale.keras import LossScaleOptimizer  # noqa: E402

BACKEND = keras.backend.backend()
DTYPES = ("float16", "bfloat16", "float32", "float64")
STEPS = 20


def _scaled(g: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        wide = g * np.float64(scale)
        if dtype == "bfloat16":
            return wide.astype(np.float32).astype(ml_dtypes.bfloat16)
        return wide.astype(dtype)


def _cases(seed: int, n: int) -> list[tuple[str, float, int, list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.5:
            initial = float(np.float32(FLOAT32_MAX / 2.0 ** rng.uniform(0, 3)))
        else:
            initial = float(np.float32(2.0 ** rng.uniform(0, 127)))
        grads = []
        for _ in range(STEPS):
            g = np.sign(rng.normal(size=3)) * 10.0 ** rng.uniform(-40, 4, size=3)
            if rng.random() < 0.15:
                g[rng.integers(3)] = [np.inf, -np.inf, np.nan][rng.integers(3)]
            grads.append(g)
        out.append((DTYPES[i % len(DTYPES)], initial, int(rng.integers(1, 4)), grads))
    return out


def _oracle(dtype: str, initial: float, period: int, grads: list[np.ndarray]) -> list[float]:
    try:
        import tensorflow as tf
    except ImportError:  # the core rule, checked against TensorFlow elsewhere
        import lossscale

        ls: Any = lossscale.DynamicLossScale(initial, period)
        convert: Any = np.asarray
    else:
        ls, convert = tf.compat.v1.mixed_precision.DynamicLossScale(initial, period), tf.constant
    out = []
    for g in grads:
        ls.update([convert(_scaled(g, float(ls()), dtype))])
        out.append(float(ls()))
    return out


def _float64_context(dtype: str) -> Any:
    if BACKEND == "jax" and dtype == "float64":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


CASES = _cases(0, 8)


@pytest.mark.parametrize("protocol", ["apply", "custom_loop"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]:.3g}-{c[2]}")
def test_scale_follows_tensorflow_and_variables_stay_finite(case: Any, protocol: str) -> None:
    dtype, initial, period, grads = case
    expected = _oracle(dtype, initial, period, grads)
    with _float64_context(dtype):
        opt = LossScaleOptimizer(
            keras.optimizers.SGD(1e-30), initial_scale=initial, dynamic_growth_steps=period
        )
        w = keras.Variable(np.zeros(3), dtype=dtype)
        out = []
        for g in grads:
            scale = float(keras.ops.convert_to_numpy(opt.loss_scale))
            scaled = keras.ops.convert_to_tensor(_scaled(g, scale, dtype), dtype)
            if protocol == "apply":
                opt.apply([scaled], [w])
            else:
                unscaled = opt.get_unscaled_gradients([scaled])
                opt.apply_gradients(zip(unscaled, [w], strict=True))
            out.append(float(keras.ops.convert_to_numpy(opt.loss_scale)))
            assert np.isfinite(np.asarray(keras.ops.convert_to_numpy(w), np.float64)).all()
    assert out == expected
