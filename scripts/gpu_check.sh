#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA torch in python3 (no network needed:
# nothing is installed). Usage, from anywhere:
#   OUT=/some/folder bash scripts/gpu_check.sh     # logs under $OUT (default: /tmp/lossscale_gpu_check)
#   ONLY="deepspeed_fp16 verl_cuda" bash scripts/gpu_check.sh   # only the sections named
#
# Each check is one section: a name, a time limit and a command, run by `section` below; its
# output goes to $OUT/<name>.log and its result to one row of the table printed at the end
# (also in $OUT/table.md). A section whose framework is missing is "not run" with the reason.
# To add a check, add one `section` line (with its own time limit) before the table.
#
# Exit status: 0 when every section that ran passed; 1 when one failed or ran out of time
# (the table says which, the log says why); 2 at once, before anything runs, without a CUDA
# device, or when ONLY names a section the script has not. The limits add up to 630 s on one
# GPU, vllm_cuda aside (a command of its own where vLLM's CUDA build is installed) (DeepSpeed may first compile its FusedAdam kernel, which needs nvcc: about a minute
# within its limit); where one command may run 600 s at most, run it in two with ONLY (the
# sections verl_cuda and audit_bench_160m, then the rest).
#
# TORCH_CUDA_ARCH_LIST: when unset, set from the device (9.0 on an H100/H200): DeepSpeed's JIT
# op builder parses each entry with int() and fails on torch's arch-specific 9.0a (DeepSpeed
# #7589); lossscale.deepspeed.set_cuda_arch_list() does the same for users.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lossscale_gpu_check}
PY=${PYTHON:-python3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

if [ -n "${ONLY:-}" ]; then
  known=$(grep -oE '^ *section [a-z0-9_]+' "$0" | awk '{print $2}')
  for name in $ONLY; do
    if ! grep -qx "$name" <<< "$known"; then
      echo "gpu_check: ONLY names '$name', which is not a section: $(echo $known)" >&2
      exit 2
    fi
  done
fi

if ! capability=$("$PY" -c 'import sys, torch
sys.exit(1) if not torch.cuda.is_available() else print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null); then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False, or torch is missing):" >&2
  echo "gpu_check: these checks need a CUDA GPU; nothing was run." >&2
  exit 2
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  export TORCH_CUDA_ARCH_LIST=$capability
fi

rows=()     # one "| name | result | seconds |" per section
failed=0

# section NAME SECONDS COMMAND...: run COMMAND under a time limit, its output in $OUT/NAME.log
# (the last lines echoed); record passed / FAILED (exit N) / TIMED OUT.
section() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    rows+=("| $name | not run: not in ONLY | 0 |")
    return
  fi
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
# First imports of deepspeed and megatron-core take 20 s or more on a fresh machine.
section environment 45 "$PY" - <<'PY'
import importlib, os, torch
print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST"))
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
section torch_cuda 125 "${PYTEST[@]}" -k cuda --ignore=src/lossscale/torch/_audit src/lossscale/torch

# The float16 audit on CUDA: its tests on Hugging Face models (each kind of failure, the plan,
# the range, the run from initial_scale).
if importable transformers; then
  section audit_cuda 45 "${PYTEST[@]}" -k cuda src/lossscale/torch/_audit
else
  not_run audit_cuda "transformers not importable (pip install -e '.[frameworks]')"
fi

frameworks=(tests/frameworks_skips_test.py)
importable lightning && frameworks+=(tests/frameworks_lightning_test.py)
section frameworks_cuda 40 "${PYTEST[@]}" -k cuda "${frameworks[@]}"

# DeepSpeed's fp16 paths on CUDA: ZeRO 1-3, and ZeRO 0 with its fused FP16_Optimizer (FusedAdam).
if importable deepspeed; then
  section deepspeed_fp16 95 "${PYTEST[@]}" src/lossscale/deepspeed/_cuda_test.py
else
  not_run deepspeed_fp16 "deepspeed not importable (pip install -e '.[deepspeed]')"
fi

# The Megatron scalers in megatron-core's own optimizers: Float16Optimizer, ChainedOptimizer and
# the DistributedOptimizer.
if importable megatron.core.optimizer; then
  section megatron_core 40 "${PYTEST[@]}" src/lossscale/megatron/_megatron_core_test.py \
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
section torch_bench 30 "$PY" -m benchmarks.torch_bench --quick --devices cuda \
  --json "$OUT/torch_cuda.json"

# A GPT-2 (6 layers, width 512, 16 x 256 tokens, fused AdamW, unscale_ + clipping) trained 150
# float16 steps with lossscale's GradScaler (device_side_skip off and on) and torch's: the
# losses bit-equal (else it fails), the step-time ratio, the host syncs per step.
if importable transformers; then
  section gpt2_side_by_side 40 "$PY" -m benchmarks.gpt2_side_by_side --device cuda \
    --json "$OUT/gpt2_side_by_side.json"
else
  not_run gpt2_side_by_side "transformers not importable (pip install -e '.[frameworks]')"
fi

# The audit's cost per batch against a float16 and a float32 step, with its host reads, at the
# benchmark's size and on a Llama of about 160M parameters at 8 x 512 tokens.
if importable transformers; then
  section audit_bench_160m 70 "$PY" -m benchmarks.audit_bench --device cuda --large --rounds 3
else
  not_run audit_bench_160m "transformers not importable (pip install -e '.[frameworks]')"
fi

# verl 0.9's FSDP engines on lossscale's scaler, as verl builds them on a GPU (FSDP1 and FSDP2,
# one NCCL rank): the scaler, a skipped step with the LR held, a resume, the audit's plan.
if importable verl; then
  section verl_cuda 60 "${PYTEST[@]}" src/lossscale/verl/_cuda_test.py
else
  not_run verl_cuda "verl not importable (pip install -c constraints-verl.txt -e '.[verl]')"
fi

# lossscale.vllm on CUDA: the planned float16 engine (eager, and with vLLM's torch.compile and
# CUDA graphs) against the trainer's autocast-with-plan forward on the GPU, and the engine in a
# Ray worker given LOSSSCALE_PLAN in its runtime_env only, as verl runs its rollouts (verl 0.9.1
# itself pins vLLM 0.24 and transformers<5.11, which no vLLM 0.32 environment meets). vLLM's
# CUDA build is not in this project's GPU image: where vLLM 0.32 is installed, run this section
# as a command of its own (ONLY=vllm_cuda); its limit is outside the 630 s above.
if importable vllm; then
  section vllm_cuda 300 "${PYTEST[@]}" src/lossscale/vllm/_cuda_test.py
else
  not_run vllm_cuda "vllm not importable (vLLM 0.32's CUDA build: pip install -e '.[vllm]' ray)"
fi

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
