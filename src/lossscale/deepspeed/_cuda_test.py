"""lossscale in DeepSpeed engines on a CUDA device: the ``fp16`` path on every ZeRO stage, and
ZeRO 0 with DeepSpeed's ``FusedAdam``, around which DeepSpeed builds ``FP16_Optimizer`` (the CPU
never takes that path with the real kernel; ``_engine_test.py`` runs it there with a stand-in
of ``FusedAdam``'s type). The same runs and assertions as the CPU tests: lossscale's rule with
DeepSpeed's hysteresis on every stage, DeepSpeed's own rule on ZeRO 0, the floor.

Runs where a CUDA device is present (``bash scripts/gpu_check.sh`` runs it), skipped with the
reason elsewhere. The engines train in a fresh process on one rank over NCCL, so that DeepSpeed's
process-wide state stays out of the test process. ``FusedAdam`` is compiled on first use when
DeepSpeed was installed without its ops (``DS_BUILD_OPS=0``): that needs the CUDA toolkit
(``nvcc``) and takes a minute or two; without it these tests fail, naming the build's error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("DeepSpeed's CUDA paths need a CUDA device", allow_module_level=True)
pytest.importorskip("deepspeed")

from lossscale._testing import free_port

#: As in _engine_test.py: W=2, H=2, 2**8: growth, absorbed overflows and back-offs.
RULE = {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
FLAGS = "..L.LL...."
EXPECTED = [256, 512, 512, 512, 256, 128, 128, 256, 256, 512]
CASES = [(0, "fused"), (0, "sgd"), (1, "sgd"), (2, "sgd"), (3, "sgd")]


def _job() -> dict[Any, Any]:
    """Every run, in this (fresh) process: one rank, NCCL, DeepSpeed's CUDA accelerator."""
    import deepspeed
    from deepspeed.utils import logger

    from lossscale.deepspeed._testing import run

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    logger.setLevel("ERROR")
    deepspeed.init_distributed("nccl")
    torch.cuda.set_device(0)
    out: dict[Any, Any] = {}
    for stage, optimizer in CASES:
        for who, ls in (("deepspeed", None), ("lossscale", {})):
            out["rule", stage, optimizer, who] = run(
                stage, "fp16", FLAGS, ls, optimizer=optimizer, **RULE
            )
    for who, alarm in (("deepspeed", None), ("lossscale", {"stall_steps": 3})):
        out["floor", who] = run(0, "fp16", "LLLLLL", alarm, optimizer="fused",
                                initial_scale_power=1, hysteresis=1)  # fmt: skip
    return out


def main(path: str) -> None:
    """The child process's entry: run :func:`_job` and save its results to ``path``."""
    result = _job()
    for run in result.values():  # CUDA tensors: saved on the CPU, loaded without a device
        run["weights"] = [[w.cpu() for w in ws] for ws in run["weights"]]
    torch.save(result, path)
    os._exit(0)  # without NCCL's and DeepSpeed's teardown at exit


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    path = tmp_path_factory.mktemp("deepspeed_cuda") / "runs.pt"
    code = f"from lossscale.deepspeed._cuda_test import main; main({str(path)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=400, check=False
    )
    assert proc.returncode == 0 and Path(path).exists(), proc.stdout[-4000:] + proc.stderr[-8000:]
    return dict(torch.load(path, weights_only=False))


def _equal_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        torch.equal(x, y) for wa, wb in zip(a["weights"], b["weights"], strict=True)
        for x, y in zip(wa, wb, strict=True)
    )  # fmt: skip


def test_lossscale_rule_on_every_stage_and_in_fp16_optimizer(runs: dict[Any, Any]) -> None:
    for stage, optimizer in CASES:
        ours = runs["rule", stage, optimizer, "lossscale"]
        assert ours["error"] is None, (stage, optimizer, ours["error"])
        assert ours["scale"] == EXPECTED, (stage, optimizer)
        assert ours["skipped"] == [0, 0, 1, 1, 2, 3, 3, 3, 3, 3]
        assert ours["applied"] == [flag == "." for flag in FLAGS]
        assert ours["last_epoch"] == [1, 2, 2, 3, 3, 3, 4, 5, 6, 7]
    assert runs["rule", 0, "fused", "lossscale"]["optimizer"] == "FP16_Optimizer"
    assert runs["rule", 0, "sgd", "lossscale"]["optimizer"] == "FP16_UnfusedOptimizer"
    first = runs["rule", 1, "sgd", "lossscale"]
    for stage in (0, 2, 3):  # SGD: ZeRO 0's updates are ZeRO 1's
        assert _equal_weights(runs["rule", stage, "sgd", "lossscale"], first), stage


def test_deepspeeds_own_rule_on_zero0_and_its_floor(runs: dict[Any, Any]) -> None:
    for optimizer in ("fused", "sgd"):
        theirs = runs["rule", 0, optimizer, "deepspeed"]
        assert theirs["scale"][2] == 128, optimizer  # hysteresis ignored on ZeRO 0
    assert runs["rule", 1, "sgd", "deepspeed"]["scale"] == [
        256, 256, 256, 256, 128, 64, 64, 64, 128, 128
    ]  # fmt: skip
    ds, ours = runs["floor", "deepspeed"], runs["floor", "lossscale"]
    assert ds["optimizer"] == ours["optimizer"] == "FP16_Optimizer"
    assert ds["error"] is None and ds["skipped"] == [1, 2, 3, 4, 5, 6]
    assert ours["error"] is None and ours["scale"] == [1.0] * 6
    assert len([w for w in ours["warnings"] if w.startswith("LossScaleStalledWarning")]) == 1
