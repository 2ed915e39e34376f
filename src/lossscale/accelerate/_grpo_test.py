"""TRL's ``GRPOTrainer`` (TRL 1.16) with ``fp16=True`` on the CPU, side by side: Accelerate on its
own, torch's ``GradScaler`` set as ``accelerator.scaler`` by hand, and
``lossscale.accelerate.install``.

* On its own, Accelerate builds no scaler on the CPU and no float16 autocast: the run trains in
  float32 (the MLP's output inside the run is float32).
* torch's scaler (``native_amp`` on, set by hand) and lossscale's (``install`` with the same
  settings) give the same run bit for bit: losses, weights and scales after every step.
* An inf planted in a gradient (a tensor hook) at one step: lossscale skips it; weights and
  AdamW's state are bit-identical across it, the LR schedule does not advance, and the
  Trainer's logs show ``loss_scale`` halved and ``skipped_steps``.
* Resume: real Trainer checkpoints (``scaler.pt``, in lossscale's format and in torch's): the
  scale after ``train(resume_from_checkpoint=...)`` equals the uninterrupted run's.

The model is a 1-layer Llama-style model over a character tokenizer (``_testing``); each run
takes about a second.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from transformers import TrainerCallback  # noqa: E402

from lossscale._testing import one_torch_thread  # noqa: E402
from lossscale.accelerate import AcceleratorGradScaler, install  # noqa: E402
from lossscale.accelerate._testing import grpo_trainer, tiny_llama  # noqa: E402
from lossscale.accelerate.hf import LossScaleLogCallback  # noqa: E402

_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)

SETTINGS = {"init_scale": 2.0**10, "growth_interval": 2}
STEPS = 4
OVERFLOW_AT = 3  # the 1-based training step whose gradient gets an inf
SAVE_AT = 2


class _Record(TrainerCallback):  # type: ignore[misc]
    """After every optimizer step: weights, AdamW's state, the LR and the schedule's count, the
    scale; during training forwards: the dtype the MLP computed in."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.steps: list[dict[str, Any]] = []
        self.dtypes: set[str] = set()
        self.overflow_at: int | None = None
        mlp = trainer.model.model.layers[0].mlp
        mlp.register_forward_hook(self._dtype)
        trainer.model.model.layers[0].mlp.down_proj.weight.register_hook(self._plant)

    def _dtype(self, module: Any, inputs: Any, output: Any) -> None:
        if module.training:
            self.dtypes.add(str(output.dtype))

    def _plant(self, grad: Any) -> Any:
        if self.trainer.state.global_step + 1 == self.overflow_at:
            return grad * math.inf
        return grad

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs["optimizer"]
        scaler = self.trainer.accelerator.scaler
        self.steps.append(
            {
                "step": state.global_step,
                "weights": [p.detach().clone() for p in self.trainer.model.parameters()],
                "adam": [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()],
                "lr": self.trainer.lr_scheduler.get_last_lr()[0],
                "schedule_steps": self.trainer.lr_scheduler.last_epoch,
                "scale": None if scaler is None else scaler.get_scale(),
                "skipped": self.trainer.accelerator.optimizer_step_was_skipped,
            }
        )


def _run(
    mode: str,
    out: Path,
    overflow_at: int | None = None,
    resume: Path | None = None,
    **config: Any,
) -> dict[str, Any]:
    """One GRPO run: ``mode`` ``alone`` (Accelerate's own CPU set-up), ``torch`` (torch's
    GradScaler set by hand) or ``lossscale`` (``install``)."""
    trainer = grpo_trainer(tiny_llama(), str(out), max_steps=STEPS, **config)
    accelerator = trainer.accelerator
    before = (accelerator.scaler, accelerator.native_amp)
    if mode == "torch":
        accelerator.scaler = torch.amp.GradScaler("cpu", **SETTINGS)
        accelerator.native_amp = True
    elif mode == "lossscale":
        install(trainer, **SETTINGS)
    record = _Record(trainer)
    record.overflow_at = overflow_at
    trainer.add_callback(record)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "trainer": trainer,
        "before": before,
        "scaler": accelerator.scaler,
        "steps": record.steps,
        "dtypes": record.dtypes,
        "logs": logs,
        "losses": [entry["loss"] for entry in logs],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("grpo")
    save = {"save_strategy": "steps", "save_steps": SAVE_AT}
    return {
        "alone": _run("alone", tmp / "alone"),
        "torch": _run("torch", tmp / "torch", **save),
        "lossscale": _run("lossscale", tmp / "lossscale"),
        "skip": _run("lossscale", tmp / "skip", overflow_at=OVERFLOW_AT, **save),
        "skip_resumed": _run(
            "lossscale", tmp / "skip", OVERFLOW_AT, tmp / "skip" / f"checkpoint-{SAVE_AT}"
        ),
        "torch_resumed": _run(
            "lossscale", tmp / "torch", None, tmp / "torch" / f"checkpoint-{SAVE_AT}"
        ),
    }


def test_accelerate_alone_trains_in_float32_on_the_cpu(runs: dict[str, Any]) -> None:
    alone = runs["alone"]
    assert alone["before"] == (None, False)  # fp16=True, yet no scaler and no autocast
    assert alone["scaler"] is None
    assert alone["dtypes"] == {"torch.float32"}
    assert len(alone["steps"]) == STEPS


def test_install_runs_float16_bit_for_bit_as_torch_scaler(runs: dict[str, Any]) -> None:
    ours, theirs = runs["lossscale"], runs["torch"]
    assert type(ours["scaler"]) is AcceleratorGradScaler
    assert ours["dtypes"] == theirs["dtypes"] == {"torch.float16"}
    assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == STEPS
    assert any(loss != 0.0 for loss in ours["losses"])  # it learned something
    for a, b in zip(ours["steps"], theirs["steps"], strict=True):
        assert a["scale"] == b["scale"]
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    assert [s["scale"] for s in ours["steps"]] == [1024.0, 2048.0, 2048.0, 4096.0]
    assert ours["steps"][-1]["weights"][0].dtype == torch.float32  # float32 master weights


def test_a_skipped_step_changes_nothing_holds_the_schedule_and_is_logged(
    runs: dict[str, Any],
) -> None:
    steps = runs["skip"]["steps"]
    before, at = steps[OVERFLOW_AT - 2], steps[OVERFLOW_AT - 1]
    assert [s["skipped"] for s in steps] == [s["step"] == OVERFLOW_AT for s in steps]
    assert all(torch.equal(x, y) for x, y in zip(before["weights"], at["weights"], strict=True))
    for a, b in zip(before["adam"], at["adam"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert at["schedule_steps"] == before["schedule_steps"] and at["lr"] == before["lr"]
    assert steps[-1]["schedule_steps"] == STEPS - 1  # every applied step advanced it
    assert at["scale"] == before["scale"] / 2
    logs = runs["skip"]["logs"]
    assert [entry["loss_scale"] for entry in logs] == [s["scale"] for s in steps]
    assert [entry["skipped_steps"] for entry in logs] == [0, 0, 1, 1]
    assert [entry["skipped_since_last_log"] for entry in logs] == [0, 0, 1, 0]


def test_resume_restores_the_scale_of_the_uninterrupted_run(runs: dict[str, Any]) -> None:
    whole, resumed = runs["skip"], runs["skip_resumed"]
    assert [s["step"] for s in resumed["steps"]] == list(range(SAVE_AT + 1, STEPS + 1))
    assert [s["scale"] for s in resumed["steps"]] == [s["scale"] for s in whole["steps"]][SAVE_AT:]
    assert [s["skipped"] for s in resumed["steps"]] == [True, False]
    assert int(resumed["scaler"].skipped_steps) == 1
    new = [e for e in resumed["logs"] if e["step"] > SAVE_AT]  # the history is restored too
    logs = [(e["loss_scale"], e["skipped_steps"], e["skipped_since_last_log"]) for e in new]
    assert logs == [(s["scale"], 1, d) for s, d in zip(resumed["steps"], (1, 0), strict=True)]


def test_resume_from_a_torch_scaler_checkpoint(runs: dict[str, Any]) -> None:
    """``scaler.pt`` written by torch's GradScaler, loaded by lossscale's: the scale and its
    growth counter go on as torch's uninterrupted run's."""
    theirs, resumed = runs["torch"], runs["torch_resumed"]
    assert [s["scale"] for s in resumed["steps"]] == [s["scale"] for s in theirs["steps"]][SAVE_AT:]


def test_after_training_started_install_is_refused_saying_when(runs: dict[str, Any]) -> None:
    trainer = runs["alone"]["trainer"]  # trained: the accelerator prepared its optimizer
    callbacks = list(trainer.callback_handler.callbacks)
    with pytest.raises(ValueError, match=r"prepared its optimizer already.*before trainer\.train"):
        install(trainer)
    assert trainer.accelerator.scaler is None and not trainer.accelerator.native_amp
    assert trainer.callback_handler.callbacks == callbacks


def test_a_trainer_not_in_float16_is_refused(tmp_path: Path) -> None:
    # GRPOConfig without fp16 trains in bfloat16 (TRL's default)
    trainer = grpo_trainer(tiny_llama(), str(tmp_path), fp16=False)
    callbacks = list(trainer.callback_handler.callbacks)
    before = (trainer.accelerator.scaler, trainer.accelerator.native_amp)
    with pytest.raises(ValueError, match=r"mixed_precision is 'bf16'.*fp16=True"):
        install(trainer)
    assert (trainer.accelerator.scaler, trainer.accelerator.native_amp) == before
    assert trainer.callback_handler.callbacks == callbacks


def test_install_on_a_trainer_adds_one_log_callback_first(tmp_path: Path) -> None:
    trainer = grpo_trainer(tiny_llama(), str(tmp_path))
    scaler = install(trainer, init_scale=8.0)
    assert install(trainer, init_scale=8.0) is scaler
    logs = [c for c in trainer.callback_handler.callbacks if isinstance(c, LossScaleLogCallback)]
    assert len(logs) == 1 and logs[0].scaler is scaler
    assert trainer.callback_handler.callbacks[0] is logs[0]
