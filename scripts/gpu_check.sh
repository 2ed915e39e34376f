#!/usr/bin/env bash
# The GPU checks in one run (issue 32 item 4), for a machine with a CUDA torch in python3 and no
# network: nothing is installed. Usage, from anywhere:
#   OUT=/some/folder bash scripts/gpu_check.sh     # results under $OUT (default: /tmp/lossscale_gpu_check)
# Writes $OUT/env.txt (nvidia-smi -L, torch/CUDA/numpy/pytest versions), $OUT/pytest_torch.xml
# and .log (the CUDA cases of the torch tests), $OUT/pytest_frameworks.log, $OUT/bench.txt and
# $OUT/torch_cuda.json (the quick torch benchmark on CUDA). Each step runs under `timeout`
# (7 minutes at most in all: 210 s, 60 s, 150 s), a failing step does not stop the next, and the script exits 0.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lossscale_gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
status() { echo "== $1: exit $2" | tee -a "$OUT/summary.txt"; }

# (c) the machine and the versions
{
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
  "$PY" - <<'PY' 2>&1
import importlib
for name in ("torch", "numpy", "pytest", "hypothesis", "lightning"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count())
    if torch.cuda.is_available():
        print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
except Exception as exc:  # noqa: BLE001
    print("torch.cuda:", exc)
PY
} > "$OUT/env.txt"
cat "$OUT/env.txt"

# (a) the CUDA cases of the torch tests, then the framework tests that have CUDA params
timeout 210 "$PY" -m pytest -q -p no:cacheprovider -rs --continue-on-collection-errors -k cuda \
  src/lossscale/torch \
  --junitxml="$OUT/pytest_torch.xml" 2>&1 | tee "$OUT/pytest_torch.log" | tail -n 40
status "pytest src/lossscale/torch -k cuda" "${PIPESTATUS[0]}"
frameworks=(tests/frameworks_skips_test.py)
if "$PY" -c "import lightning" 2>/dev/null; then
  frameworks+=(tests/frameworks_lightning_test.py)
else
  echo "lightning not importable: tests/frameworks_lightning_test.py left out" | tee -a "$OUT/summary.txt"
fi
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -rs --continue-on-collection-errors -k cuda \
  "${frameworks[@]}" \
  --junitxml="$OUT/pytest_frameworks.xml" 2>&1 | tee "$OUT/pytest_frameworks.log" | tail -n 20
status "pytest ${frameworks[*]} -k cuda" "${PIPESTATUS[0]}"

# (b) the quick torch benchmark on CUDA: the table on stdout, the JSON beside it
timeout 150 "$PY" -m benchmarks.torch_bench --quick --devices cuda --json "$OUT/torch_cuda.json" \
  > "$OUT/bench.txt" 2> "$OUT/bench.err"
status "benchmarks.torch_bench --quick --devices cuda" "$?"
cat "$OUT/bench.txt" "$OUT/bench.err"
"$PY" - "$OUT/torch_cuda.json" <<'PY' 2>&1 | tee -a "$OUT/bench.txt"
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as exc:  # noqa: BLE001
    sys.exit(f"no benchmark JSON: {exc}")
for r in rows:
    if r.get("syncs_per_step"):
        print(r["device"], r["set"], r["optimizer"], "syncs:", r["syncs_per_step"])
PY
echo "== results in $OUT"
exit 0
