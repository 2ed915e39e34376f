"""verl's FSDP2 engine with lossscale.verl on two gloo ranks on the CPU (the audit's plan on): a
step that overflows on one rank only is skipped on both (no rank's shard changes), both hold the
same scale, each rank saves and restores its own scale file, and the resumed scale is the
uninterrupted run's.

FSDP1 is not here: verl builds the model on rank 0 only and leaves the other ranks' weights to
``sync_module_states=True``, which torch's FSDP1 runs on an accelerator only (the one-rank
FSDP1 tests change it to False); ``scripts/gpu_check.sh`` runs FSDP1 on ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lossscale._testing import gloo_job_once
from lossscale.torch import audit
from lossscale.torch._audit import _testing as models
from lossscale.verl import _testing

STEPS = [False, True, False]  # the second step overflows, on rank 1 only


def _strategy(rank: int, folder: Path, strategy: str) -> dict[str, Any]:
    import lossscale.verl as lv

    with _testing.on_cpu(strategy):
        built = _testing.engine(str(folder / "model"), strategy, attention="eager")
        scales, unchanged = [], []
        for seed, overflow in enumerate(STEPS):
            before = _testing.parameters(built)
            _testing.train_step(built, seed, overflow=overflow and rank == 1)
            after = _testing.parameters(built)
            unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
            scales.append(built.scaler.get_scale())
        checkpoint = folder / strategy
        built.save_checkpoint(str(checkpoint), global_step=len(STEPS))
        resumed = _testing.engine(str(folder / "model"), strategy, attention="eager")
        resumed.load_checkpoint(str(checkpoint))
        torch.distributed.barrier()
        return {
            "scales": scales,
            "skipped": int(built.scaler.skipped_steps),
            "epochs": built.lr_scheduler.last_epoch,
            "resumed": resumed.scaler.get_scale(),
            "unchanged": unchanged,
            "file": os.path.exists(lv.checkpoint_file(str(checkpoint), 2, rank)),
        }


def _job(rank: int, world: int) -> dict[str, Any]:
    folder = Path(os.environ["LOSSSCALE_VERL_TEST_FOLDER"])
    os.environ["LOSSSCALE_PLAN"] = str(folder / "plan.json")
    _testing.cpu_platform()
    return {"fsdp2": _strategy(rank, folder, "fsdp2")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("verl2")
    models.attention_logits_failure(models.llama()).save_pretrained(folder / "model")
    result = audit(
        models.attention_logits_failure(models.llama()),
        models.token_sum_loss,
        models.batches(2),
        mode="half",
    )
    result.save(folder / "plan.json")
    os.environ["LOSSSCALE_VERL_TEST_FOLDER"] = str(folder)  # the spawned ranks inherit it
    try:
        results = gloo_job_once(_job, 2, 300, tmp_path_factory)
    finally:
        del os.environ["LOSSSCALE_VERL_TEST_FOLDER"]
    return {"ranks": results, "start": result.initial_scale}


def test_two_ranks_skip_together_agree_and_resume_their_scale(ranks: dict[str, Any]) -> None:
    first, second = (rank["fsdp2"] for rank in ranks["ranks"])
    start = ranks["start"]  # the plan's initial scale
    assert first["scales"] == second["scales"] == [start, start / 2, start / 2]
    assert first["skipped"] == second["skipped"] == 1
    assert first["epochs"] == second["epochs"] == 2  # the skipped step left the LR schedule
    assert first["resumed"] == second["resumed"] == start / 2
    assert first["file"] and second["file"]
    # only the overflowing step left every rank's shard as it was
    assert first["unchanged"] == second["unchanged"] == [False, True, False]
