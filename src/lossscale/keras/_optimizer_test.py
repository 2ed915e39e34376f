"""``lossscale.keras.LossScaleOptimizer`` on the Keras backend of this process (issue 17).

scripts/dev.sh runs this file once per backend (``KERAS_BACKEND=tensorflow`` in the main run,
then ``jax`` and ``torch``), each in its own process: Keras picks its backend at import.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from lossscale.core import LossScaleStalledError, LossScaleStalledWarning  # noqa: E402
from lossscale.keras import LossScaleOptimizer, experimental  # noqa: E402

BACKEND = keras.backend.backend()
ops = keras.ops


def _variables(*values: list[float]) -> list[Any]:
    return [keras.Variable(np.asarray(v, np.float32)) for v in values]


def _grads(scale: float, *values: list[float]) -> list[Any]:
    return [ops.convert_to_tensor(np.asarray(v, np.float32) * np.float32(scale)) for v in values]


def _np(x: Any) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x))


# -- the rule, through apply --------------------------------------------------------------------


def test_trajectory_matches_tensorflows_dynamic_loss_scale() -> None:
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(0)
    steps = [bool(b) for b in rng.random(60) < 0.75]
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=64.0, dynamic_growth_steps=3)
    variables = _variables([1.0, 2.0])
    oracle = tf.compat.v1.mixed_precision.DynamicLossScale(64.0, 3, 2.0)
    for finite in steps:
        g = [1.0, 1.0] if finite else [1.0, math.inf]
        opt.apply(_grads(1.0, g), variables)
        oracle.update([tf.constant(np.asarray(g, np.float32))])
        assert float(_np(opt.loss_scale)) == float(oracle())
        assert opt.dynamic_counter == int(oracle._num_good_steps.numpy())


def test_floor_and_ceiling_where_keras_3_reaches_zero_and_inf() -> None:
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=4.0, stall_steps=None)
    variables = _variables([1.0])
    for _ in range(200):
        opt.apply(_grads(1.0, [math.inf]), variables)
    assert float(_np(opt.loss_scale)) == 1.0
    big = LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=2.0**126, dynamic_growth_steps=1
    )
    for _ in range(5):
        big.apply(_grads(1.0, [1.0]), variables)
    assert float(_np(big.loss_scale)) == 2.0**127


def test_skipped_step_leaves_variables_slots_and_iterations_bit_identical() -> None:
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=8.0)
    variables = _variables([1.0, 2.0], [3.0])
    opt.apply(_grads(8.0, [1.0, 1.0], [1.0]), variables)
    before = [_np(v).copy() for v in variables] + [
        _np(v).copy() for v in opt.inner_optimizer.variables
    ]
    opt.apply(_grads(8.0, [1.0, math.nan], [1.0]), variables)
    after = [_np(v) for v in variables] + [_np(v) for v in opt.inner_optimizer.variables]
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)
    assert int(_np(opt.iterations)) == 1  # counts applied steps only (documented)
    assert float(_np(opt.loss_scale)) == 4.0


def test_fixed_scale_never_skips() -> None:
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), dynamic=False, initial_scale=4.0)
    variables = _variables([1.0])
    opt.apply(_grads(4.0, [1.0]), variables)
    assert _np(variables[0]).tolist() == [0.0]
    opt.apply(_grads(4.0, [math.inf]), variables)  # TensorFlow: a fixed scale applies it
    assert math.isinf(float(_np(variables[0])[0]))


# -- two protocols --------------------------------------------------------------------------


def test_both_protocols_give_the_same_step_and_a_mix_is_an_error() -> None:
    keras_way, tf_way = _variables([1.0, 2.0]), _variables([1.0, 2.0])  # one variable each
    opt_a = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=1024.0)
    opt_b = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=1024.0)
    opt_a.apply(_grads(1024.0, [2.0, 4.0]), keras_way)  # scaled gradients (Keras's trainers)
    unscaled = opt_b.get_unscaled_gradients(_grads(1024.0, [2.0, 4.0]))
    opt_b.apply_gradients(zip(unscaled, tf_way, strict=True))  # TF's custom loop
    assert _np(keras_way[0]).tolist() == _np(tf_way[0]).tolist() == [0.0, 0.0]
    mixed = opt_b.get_unscaled_gradients(_grads(1024.0, [2.0]))
    with pytest.raises(ValueError, match="mix of gradients"):
        opt_b.apply([mixed[0], _grads(1024.0, [1.0])[0]], _variables([1.0], [1.0]))


def test_scaled_loss_of_float16_is_float32_and_unscaled_gradients_keep_dtypes() -> None:
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    scaled = opt.get_scaled_loss(ops.convert_to_tensor(np.float16(60000.0)))
    assert "float32" in str(scaled.dtype) and float(_np(scaled)) == 60000.0 * 2**15
    assert float(_np(opt.scale_loss(ops.convert_to_tensor(2.0)))) == 2.0**16
    grads = opt.get_unscaled_gradients([ops.convert_to_tensor(np.float16([2.0**15])), None])
    assert grads[1] is None and "float16" in str(grads[0].dtype) and float(_np(grads[0])[0]) == 1.0


def _float64() -> Any:
    """float64 tensors on this backend (JAX holds them only with x64 enabled)."""
    if BACKEND == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


def _dtype(x: Any) -> str:
    return str(keras.backend.standardize_dtype(x.dtype))


def test_float64_gradients_are_unscaled_in_float64() -> None:
    with _float64():
        opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0)
        g = ops.convert_to_tensor(np.float64([(1 + 2**-40) * 2]), "float64")
        (unscaled,) = opt.get_unscaled_gradients([g])
        assert _dtype(unscaled) == "float64" and _np(unscaled).tolist() == [1 + 2**-40]
        w = keras.Variable(np.float64([4.0]), dtype="float64")
        opt.apply([g], [w])  # the trainers' path: scaled gradients
        assert _np(w).tolist() == [3 - 2**-40]


@pytest.mark.parametrize("path", ["apply", "custom_loop", "stateless_apply"])
def test_float64_gradient_beyond_float32_range_is_applied_not_inf(path: str) -> None:
    if path == "stateless_apply" and BACKEND != "jax":
        pytest.skip("stateless_apply is the JAX trainer's protocol")
    with _float64():
        opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0**120)
        w = keras.Variable(np.float64([1.0]), dtype="float64")
        g = ops.convert_to_tensor(np.float64([300.0 * 2.0**120]), "float64")  # scaled
        if path == "apply":
            opt.apply([g], [w])
        elif path == "custom_loop":
            opt.apply_gradients(zip(opt.get_unscaled_gradients([g]), [w], strict=True))
        else:
            opt.build([w])
            new_w, new_opt = opt.stateless_apply([v.value for v in opt.variables], [g], [w.value])
            w.assign(new_w[0])
            for var, value in zip(opt.variables, new_opt, strict=True):
                var.assign(value)
        # TensorFlow applies the step (300 is finite in float64) and keeps the scale
        assert _np(w).tolist() == [-299.0]
        assert float(_np(opt.loss_scale)) == 2.0**120


def test_gradient_finite_when_scaled_but_not_when_unscaled_is_skipped() -> None:
    # a scale below 1 (allowed: it may start below the floor) unscales float16 60000 to inf
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=0.5, min_loss_scale=0.25)
    w = keras.Variable(np.float16([1.0]), dtype="float16")
    opt.apply([ops.convert_to_tensor(np.float16([60000.0]))], [w])
    assert _np(w).tolist() == [1.0]  # skipped: no inf reaches the variable
    assert float(_np(opt.loss_scale)) == 0.25


# -- model.compile / fit --------------------------------------------------------------------


def _model() -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])


def _data(inf_rows: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.RandomState(0).randn(32, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    for row in inf_rows:  # a non-finite input row: every gradient of its batch is non-finite
        x[row, 0] = np.inf
    return x, y


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_skips_overflowing_batches_on_this_backend(jit_compile: bool) -> None:
    model = _model()
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**10, dynamic_growth_steps=2
    )
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    x, y = _data(inf_rows=(8, 9, 24))  # batches 2 and 6 (batch size 4)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # finite, finite (grow), overflow, finite, finite (grow), finite, overflow, finite
    assert float(_np(opt.loss_scale)) == 1024.0 and opt.dynamic_counter == 1
    assert int(_np(opt.iterations)) == 6  # the two skipped batches did not count
    assert all(np.isfinite(_np(w)).all() for w in model.weights)


def test_mixed_float16_compile_keeps_it_and_matches_keras_3s_own_optimizer() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        losses = []
        for make in (
            lambda: LossScaleOptimizer(keras.optimizers.SGD(0.01)),
            lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)),
        ):
            model = _model()
            opt = make()
            model.compile(optimizer=opt, loss="mse")
            assert model.optimizer is opt  # Keras did not wrap it in a second LSO
            x, y = _data()
            history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
            losses.append(history.history["loss"])
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    finally:
        keras.mixed_precision.set_global_policy("float32")


# -- saving ---------------------------------------------------------------------------------------


def test_config_round_trips_and_foreign_configs_load() -> None:
    opt = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=256.0, dynamic_growth_steps=7, hysteresis=2
    )
    config = opt.get_config()
    assert config["dynamic"] is True and config["hysteresis"] == 2
    again = LossScaleOptimizer.from_config(config)
    assert again.get_config() == config
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert isinstance(restored, LossScaleOptimizer) and restored.get_config() == config
    # Keras 3's own LossScaleOptimizer's config (name, no "dynamic")
    keras3 = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    loaded = LossScaleOptimizer.from_config(keras3.get_config())
    assert (loaded.dynamic, loaded.initial_scale, loaded.dynamic_growth_steps) == (True, 64.0, 2000)
    # tf_keras / TensorFlow 2.4-2.15 (legacy Keras) wrote the inner optimizer by class name
    tf_keras = {
        "inner_optimizer": {
            "class_name": "SGD",
            "config": {"name": "SGD", "learning_rate": 0.01, "momentum": 0.0, "nesterov": False},
        },
        "dynamic": False,
        "initial_scale": 8.0,
        "dynamic_growth_steps": None,
    }
    legacy = LossScaleOptimizer.from_config(tf_keras)
    assert (legacy.dynamic, legacy.initial_scale, type(legacy.inner_optimizer).__name__) == (
        False,
        8.0,
        "SGD",
    )
    # TensorFlow <= 2.3's config
    old = {
        "optimizer": keras.saving.serialize_keras_object(keras.optimizers.SGD(0.1)),
        "loss_scale": {"class_name": "FixedLossScale", "config": {"loss_scale_value": 8.0}},
    }
    fixed = LossScaleOptimizer.from_config(old)
    assert (fixed.dynamic, fixed.initial_scale) == (False, 8.0)
    bad = {**old, "loss_scale": {"class_name": "DynamicLossScale", "config": {"multiplier": 3.0}}}
    with pytest.raises(ValueError, match="only 2 is supported"):
        LossScaleOptimizer.from_config(bad)


#: ``tf_keras.optimizers.serialize(LossScaleOptimizer(...))["config"]``, written by tf_keras
#: 2.21: a new-style inner optimizer (``jit_compile``, ``is_legacy_optimizer``) and a legacy one.
_TF_KERAS_221_V3 = {
    "inner_optimizer": {
        "module": "keras.optimizers",
        "class_name": "Adam",
        "config": {
            "name": "Adam",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.0010000000474974513,
            "beta_1": 0.9,
            "beta_2": 0.999,
            "epsilon": 1e-07,
            "amsgrad": False,
        },
        "registered_name": None,
    },
    "dynamic": True,
    "initial_scale": 32768.0,
    "dynamic_growth_steps": 2000,
}
_TF_KERAS_221_LEGACY = {
    "inner_optimizer": {
        "module": "keras.optimizers.legacy",
        "class_name": "SGD",
        "config": {
            "name": "SGD",
            "learning_rate": 0.01,
            "decay": 0.0,
            "momentum": 0.0,
            "nesterov": False,
        },
        "registered_name": None,
    },
    "dynamic": False,
    "initial_scale": 8.0,
    "dynamic_growth_steps": None,
}


def test_configs_written_by_tf_keras_2_21_load() -> None:
    v3 = LossScaleOptimizer.from_config(copy.deepcopy(_TF_KERAS_221_V3))
    assert (v3.dynamic, v3.initial_scale, v3.dynamic_growth_steps) == (True, 32768.0, 2000)
    assert isinstance(v3.inner_optimizer, keras.optimizers.Adam)
    assert float(_np(v3.inner_optimizer.learning_rate)) == np.float32(1e-3)
    legacy = LossScaleOptimizer.from_config(copy.deepcopy(_TF_KERAS_221_LEGACY))
    assert (legacy.dynamic, legacy.initial_scale) == (False, 8.0)
    assert isinstance(legacy.inner_optimizer, keras.optimizers.SGD)
    decayed = copy.deepcopy(_TF_KERAS_221_LEGACY)
    decayed["inner_optimizer"]["config"]["decay"] = 0.1  # type: ignore[index]
    with pytest.raises(ValueError, match=r"decay=0\.1.*learning-rate schedule"):
        LossScaleOptimizer.from_config(decayed)


def test_configs_written_by_the_installed_tf_keras_load() -> None:
    tf_keras = pytest.importorskip("tf_keras", reason="tf_keras is not installed")
    for inner in (tf_keras.optimizers.Adam(1e-3), tf_keras.optimizers.legacy.SGD(0.01)):
        theirs = tf_keras.mixed_precision.LossScaleOptimizer(inner, initial_scale=64.0)
        ours = LossScaleOptimizer.from_config(theirs.get_config())
        assert (ours.dynamic, ours.initial_scale) == (True, 64.0)
        assert type(ours.inner_optimizer).__name__ == type(inner).__name__


def test_model_save_and_load_keep_the_optimizer_and_its_state(tmp_path: Path) -> None:
    model = _model()
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**10, dynamic_growth_steps=2
    )
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(inf_rows=(8,))
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert float(_np(loaded.optimizer.loss_scale)) == float(_np(opt.loss_scale))
    assert loaded.optimizer.get_config() == opt.get_config()


# -- arguments and the stall alarm -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "pattern"),
    [
        (("sgd",), {}, TypeError, "inner_optimizer"),
        ((), {"dynamic": False}, ValueError, "initial_scale"),
        ((), {"dynamic": "dynamic"}, TypeError, "experimental"),
        ((), {"dynamic_growth_steps": 3.0}, TypeError, "dynamic_growth_steps"),
        ((), {"min_loss_scale": 0}, ValueError, "min_loss_scale"),
        ((), {"clipnorm": 1.0}, ValueError, "clipnorm"),
        ((), {"bogus": 1}, TypeError, "bogus"),
    ],
)
def test_bad_arguments_are_named(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    inner = keras.optimizers.SGD(0.1)
    with pytest.raises(error, match=pattern):
        LossScaleOptimizer(*(args or (inner,)), **kwargs)
    LossScaleOptimizer(inner)  # a failed constructor left the inner optimizer usable


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_pickle_and_deepcopy_give_the_same_configuration(how: str) -> None:
    """Keras pickles and copies an optimizer through its config (a fresh, unbuilt optimizer,
    as for Keras's own optimizers): the loss-scale settings, extensions and alarm carry over."""
    copy_fn = (lambda x: pickle.loads(pickle.dumps(x))) if how == "pickle" else copy.deepcopy
    opts = [
        LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=64.0, hysteresis=2),
        LossScaleOptimizer(keras.optimizers.SGD(0.1), False, 8.0, stall_steps=None),
        experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), "dynamic"),
    ]
    opts[0].apply(_grads(64.0, [1.0]), _variables([1.0]))  # built, with a state
    for opt in opts:
        copied = copy_fn(opt)
        assert isinstance(copied, LossScaleOptimizer) and copied is not opt
        assert copied.get_config() == opt.get_config()
        assert copied.inner_optimizer is not opt.inner_optimizer


def test_wrapping_twice_is_an_error() -> None:
    inner = keras.optimizers.SGD(0.1)
    outer = LossScaleOptimizer(inner)
    with pytest.raises(TypeError, match="another loss-scale optimizer"):
        LossScaleOptimizer(outer)
    with pytest.raises(ValueError, match="already wrapped"):
        LossScaleOptimizer(inner)


def test_stall_alarm() -> None:
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1.0, stall_steps=3)
    variables = _variables([1.0])
    for _ in range(4):
        opt.apply(_grads(1.0, [math.inf]), variables)
    with pytest.warns(LossScaleStalledWarning, match="last 4 steps"):
        opt.check_stall()
    strict = LossScaleOptimizer(
        keras.optimizers.SGD(0.0), initial_scale=1.0, stall_steps=2, on_stall="raise"
    )
    for _ in range(2):
        strict.apply(_grads(1.0, [math.inf]), variables)
    with pytest.raises(LossScaleStalledError):
        strict.dynamic_counter  # noqa: B018
    off = LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1.0, stall_steps=None)
    for _ in range(5):
        off.apply(_grads(1.0, [math.inf]), variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossScaleStalledWarning)
        off.check_stall()


def test_experimental_form() -> None:
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), "dynamic")
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 2.0**15, 2000)
    fixed = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), 128)
    assert fixed.get_config()["dynamic"] is False
    with pytest.raises(ValueError, match="Invalid value passed to loss_scale"):
        experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), None)


def test_experimental_form_converts_tensorflows_v1_loss_scales() -> None:
    tf = pytest.importorskip("tensorflow", reason="needs TensorFlow's v1 loss-scale classes")
    v1 = tf.compat.v1.mixed_precision
    opt = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), v1.DynamicLossScale(64, 3))
    assert (opt.dynamic, opt.initial_scale, opt.dynamic_growth_steps) == (True, 64.0, 3)
    fixed = experimental.LossScaleOptimizer(keras.optimizers.SGD(0.1), v1.FixedLossScale(8))
    assert (fixed.dynamic, fixed.initial_scale) == (False, 8.0)


# -- backend-specific ---------------------------------------------------------------------------


@pytest.mark.skipif(BACKEND != "jax", reason="stateless_apply is the JAX trainer's protocol")
def test_stateless_apply_under_jit() -> None:
    import jax

    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8.0)
    variables = _variables([1.0, 1.0])
    opt.build(variables)
    step = jax.jit(opt.stateless_apply)
    values = [v.value for v in variables]
    new_vars, new_opt = step([v.value for v in opt.variables], _grads(8.0, [2.0, 2.0]), values)
    assert np.asarray(new_vars[0]).tolist() == [0.0, 0.0]
    skipped_vars, skipped_opt = step(new_opt, _grads(8.0, [2.0, np.inf]), new_vars)
    assert np.asarray(skipped_vars[0]).tolist() == [0.0, 0.0]
    index = [id(v) for v in opt.variables].index(id(opt.dynamic_scale))
    assert float(new_opt[index]) == 8.0 and float(skipped_opt[index]) == 4.0  # backed off


_MIRRORED = """
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from lossscale.keras import LossScaleOptimizer
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**10)
    model.compile(optimizer=opt, loss="mse")
x = np.random.RandomState(0).randn(32, 4).astype("float32")
y = x.sum(1, keepdims=True)
x[1, 0] = np.inf  # one replica's half of the first batch overflows
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
finite = all(np.isfinite(w.numpy()).all() for w in model.weights)
print("RESULT", float(opt.dynamic_scale.numpy()), int(opt.iterations.numpy()), finite)
"""


@pytest.mark.skipif(BACKEND != "tensorflow", reason="run once, from the TensorFlow-backend process")
def test_mirrored_strategy_replicas_make_the_same_skip_decision() -> None:
    # TensorFlow's logical devices must be set before it initialises: a fresh process
    pytest.importorskip("tensorflow")
    import os
    import subprocess
    import sys

    env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _MIRRORED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))
    # one skip (the scale halved once, for both replicas), three applied steps, finite weights
    assert result.split()[1:] == ["512.0", "3", "True"]
