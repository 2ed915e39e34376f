"""A model saved with ``lossscale.keras.LossScaleOptimizer`` loads in a fresh process that
imported ``lossscale.keras`` (docs/keras.md, "Saving and loading"), on this process's backend.

Keras 3 imports no module outside its own packages when it loads a file, so the registration
(``lossscale>LossScaleOptimizer``) exists only once ``lossscale.keras`` is imported; without
that import Keras fails with its own "Could not locate class" (shown here, so that a Keras
release that changes this is noticed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from lossscale.keras import LossScaleOptimizer  # noqa: E402

BACKEND = keras.backend.backend()
SRC = Path(__file__).resolve().parents[2]

_LOAD = """
import sys
import keras
if sys.argv[2] == "import":
    import lossscale.keras
model = keras.models.load_model(sys.argv[1])
opt = model.optimizer
print(type(opt).__module__, type(opt).__name__,
      float(keras.ops.convert_to_numpy(opt.loss_scale)), opt.dynamic_counter)
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, int]:
    path = tmp_path_factory.mktemp("saved") / "model.keras"
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=64.0, hysteresis=2)
    model.compile(optimizer=opt, loss="mse")
    x = np.ones((8, 2), np.float32)
    model.fit(x, x.sum(1, keepdims=True), batch_size=4, epochs=1, verbose=0)
    model.save(path)
    return path, float(keras.ops.convert_to_numpy(opt.loss_scale)), int(opt.dynamic_counter)


def _load_in_a_fresh_process(path: Path, how: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", _LOAD, str(path), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_the_saved_name_is_the_registered_one(saved: tuple[Path, float, int]) -> None:
    with zipfile.ZipFile(saved[0]) as archive:
        config = json.loads(archive.read("config.json"))
    optimizer = config["compile_config"]["optimizer"]
    assert optimizer["registered_name"] == "lossscale>LossScaleOptimizer"
    assert optimizer["config"]["hysteresis"] == 2


def test_a_fresh_process_that_imports_lossscale_keras_loads_it(
    saved: tuple[Path, float, int],
) -> None:
    path, scale, counter = saved
    done = _load_in_a_fresh_process(path, "import")
    assert done.returncode == 0, done.stderr[-3000:]
    module, name, loaded_scale, loaded_counter = done.stdout.split()[-4:]
    assert (module, name) == ("lossscale.keras._optimizer", "LossScaleOptimizer")
    assert (float(loaded_scale), int(loaded_counter)) == (scale, counter)
    assert counter == 2  # the state is the trained one, not the initial one


def test_without_the_import_keras_cannot_locate_the_class(
    saved: tuple[Path, float, int],
) -> None:
    done = _load_in_a_fresh_process(saved[0], "no-import")
    assert done.returncode != 0
    assert "Could not locate class 'LossScaleOptimizer'" in done.stderr
