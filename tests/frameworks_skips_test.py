"""What Accelerate, the HF Trainer, Lightning and timm see of a skipped step, side by side:
``torch.amp.GradScaler``, lossscale's ``GradScaler`` (default) and lossscale's
``GradScaler(device_side_skip=True)``, with an unfused and a fused AdamW.

"What a framework sees" is what the framework itself reads: Accelerate's ``step_was_skipped``
and its prepared scheduler, the HF Trainer's scheduler, the scheduler calls of Lightning
(with :class:`lossscale.torch.lightning.SkipAwareSchedulers`), and in timm's loop, which reads
no skip signal, whether ``optimizer.step`` ran. Accelerate and the Trainer detect a skip by
"the scaler did not call ``optimizer.step``": torch's scaler always calls a fused optimizer
(its kernel skips on the device), so they cannot see that skip and step the scheduler;
lossscale by default reads the fused optimizer's decision on the host, as for an unfused one,
and does not call it; ``device_side_skip=True`` keeps the decision on the device (no host sync),
as torch's does, so the skip is invisible again.

On the CPU the GPU's path is forced: the engine's device-side decision is turned on by emptying
``_engine.SYNCHRONOUS_DEVICES`` (on the CPU a fused optimizer would otherwise be decided on the
host, since reading the flag there waits for nothing). Host syncs are counted as
``aten._local_scalar_dense`` calls (what ``.item()`` dispatches, on every device) in
``scaler.step`` + ``scaler.update``, the optimizer's own step left out (AdamW reads its step
counts there, which live on the host: no device sync). Each test takes the device as a
parameter; the CUDA case runs the same assertions.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lossscale._testing import OverflowingTrainingStep, timm_native_scaler_class  # noqa: E402
from lossscale.torch import GradScaler, _engine  # noqa: E402
from lossscale.torch.lightning import SkipAwareSchedulers, last_step_applied  # noqa: E402

STEPS = 6
OVERFLOW_AT = {1, 2, 4}  # iterations whose gradients are not finite
APPLIED = STEPS - len(OVERFLOW_AT)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
SCALERS = ["torch", "lossscale", "device_side_skip"]
KINDS = ["unfused", "fused"]

#: Whether the framework can see a skipped step: not when the optimizer's ``step`` is called
#: anyway (a fused optimizer that skips in its kernel).
SEES_SKIP = {
    ("torch", "unfused"): True,
    ("torch", "fused"): False,
    ("lossscale", "unfused"): True,
    ("lossscale", "fused"): True,
    ("device_side_skip", "unfused"): True,
    ("device_side_skip", "fused"): False,
}
#: Host syncs per iteration in ``scaler.step`` + ``scaler.update``: one (reading the decision)
#: unless the decision stays on the device.
SYNCS = {key: 1 if sees else 0 for key, sees in SEES_SKIP.items()}


@pytest.fixture(autouse=True)
def _device_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's path on the CPU: a fused optimizer's decision may stay on the device."""
    monkeypatch.setattr(_engine, "SYNCHRONOUS_DEVICES", frozenset())


def _scaler(which: str, device: str) -> Any:
    if which == "torch":
        return torch.amp.GradScaler(device, init_scale=2.0**10)
    if which == "device_side_skip":
        return GradScaler(device, init_scale=2.0**10, device_side_skip=True)
    return GradScaler(device, init_scale=2.0**10)


def _adamw(params: Any, kind: str) -> Any:
    return torch.optim.AdamW(params, lr=1e-2, fused=kind == "fused")


def _model(device: str) -> Any:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return net.to(device)


def _batch(step: int, device: str) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)


def _optimizer_steps(opt: Any) -> int:
    """AdamW's own count of applied steps (a fused kernel that skips takes its step back)."""
    return int(next(iter(opt.state.values()))["step"])


class Watch(TorchDispatchMode):
    """Host syncs per iteration in a scaler's ``step`` + ``update`` (the optimizer's own step
    left out), host syncs in :func:`last_step_applied` calls made through :meth:`ask`, and
    how often ``optimizer.step`` ran."""

    def __init__(self, scaler: Any, optimizer: Any) -> None:
        super().__init__()
        self.syncs: list[int] = []
        self.ask_syncs: list[int] = []
        self.calls = 0
        self._into: list[int] | None = None
        step, update = scaler.step, scaler.update

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            self.syncs.append(0)
            return self._count(self.syncs, step, *args, **kwargs)

        def counted_update(*args: Any, **kwargs: Any) -> Any:
            return self._count(self.syncs, update, *args, **kwargs)

        scaler.step, scaler.update = counted_step, counted_update

        def pause(*_: Any) -> None:
            self._paused = self._into
            self._into = None

        def resume(*_: Any) -> None:
            self._into = self._paused
            self.calls += 1

        optimizer.register_step_pre_hook(pause)
        optimizer.register_step_post_hook(resume)

    def _count(self, into: list[int], fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._into = into
        try:
            with self:
                return fn(*args, **kwargs)
        finally:
            self._into = None

    def asking(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, its syncs counted as one question (in ``ask_syncs``)."""
        self.ask_syncs.append(0)
        return self._count(self.ask_syncs, fn, *args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._into is not None and func is torch.ops.aten._local_scalar_dense.default:
            self._into[-1] += 1
        return func(*args, **(kwargs or {}))


def _check_syncs(watch: Watch, which: str, kind: str) -> None:
    assert watch.syncs == [SYNCS[which, kind]] * STEPS


# -- Accelerate ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", SCALERS)
def test_accelerate(which: str, kind: str, device: str) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=device == "cpu")
    accelerator.scaler = _scaler(which, device)
    accelerator.native_amp = True
    model = _model(device)
    inner = _adamw(model.parameters(), kind)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 0.9**step)
    model, opt, sched = accelerator.prepare(model, inner, sched)
    watch = Watch(accelerator.scaler, inner)
    skipped = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        with torch.autocast(device, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        if step in OVERFLOW_AT:
            model[0].weight.grad[0, 0] = math.inf
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
    sees = SEES_SKIP[which, kind]
    assert [i for i, s in enumerate(skipped) if s] == (sorted(OVERFLOW_AT) if sees else [])
    assert sched.scheduler.last_epoch == (APPLIED if sees else STEPS)  # the scheduler's steps
    assert _optimizer_steps(inner) == APPLIED  # every variant skipped the update itself
    assert watch.calls == (APPLIED if sees else STEPS)
    _check_syncs(watch, which, kind)


# -- the HF Trainer -----------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", SCALERS)
def test_hf_trainer(which: str, kind: str, device: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model("cpu")
            self.calls = 0

        def forward(self, x: Any, labels: Any) -> dict[str, Any]:
            with torch.autocast(device, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(self.net(x).float(), labels)
            if self.calls in OVERFLOW_AT:
                loss = loss * math.inf
            self.calls += 1
            return {"loss": loss}

    class Start(transformers.TrainerCallback):
        watch: Watch | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.watch is None:  # the optimizer is built and prepared inside train()
                self.watch = Watch(trainer.accelerator.scaler, trainer.optimizer.optimizer)

    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(6, generator=g), "labels": torch.randn(1, generator=g)}] * 32
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        optim="adamw_torch_fused" if kind == "fused" else "adamw_torch",
        fp16=True,
        use_cpu=device == "cpu",
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    start = Start()
    trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[start])
    trainer.accelerator.scaler = _scaler(which, device)
    trainer.accelerator.native_amp = True
    trainer.train()
    sees = SEES_SKIP[which, kind]
    assert trainer.lr_scheduler.last_epoch == (APPLIED if sees else STEPS)
    inner = trainer.optimizer.optimizer
    assert getattr(inner, "_step_supports_amp_scaling", False) == (kind == "fused")
    assert _optimizer_steps(inner) == APPLIED
    assert start.watch is not None and start.watch.calls == (APPLIED if sees else STEPS)
    _check_syncs(start.watch, which, kind)


# -- Lightning ----------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", SCALERS)
def test_lightning(which: str, kind: str, device: str) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Tiny(OverflowingTrainingStep, pl.LightningModule):
        overflow_at = OVERFLOW_AT

        def __init__(self) -> None:
            super().__init__()
            self.net = _model("cpu")
            self.watch: Watch | None = None

        def on_train_start(self) -> None:
            self.watch = Watch(self.trainer.precision_plugin.scaler, self.trainer.optimizers[0])

        def configure_optimizers(self) -> Any:
            opt = _adamw(self.parameters(), kind)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class SkipAware(SkipAwareSchedulers, Tiny):
        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            assert self.watch is not None
            self.watch.asking(super().lr_scheduler_step, scheduler, metric)

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS * 4, 6, generator=g), torch.randn(STEPS * 4, 1, generator=g)
    model = Tiny() if which == "torch" else SkipAware()  # the mixin needs lossscale's scaler
    trainer = pl.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=1,
        max_steps=STEPS,
        plugins=[MixedPrecision("16-mixed", device, scaler=_scaler(which, device))],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer.fit(model, data)
    sched = trainer.lr_scheduler_configs[0].scheduler
    opt = trainer.optimizers[0]
    watch = model.watch
    assert watch is not None
    # Lightning steps its schedulers on every step itself; the mixin drops the skipped ones
    assert sched.last_epoch == (STEPS if which == "torch" else APPLIED)
    assert _optimizer_steps(opt) == APPLIED
    assert watch.calls == (APPLIED if SEES_SKIP[which, kind] else STEPS)
    _check_syncs(watch, which, kind)
    if which != "torch":  # the mixin's question: free unless the decision stayed on the device
        assert watch.ask_syncs == [1 - SYNCS[which, kind]] * STEPS


# -- timm -----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", SCALERS)
def test_timm(which: str, kind: str, device: str) -> None:
    native = timm_native_scaler_class()(device)  # loads timm without torchvision
    native._scaler = _scaler(which, device)
    model = _model(device)
    opt = _adamw(model.parameters(), kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    watch = Watch(native._scaler, opt)
    num_updates = 0
    for step in range(STEPS):
        x, y = _batch(step, device)
        with torch.autocast(device, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step in OVERFLOW_AT:
            loss = loss * math.inf
        native(loss, opt)  # timm's train_one_epoch: scale, backward, step, update
        opt.zero_grad()
        num_updates += 1  # timm counts every iteration: lr_scheduler.step_update(num_updates)
        # the recipe: the scheduler advances on applied steps only
        if which != "torch" and watch.asking(last_step_applied, native._scaler):
            sched.step()
    assert num_updates == STEPS  # timm itself reads no skip signal
    assert _optimizer_steps(opt) == APPLIED
    assert watch.calls == (APPLIED if SEES_SKIP[which, kind] else STEPS)  # optimizer.step ran
    _check_syncs(watch, which, kind)
    if which != "torch":
        assert sched.last_epoch == APPLIED
        assert watch.ask_syncs == [1 - SYNCS[which, kind]] * STEPS
