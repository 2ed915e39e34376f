"""``scripts/gpu_check.sh``, the GPU checks in one script: valid bash, its sections within ten
minutes in all, every test file it names present, and, without a CUDA device, a quick exit 2
that says so before anything runs. The sections themselves need a GPU (they run there)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
#: ``section NAME SECONDS COMMAND...``: one check and its time limit.
_SECTION = re.compile(r"^\s*section (?P<name>\w+) (?P<limit>\d+) ", re.MULTILINE)


def test_the_script_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_sections_fit_in_ten_minutes_and_name_files_that_exist() -> None:
    text = SCRIPT.read_text(encoding="utf-8")
    sections = {m["name"]: int(m["limit"]) for m in _SECTION.finditer(text)}
    expected = {"environment", "torch_cuda", "audit_cuda", "frameworks_cuda", "deepspeed_fp16"}
    expected.add("megatron_core")
    assert expected <= set(sections), sections
    assert sum(sections.values()) < 600, sections
    named = re.findall(r"\b((?:src|tests)/[\w/]+\.py)\b", text)
    assert "src/lossscale/deepspeed/_cuda_test.py" in named
    assert "src/lossscale/megatron/_distributed_optimizer_test.py" in named
    assert "src/lossscale/torch/_audit_test.py" in named
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
