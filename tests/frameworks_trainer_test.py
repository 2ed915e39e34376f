"""``lossscale.torch.GradScaler`` inside the Hugging Face ``Trainer``, side by side with
``torch.amp.GradScaler``.

The Trainer drives Accelerate: its scaler is ``trainer.accelerator.scaler`` (Accelerate builds a
``torch.amp.GradScaler`` there for ``fp16=True`` on a GPU). On the CPU, ``fp16=True`` with
``use_cpu=True`` builds none, so the test puts the scaler there after constructing the Trainer
(the optimizer is prepared inside ``train()``, after that), and the model runs its forward under
float16 autocast on the CPU. The Trainer then scales in ``accelerator.backward``, unscales in
gradient clipping, steps through the prepared optimizer, skips its LR scheduler when
``accelerator.optimizer_step_was_skipped``, and saves/loads ``scaler.pt`` in its checkpoints.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lossscale.torch import GradScaler  # noqa: E402

STEPS = 10
OVERFLOW_AT = {1, 2, 6}  # training steps whose loss (so every gradient) is inf


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.calls = 0

    def forward(self, x: Any, labels: Any) -> dict[str, Any]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(self.net(x).float(), labels)
        if self.training:
            if self.calls in OVERFLOW_AT:
                loss = loss * math.inf
            self.calls += 1
        return {"loss": loss}


def _dataset() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(6, generator=g), "labels": torch.randn(1, generator=g)} for _ in range(64)
    ]


class _Record(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []
        self.trainer: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scaler = self.trainer.accelerator.scaler
        self.seen.append((kwargs["optimizer"].param_groups[0]["lr"], scaler.get_scale()))


def _trainer(model: Tiny, scaler: Any, out: Path, steps: int, **kwargs: Any) -> tuple[Any, _Record]:
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=0.1,
        lr_scheduler_type="linear",
        optim="sgd",
        max_grad_norm=1.0,
        fp16=True,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        **kwargs,
    )
    record = _Record()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_dataset(), callbacks=[record]
    )
    record.trainer = trainer
    trainer.accelerator.scaler = scaler  # the plug-in point: before train() prepares the optimizer
    trainer.accelerator.native_amp = True
    return trainer, record


def _run(make_scaler: Any, out: Path) -> tuple[list[tuple[float, float]], list[Any]]:
    model = Tiny()
    trainer, record = _trainer(model, make_scaler(), out, STEPS, save_strategy="no")
    trainer.train()
    return record.seen, [p.detach().clone() for p in model.parameters()]


def test_schedule_weights_and_scales_match_torch_grad_scaler(tmp_path: Path) -> None:
    ours, ours_params = _run(
        lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2), tmp_path / "a"
    )
    theirs, theirs_params = _run(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2), tmp_path / "b"
    )
    assert ours == theirs
    scales = [scale for _, scale in ours]
    assert scales[1] == scales[0] / 2 and scales[2] == scales[0] / 4  # the two overflows
    lrs = [lr for lr, _ in ours]
    assert lrs[1] == lrs[0] and lrs[2] == lrs[0]  # the scheduler did not step on skipped steps
    for a, b in zip(ours_params, theirs_params, strict=True):
        assert torch.equal(a, b)


def test_checkpoint_resume_restores_the_scaler(tmp_path: Path) -> None:
    def resume(make_scaler: Any, out: Path) -> list[tuple[float, float]]:
        trainer, _ = _trainer(
            Tiny(), make_scaler(), out, STEPS, save_strategy="steps", save_steps=5
        )
        trainer.train()
        again, record = _trainer(Tiny(), make_scaler(), out, STEPS, save_strategy="no")
        again.model.calls = 5 * 1  # the forward calls the first run made before its checkpoint
        again.train(resume_from_checkpoint=str(out / "checkpoint-5"))
        return record.seen

    ours = resume(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2), tmp_path / "a")
    theirs = resume(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2), tmp_path / "b"
    )
    assert ours == theirs and len(ours) == STEPS - 5
    uninterrupted, _ = _run(
        lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=2), tmp_path / "c"
    )
    assert [s for _, s in ours] == [s for _, s in uninterrupted[5:]]
