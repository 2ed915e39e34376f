#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA torch in python3 (no network needed:
# nothing is installed). Usage, from anywhere:
#   OUT=/some/folder bash scripts/gpu_check.sh     # logs under $OUT (default: /tmp/lossscale_gpu_check)
#
# Each check is one section: a name, a time limit and a command, run by `section` below; its
# output goes to $OUT/<name>.log and its result to one row of the table printed at the end
# (also in $OUT/table.md). A section whose framework is missing is "not run" with the reason.
# To add a check, add one `section` line (with its own time limit) before the table.
#
# Exit status: 0 when every section that ran passed; 1 when one failed or ran out of time
# (the table says which, the log says why); 2 at once, before anything runs, without a CUDA
# device. The limits add up to 595 s on one GPU (DeepSpeed may first compile its FusedAdam
# kernel, which needs nvcc: a minute or two within its limit).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lossscale_gpu_check}
PY=${PYTHON:-python3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False, or torch is missing):" >&2
  echo "gpu_check: these checks need a CUDA GPU; nothing was run." >&2
  exit 2
fi

rows=()     # one "| name | result | seconds |" per section
failed=0

# section NAME SECONDS COMMAND...: run COMMAND under a time limit, its output in $OUT/NAME.log
# (the last lines echoed); record passed / FAILED (exit N) / TIMED OUT.
section() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): $*"
  local start=$SECONDS status result
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  status=$?
  tail -n 15 "$OUT/$name.log"
  case $status in
    0) result="passed" ;;
    124 | 137) result="TIMED OUT after ${limit} s"; failed=1 ;;
    *) result="FAILED (exit $status, see $OUT/$name.log)"; failed=1 ;;
  esac
  rows+=("| $name | $result | $((SECONDS - start)) |")
}

# not_run NAME REASON: a section whose framework is missing here
not_run() {
  echo "== $1: not run: $2"
  rows+=("| $1 | not run: $2 | 0 |")
}

importable() { "$PY" -c "import $1" > /dev/null 2>&1; }

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)

# -- the machine -------------------------------------------------------------------------------
section environment 20 "$PY" - <<'PY'
import importlib, torch
print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for name in ("numpy", "pytest", "deepspeed", "megatron.core", "lightning", "transformers", "accelerate", "trl"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
PY

# -- the sections ------------------------------------------------------------------------------
# lossscale.torch on CUDA: the fused unscale-and-check kernel (torch's
# _amp_foreach_non_finite_check_and_unscale_) against torch's GradScaler, fused optimizers with
# grad_scale/found_inf, host syncs; every CUDA case of the torch tests.
section torch_cuda 170 "${PYTEST[@]}" -k "cuda and not _audit" src/lossscale/torch

# The float16 audit on CUDA: its tests on Hugging Face models (each kind of failure, the plan,
# the range, the run from initial_scale), then its cost against a float16 and a float32 step.
if importable transformers; then
  section audit_cuda 60 bash -c "${PYTEST[*]} -k cuda src/lossscale/torch/_audit_test.py \
    && $PY -m benchmarks.audit_bench --device cuda --rounds 3"
else
  not_run audit_cuda "transformers not importable (pip install -e '.[frameworks]')"
fi

frameworks=(tests/frameworks_skips_test.py)
importable lightning && frameworks+=(tests/frameworks_lightning_test.py)
section frameworks_cuda 60 "${PYTEST[@]}" -k cuda "${frameworks[@]}"

# DeepSpeed's fp16 paths on CUDA: ZeRO 1-3, and ZeRO 0 with its fused FP16_Optimizer (FusedAdam).
if importable deepspeed; then
  section deepspeed_fp16 145 "${PYTEST[@]}" src/lossscale/deepspeed/_cuda_test.py
else
  not_run deepspeed_fp16 "deepspeed not importable (pip install -e '.[deepspeed]')"
fi

# The Megatron scalers in megatron-core's own optimizers: Float16Optimizer, ChainedOptimizer and
# the DistributedOptimizer.
if importable megatron.core.optimizer; then
  section megatron_core 60 "${PYTEST[@]}" src/lossscale/megatron/_megatron_core_test.py \
    src/lossscale/megatron/_distributed_optimizer_test.py
else
  not_run megatron_core "megatron-core not importable (it needs Python >= 3.12)"
fi

# lossscale.accelerate on CUDA: install replacing the GradScaler Accelerate builds, Accelerate's
# FSDP2 save_state/load_state (accelerate#4289: the scale comes back as saved), TRL's GRPO (where
# trl is installed). 36 s on an H200 with trl, about 20 s without.
if importable accelerate; then
  section accelerate_cuda 40 "${PYTEST[@]}" src/lossscale/accelerate/_cuda_test.py
else
  not_run accelerate_cuda "accelerate not importable (pip install -e '.[accelerate]')"
fi

# The quick torch benchmark on CUDA (its table in the log, the JSON beside it).
section torch_bench 40 "$PY" -m benchmarks.torch_bench --quick --devices cuda \
  --json "$OUT/torch_cuda.json"

# -- the table ---------------------------------------------------------------------------------
{
  echo "| check | result | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$OUT/table.md"
echo
echo "== lossscale GPU check: $(head -n 1 "$OUT/environment.log" 2>/dev/null)"
cat "$OUT/table.md"
echo "== logs in $OUT"
exit "$failed"
