"""verl 0.9's FSDP engines with lossscale.verl on a CUDA GPU, as verl runs them (no CPU
platform, FSDP1 and FSDP2 as verl calls them, one NCCL rank): the scaler verl builds, a
skipped step with the LR schedule held, the scale through a checkpoint, and the audit's plan
keeping its modules in float32. Skipped without CUDA; ``scripts/gpu_check.sh`` runs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import lossscale.verl as lv
from lossscale.torch import audit
from lossscale.torch._audit import _testing as models
from lossscale.verl import _testing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _testing.cuda_platform()  # verl's own, whatever an earlier test module set
    torch.cuda.set_device(0)
    with _testing.process_group("nccl"):
        yield _testing.tiny_llama(str(tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_verl_on_cuda_builds_steps_skips_and_resumes(
    model_path: str, strategy: str, tmp_path: Path
) -> None:
    scaler = _testing.engine(model_path, strategy).scaler
    assert type(scaler) is lv.ShardedGradScaler and isinstance(scaler, TorchSharded)
    assert scaler.current_loss_scale().device.type == "cuda"
    assert (scaler.get_growth_interval(), scaler.get_scale()) == (400, 2.0**16)
    run = _testing.skip_run(model_path, strategy)
    assert run["weights"] and run["moments"] and run["epochs"] == 0
    assert run["scale"] == 2.0**15 and run["final_epoch"] == 2
    uninterrupted, resumed, files = _testing.resume_run(model_path, strategy, str(tmp_path))
    assert uninterrupted == resumed == 2.0**15
    assert "lossscale_scaler_world_size_1_rank_0.pt" in files


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_the_plan_on_cuda(
    model_path: str, strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models.attention_logits_failure(models.llama()).save_pretrained(tmp_path / "model")
    result = audit(
        models.attention_logits_failure(models.llama()),
        models.token_sum_loss,
        models.batches(2),
        mode="half",
    )
    result.save(tmp_path / "plan.json")
    outcomes: dict[str, Any] = {}
    for planned in (False, True):
        if planned:
            monkeypatch.setenv("LOSSSCALE_PLAN", str(tmp_path / "plan.json"))
        built = _testing.engine(str(tmp_path / "model"), strategy, attention="eager")
        for seed in range(2):
            _testing.train_step(built, seed)
        outcomes[str(planned)] = int(built.scaler.skipped_steps)
    assert outcomes == {"False": 2, "True": 0}
