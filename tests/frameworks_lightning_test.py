"""``lossscale.torch.GradScaler`` inside Lightning, side by side with ``torch.amp.GradScaler``.

Lightning takes the scaler through its precision plugin,
``MixedPrecision("16-mixed", device, scaler=...)``, and calls ``scale`` (``pre_backward``),
``unscale_`` (before gradient clipping), ``step``, ``update`` and ``state_dict`` /
``load_state_dict`` (its checkpoints). On the CPU, ``Trainer(precision="16-mixed")`` would turn
into bfloat16 without a scaler, so the plugin is passed explicitly, with float16 autocast on the
CPU: the GPU code path. Each test trains the same model twice, once per scaler, with the same
injected non-finite gradients, and compares what Lightning and the scaler end with.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lossscale._testing import OverflowingTrainingStep  # noqa: E402
from lossscale.torch import GradScaler, _engine  # noqa: E402
from lossscale.torch.lightning import SkipAwareSchedulers, last_step_applied  # noqa: E402

STEPS = 12
OVERFLOW_AT = {2, 3, 7}  # global steps whose gradients turn non-finite after backward


class Tiny(OverflowingTrainingStep, pl.LightningModule):
    overflow_at = OVERFLOW_AT

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )
        self.scales: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(scaler.get_scale())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data() -> Any:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _trainer(scaler: Any, steps: int, **kwargs: Any) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=1.0,  # Lightning calls scaler.unscale_(optimizer) before clipping
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _fit(make_scaler: Any, steps: int = STEPS) -> tuple[Tiny, Any]:
    model = Tiny()
    trainer = _trainer(make_scaler(), steps)
    trainer.fit(model, _data())
    return model, trainer


def test_same_weights_scales_and_schedule_as_torch_grad_scaler() -> None:
    ours, ours_trainer = _fit(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    theirs, theirs_trainer = _fit(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    )
    assert ours.scales == theirs.scales
    assert len(set(ours.scales)) > 2  # backed off and grew
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    # what Lightning saw: the same global step and learning rate with either scaler
    assert ours_trainer.global_step == theirs_trainer.global_step == STEPS
    lr = [t.optimizers[0].param_groups[0]["lr"] for t in (ours_trainer, theirs_trainer)]
    assert lr[0] == lr[1]
    scaler = ours_trainer.precision_plugin.scaler
    assert isinstance(scaler, GradScaler) and int(scaler.skipped_steps) == len(OVERFLOW_AT)


def test_checkpoint_save_and_resume_through_lightning(tmp_path: Path) -> None:
    def run(make_scaler: Any) -> tuple[dict[str, Any], list[float], list[torch.Tensor]]:
        _, trainer = _fit(make_scaler, steps=8)
        path = tmp_path / f"{type(trainer.precision_plugin.scaler).__module__}.ckpt"
        trainer.save_checkpoint(path)
        saved = trainer.precision_plugin.scaler.state_dict()
        resumed = Tiny()
        again = _trainer(make_scaler(), STEPS)
        again.fit(resumed, _data(), ckpt_path=path)
        return saved, resumed.scales, [p.detach().clone() for p in resumed.parameters()]

    ours = run(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    theirs = run(lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    assert {k: v for k, v in ours[0].items() if k != "lossscale"} == theirs[0]
    assert ours[1] == theirs[1] and len(ours[1]) == STEPS - 8  # resumed where it stopped
    # the scale and growth counter came back: the resumed run continues the uninterrupted one
    full, _ = _fit(lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    assert ours[1] == full.scales[8:]
    assert ours[1][0] < 2.0**10  # a fresh scaler would start at its init_scale, 2**10
    for a, b in zip(ours[2], theirs[2], strict=True):
        assert torch.equal(a, b)


# -- skipped steps: schedulers and callbacks (lossscale.torch.lightning) ---------------------
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
APPLIED = STEPS - len(OVERFLOW_AT)


@pytest.fixture
def device_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's path on the CPU: a fused optimizer's decision may stay on the device
    (with ``device_side_skip=True``)."""
    monkeypatch.setattr(_engine, "SYNCHRONOUS_DEVICES", frozenset())


class Scheduled(SkipAwareSchedulers, Tiny):
    """Tiny with the mixin, a fused AdamW, a step-interval and an epoch-interval scheduler."""

    def __init__(self, automatic: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = automatic

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        per_step, _ = self.lr_schedulers()
        self.manual_backward(loss)
        self._overflow()
        opt.step()
        opt.zero_grad()
        if last_step_applied(self):  # the manual-optimization recipe
            per_step.step()
        return loss

    def on_after_backward(self) -> None:
        if self.automatic_optimization:
            super().on_after_backward()

    def _overflow(self) -> None:
        if self.global_step in OVERFLOW_AT:
            self.net[0].weight.grad[0, 0] = math.inf

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        per_step = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
        per_epoch = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
        return [opt], [
            {"scheduler": per_step, "interval": "step"},
            {"scheduler": per_epoch, "interval": "epoch"},
        ]


def _skip_trainer(scaler: Any, device: str, **kwargs: Any) -> Any:
    return pl.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", device, scaler=scaler)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _epochs_data() -> Any:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, 6, generator=g), torch.randn(STEPS, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
@pytest.mark.parametrize("device_side_skip", [False, True])
@pytest.mark.usefixtures("device_decision")
def test_schedulers_advance_on_applied_steps_only(
    device_side_skip: bool, automatic: bool, device: str
) -> None:
    scaler = GradScaler(device, init_scale=2.0**10, device_side_skip=device_side_skip)
    model = Scheduled(automatic)
    trainer = _skip_trainer(scaler, device, max_steps=STEPS)  # 4 epochs of 3 batches
    trainer.fit(model, _epochs_data())
    per_step, per_epoch = (config.scheduler for config in trainer.lr_scheduler_configs)
    assert int(scaler.skipped_steps) == len(OVERFLOW_AT)
    assert per_step.last_epoch == APPLIED  # the skipped steps did not advance it
    if automatic:  # Lightning steps the epoch-interval one per epoch, skipped steps or not
        assert per_epoch.last_epoch == trainer.current_epoch == STEPS // 3
    else:
        assert per_epoch.last_epoch == 0  # in manual optimization the user steps schedulers


@pytest.mark.parametrize("device", DEVICES)
def test_ema_callback_asks_last_step_applied(device: str) -> None:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    class SkipAwareEMA(EMAWeightAveraging):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if last_step_applied(trainer):  # no update of the average on a skipped step
                super().on_train_batch_end(trainer, *args)

    counts = []
    for ema in (EMAWeightAveraging(decay=0.9), SkipAwareEMA(decay=0.9)):
        trainer = _skip_trainer(
            GradScaler(device, init_scale=2.0**10), device, max_steps=STEPS, callbacks=[ema]
        )
        trainer.fit(Tiny(), _data())
        counts.append(int(ema._average_model.n_averaged))
    assert counts == [STEPS, APPLIED]


@pytest.mark.parametrize("device", DEVICES)
def test_last_step_applied_needs_a_scaler_that_reports_skips(device: str) -> None:
    trainer = _skip_trainer(torch.amp.GradScaler(device), device, max_steps=1)
    with pytest.raises(TypeError, match="does not report skipped steps"):
        trainer.fit(Scheduled(), _data())
    # without a scaler (bfloat16, 32-bit) no step is skipped
    plain = pl.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Scheduled()
    plain.fit(model, _data())
    assert last_step_applied(plain) and last_step_applied(model)
    assert plain.lr_scheduler_configs[0].scheduler.last_epoch == 2
    with pytest.raises(RuntimeError, match="not attached"):
        last_step_applied(Tiny())


def test_importing_lossscale_torch_leaves_lightning_out() -> None:
    code = (
        "import sys, lossscale.torch, lossscale.torch.lightning; "
        "print([m for m in ('lightning', 'pytorch_lightning') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
