#!/usr/bin/env bash
# One entry point for the README's commands. It creates .venv on first use and installs what the
# command needs, pinned by constraints.txt (torch==2.13.0 CPU, tensorflow-cpu 2.21, jax 0.10.2).
#   bash scripts/dev.sh demo [demo args]   # set up (NumPy only) and run the demo
#   bash scripts/dev.sh test [pytest args] # set up everything and run ruff, mypy and pytest
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LOSSSCALE_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q -c constraints.txt "$@"; }
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    pip_install -e .
    exec "$VENV/bin/python" -m lossscale demo "$@"
    ;;
  test)
    # DS_BUILD_OPS=0: DeepSpeed installs without compiling its C++/CUDA ops (none is needed)
    DS_BUILD_OPS=0 pip_install -e ".[test,torch,jax,flax,tf,keras,frameworks,docs,bench,deepspeed,megatron,accelerate]"
    # timm without its dependencies: PyPI's torchvision fails beside the CPU torch wheel
    pip_install --no-deps timm
    "$VENV/bin/ruff" check src tests benchmarks examples docs
    "$VENV/bin/ruff" format --check src tests benchmarks examples docs
    "$VENV/bin/mypy"
    # Keras picks its backend at import: the main run uses TensorFlow's (Keras's default), and
    # the Keras tests run again once per other backend, each in its own process.
    # --durations=15: the slowest tests of the run, printed at its end
    KERAS_BACKEND=tensorflow "$VENV/bin/python" -m pytest --durations=15 "$@"
    if [ $# -eq 0 ] && [ -d src/lossscale/keras ]; then
      for backend in jax torch; do
        echo "== Keras tests on the $backend backend"
        KERAS_BACKEND=$backend "$VENV/bin/python" -m pytest src/lossscale/keras
      done
    fi
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2
    exit 2
    ;;
esac
