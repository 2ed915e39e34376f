"""``lossscale.accelerate.install`` on a CUDA GPU, where Accelerate builds torch's scaler itself
(skipped without CUDA; ``scripts/gpu_check.sh`` runs it):

* a float16 loop on an Accelerator: ``install`` replaces the ``torch.amp.GradScaler`` Accelerate
  built, and the run (an inf planted at one step) equals Accelerate's own bit for bit;
* Accelerate's FSDP2 ``save_state``/``load_state`` (one process, NCCL): with Accelerate's own
  scaler the load moves the scale (accelerate#4289); with ``install`` it comes back as saved;
* TRL's ``GRPOTrainer(fp16=True)`` on the GPU: the same losses and scales as with Accelerate's
  own scaler, the scale in the logs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradScalerKwargs

from lossscale._testing import free_port
from lossscale.accelerate import AcceleratorGradScaler, install

HANDLER = GradScalerKwargs(init_scale=1024.0, growth_interval=3)


def _fresh(**kwargs: Any) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(mixed_precision="fp16", kwargs_handlers=[HANDLER], **kwargs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _steps(accelerator: Accelerator, model: Any, opt: Any, steps: range, inf_at: int = -1) -> None:
    for step in steps:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).cuda()
        accelerator.backward(model(x).float().square().mean())
        if step == inf_at:
            next(model.parameters()).grad.view(-1)[0] = math.inf
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def _loop(mode: str) -> tuple[list[Any], list[float]]:
    accelerator = _fresh()
    assert type(accelerator.scaler) is torch.amp.GradScaler  # what Accelerate builds on a GPU
    if mode == "lossscale":
        assert type(install(accelerator)) is AcceleratorGradScaler
    model = _model()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    scales = []
    for step in range(6):
        _steps(accelerator, model, opt, range(step, step + 1), inf_at=2)
        scales.append(accelerator.scaler.get_scale())
    return [p.detach().cpu() for p in model.parameters()], scales


def test_install_replaces_accelerate_scaler_and_runs_as_it() -> None:
    ours, theirs = _loop("lossscale"), _loop("accelerate")
    assert ours[1] == theirs[1] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0], strict=True))


def _fsdp2_save_load(
    mode: str, where: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], dict[str, Any]]:
    def build() -> tuple[Accelerator, Any, Any]:
        accelerator = _fresh(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        assert accelerator.is_fsdp2
        if mode == "lossscale":
            install(accelerator)
        model = _model()
        model, opt = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        return accelerator, model, opt

    # one process of a launcher's run; the variables (and the one Accelerate sets for FSDP)
    # are put back after the test
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(free_port()), "ACCELERATE_USE_FSDP": ""}.items():
        monkeypatch.setenv(name, value)
    try:
        accelerator, model, opt = build()
        _steps(accelerator, model, opt, range(2))
        saved = accelerator.scaler.state_dict()
        accelerator.save_state(str(where))
        accelerator, model, opt = build()
        accelerator.load_state(str(where))
        return saved, accelerator.scaler.state_dict()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_fsdp2_load_state_keeps_the_scale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ("scale", "_growth_tracker")
    theirs = _fsdp2_save_load("accelerate", tmp_path / "accelerate", monkeypatch)
    ours = _fsdp2_save_load("lossscale", tmp_path / "lossscale", monkeypatch)
    assert {k: theirs[0][k] for k in keys} == {"scale": 1024.0, "_growth_tracker": 2}
    assert {k: theirs[1][k] for k in keys} == {"scale": 2048.0, "_growth_tracker": 0}  # #4289
    assert (
        {k: ours[1][k] for k in keys}
        == {k: ours[0][k] for k in keys}
        == {
            "scale": 1024.0,
            "_growth_tracker": 2,
        }
    )


def test_grpo_on_the_gpu_as_with_accelerate_scaler(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    from lossscale.accelerate._testing import grpo_trainer, tiny_llama

    def run(mode: str) -> list[dict[str, Any]]:
        trainer = grpo_trainer(tiny_llama(), str(tmp_path / mode), use_cpu=False)
        assert type(trainer.accelerator.scaler) is torch.amp.GradScaler
        if mode == "lossscale":
            install(trainer, init_scale=2.0**10, growth_interval=2)
        else:
            trainer.accelerator.scaler = torch.amp.GradScaler(
                "cuda", init_scale=2.0**10, growth_interval=2
            )
        trainer.train()
        return [e for e in trainer.state.log_history if "loss" in e]

    ours, theirs = run("lossscale"), run("accelerate")
    assert [e["loss"] for e in ours] == [e["loss"] for e in theirs]
    assert [e["loss_scale"] for e in ours] == [1024.0, 2048.0, 2048.0, 4096.0]
