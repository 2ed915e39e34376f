"""``scripts/gpu_check.sh``, the GPU checks in one script: valid bash, its sections' limits
within 640 s in all (the budget of one lent GPU machine's run), every test file and benchmark
module it names present, and, without a CUDA device, a quick exit 2 that says so before
anything runs. The sections themselves need a GPU (they run there); the GPT-2 side by side
runs here too, tiny, on the CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
#: The whole script's budget in seconds: its sections' limits add up to less.
BUDGET_S = 640
#: The sections that run as a command of their own, outside the budget (their framework is not
#: in the lent machine's image).
OWN_COMMAND = ("vllm_cuda",)
#: ``section NAME SECONDS COMMAND...``: one check and its time limit.
_SECTION = re.compile(r"^\s*section (?P<name>\w+) (?P<limit>\d+) ", re.MULTILINE)


def test_the_script_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_sections_fit_in_the_budget_and_name_files_that_exist() -> None:
    text = SCRIPT.read_text(encoding="utf-8")
    sections = {m["name"]: int(m["limit"]) for m in _SECTION.finditer(text)}
    # vLLM's CUDA build is not in the GPU image: its section runs as a command of its own
    own_command = {name: sections.pop(name) for name in OWN_COMMAND}
    assert all(limit <= 600 - 10 for limit in own_command.values()), own_command
    expected = {"environment", "torch_cuda", "audit_cuda", "frameworks_cuda", "deepspeed_fp16"}
    expected |= {"megatron_core", "torch_bench", "gpt2_side_by_side", "audit_bench_160m"}
    assert expected <= set(sections), sections
    assert sum(sections.values()) <= BUDGET_S - 10, sections  # 10 s: the CUDA check, the table
    assert sections["environment"] >= 45  # first imports of deepspeed and megatron-core: > 20 s
    modules = re.findall(r"-m (benchmarks\.\w+)", text)
    assert {"benchmarks.gpt2_side_by_side", "benchmarks.audit_bench"} <= set(modules)
    missing_modules = [m for m in modules if not (ROOT / (m.replace(".", "/") + ".py")).is_file()]
    assert not missing_modules, missing_modules
    named = re.findall(r"\b((?:src|tests)/[\w/]+\.py)\b", text)
    assert "src/lossscale/deepspeed/_cuda_test.py" in named
    assert "src/lossscale/megatron/_distributed_optimizer_test.py" in named
    assert "src/lossscale/torch/_audit" in re.findall(r"-k cuda (src/[\w/]+)$", text, re.M)
    assert "src/lossscale/verl/_cuda_test.py" in named
    assert "src/lossscale/vllm/_cuda_test.py" in named
    missing = [path for path in named if not (ROOT / path).is_file()]
    assert not missing, missing


def test_without_cuda_it_says_so_and_exits_2_at_once(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run its checks")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    start = time.monotonic()
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA device" in result.stderr and "nothing was run" in result.stderr
    assert result.stdout == ""  # no section started
    assert time.monotonic() - start < 60


def test_only_names_sections_and_a_wrong_name_is_refused_at_once(tmp_path: Path) -> None:
    """ONLY="a b" runs those sections alone (the others are "not run: not in ONLY"); a name
    that is no section exits 2 before anything runs, with or without a GPU."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        env={**env, "ONLY": "environment deepspeed_fp16 no_such_section"},
        timeout=120,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert "ONLY names 'no_such_section', which is not a section" in result.stderr
    assert "verl_cuda" in result.stderr and "gpt2_side_by_side" in result.stderr
    text = SCRIPT.read_text(encoding="utf-8")
    assert '[[ " $ONLY " != *" $name "* ]]' in text


def test_the_arch_list_is_set_from_the_device_unless_set() -> None:
    """DeepSpeed's op builder fails on torch's 9.0a (DeepSpeed #7589): the script exports
    TORCH_CUDA_ARCH_LIST from the device's capability when the user has not set it."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert 'if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then' in text
    assert "export TORCH_CUDA_ARCH_LIST=$capability" in text
    assert "torch.cuda.get_device_capability()" in text


def test_the_gpt2_side_by_side_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    """The script the ``gpt2_side_by_side`` section runs, in its quick mode: a 2-layer GPT-2,
    12 float16 steps from 2**24 (both scalers skip and back off), lossscale's losses and
    scales bit-equal to torch's with and without ``device_side_skip``, host reads counted."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "gpt2.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpt2_side_by_side", "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text(encoding="utf-8"))
    variants = report["variants"]
    assert set(variants) == {"torch", "lossscale", "lossscale_device_skip"}
    assert report["steps"] == 12 and report["device"] == "cpu"
    for name, row in variants.items():
        assert row["losses_bit_equal"] and row["scales_equal"], name
        assert row["skipped"] == variants["torch"]["skipped"] > 0
        assert row["step_time_over_torch"] > 0
    assert variants["torch"]["syncs_per_step"]["local_scalar_dense"] == 0
    assert variants["lossscale"]["syncs_per_step"]["local_scalar_dense"] == 1
    assert variants["torch"]["syncs_per_step"]["cuda_sync_debug"] is None  # CUDA only
    assert report["bare_syncs_per_step"]["local_scalar_dense"] == 0
    assert "| lossscale_device_skip | yes | yes |" in result.stdout


def test_the_gpt2_side_by_side_full_size_is_the_one_measured() -> None:
    from benchmarks.gpt2_side_by_side import SIZES, VARIANTS

    assert SIZES["full"] == (6, 512, 8, 50257, 16, 256, 150, 2.0**16)
    assert VARIANTS == ("torch", "lossscale", "lossscale_device_skip")
