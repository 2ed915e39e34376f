"""lossscale in the DeepSpeed engines that frameworks build: the Hugging Face Trainer with
``deepspeed=`` (through :class:`lossscale.deepspeed.hf.LossScaleCallback`) and Accelerate's
DeepSpeed plugin (``install(accelerator.deepspeed_engine_wrapped.engine)``), each side by side
with the framework on its own, on the CPU (gloo, ``DS_ACCELERATOR=cpu``), across a resume in a
fresh process. What each framework reads of a skipped step is what is checked: Accelerate's
``optimizer.step_was_skipped`` and its scheduler; the Trainer's engine ``skipped_steps`` and its
LR schedule. The jobs run as on a CPU without float16 instructions (AVX512-FP16, AMX), where
DeepSpeed refuses ``fp16`` until the test helpers' switch lifts that, as on every CPU.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from lossscale._testing import NO_FLOAT16_CPU_ENV, run_gloo_job  # noqa: E402

DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}


# -- Accelerate --------------------------------------------------------------------------------


def _accelerate_run(root: str, resume: bool, use_lossscale: bool) -> dict[str, Any]:
    from accelerate import Accelerator, DeepSpeedPlugin

    cfg = {
        **DS_CONFIG,
        "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "initial_scale_power": 1, "hysteresis": 1},
    }
    _fresh_accelerate_state()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    if resume:
        accelerator.load_state(f"{root}/accelerate")
    scaler = None
    if use_lossscale:
        from lossscale.deepspeed import install

        scaler = install(accelerator.deepspeed_engine_wrapped.engine, min_loss_scale=0.25)
    out: dict[str, Any] = {"skipped": [], "scale": [], "epoch": [], "error": None}
    x = torch.ones(2, 4, dtype=torch.float16)
    flags = "..." if resume else "LL.L"
    try:
        for flag in flags:
            loss = model(x).float().sum() * (float("inf") if flag == "L" else 1.0)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            out["skipped"].append(bool(opt.step_was_skipped))
            out["epoch"].append(int(sched.scheduler.last_epoch))
            engine = accelerator.deepspeed_engine_wrapped.engine
            out["scale"].append(scaler.cur_scale if scaler else engine.optimizer.loss_scale)
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
    if use_lossscale and not resume:
        accelerator.save_state(f"{root}/accelerate")
    return out


def _prepare() -> None:
    import os

    from lossscale.deepspeed._testing import prepare_cpu

    prepare_cpu()
    os.environ["LOCAL_WORLD_SIZE"] = "1"


def _fresh_accelerate_state() -> None:
    """Accelerate keeps one DeepSpeed plugin per process: forget it between two runs (its own
    test suite does the same)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def test_accelerate_sees_skips_keeps_running_at_the_floor_and_resumes(
    phases: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    first, resumed = phases
    own, ours = first["accelerate_own"], first["accelerate"]
    # DeepSpeed's own scaler: 2 -> 1, then its exception at the floor
    assert own["scale"] == [1.0] and "already at minimum" in own["error"]
    assert ours["error"] is None
    assert ours["scale"] == [1.0, 0.5, 0.5, 0.25]  # a floor below 1, as asked
    assert ours["skipped"] == [True, True, False, True]  # Accelerate's own reader
    assert ours["epoch"] == [0, 0, 1, 1]  # the schedule held on skipped steps
    again = resumed["accelerate"]
    assert again["error"] is None and again["scale"] == [0.25, 0.25, 0.25]
    assert again["epoch"] == [2, 3, 4] and again["skipped"] == [False] * 3


# -- the Hugging Face Trainer ----------------------------------------------------------------------


class _Model(torch.nn.Module):  # type: ignore[misc]
    """A regression model with the Trainer's interface; ``bad_steps`` make its loss infinite."""

    def __init__(self, bad_steps: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.bad_steps, self.calls = bad_steps, 0

    def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
        out = self.lin(x).float()
        loss = ((out - labels) ** 2).mean()
        if self.calls in self.bad_steps:
            loss = loss * float("inf")
        self.calls += 1
        return {"loss": loss, "logits": out}


class _Data(torch.utils.data.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g)}


def _trainer_run(
    root: str, use_lossscale: bool, resume: bool, logging_steps: int = 0
) -> dict[str, Any]:
    """``logging_steps`` > 0: log every that many steps, with a callback added before
    lossscale's (as a reporting integration is) that records what its ``on_log`` receives."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lossscale.deepspeed.hf import LossScaleCallback

    class Reporter(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.seen: list[dict[str, Any]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            self.seen.append(dict(logs))

    cfg = {
        **DS_CONFIG,
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto", "initial_scale_power": 2, "hysteresis": 1},
        "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
    }
    args = TrainingArguments(
        output_dir=f"{root}/trainer",
        per_device_train_batch_size=2,
        max_steps=8 if resume else 5,
        learning_rate=0.01,
        deepspeed=cfg,
        fp16=True,
        report_to=[],
        save_strategy="no" if logging_steps else "steps",
        save_steps=5,
        logging_strategy="steps" if logging_steps else "no",
        logging_steps=logging_steps or 500,
        lr_scheduler_type="linear",
        disable_tqdm=True,
    )
    _fresh_accelerate_state()
    model = _Model(set() if resume else {0, 1, 3})
    trainer = Trainer(model=model, args=args, train_dataset=_Data())
    reporter = Reporter()
    if logging_steps:
        trainer.add_callback(reporter)
    callback = LossScaleCallback(trainer, min_loss_scale=2**-4)
    if use_lossscale:
        trainer.add_callback(callback)
    out: dict[str, Any] = {"error": None}
    try:
        trainer.train(resume_from_checkpoint=f"{root}/trainer/checkpoint-5" if resume else None)
    except Exception as error:
        out["error"] = f"{type(error).__name__}: {error}"
    engine = trainer.deepspeed
    out["skipped"] = int(engine.skipped_steps)
    out["scale"] = float(engine.optimizer.loss_scale)
    out["lr_epoch"] = int(engine.lr_scheduler.last_epoch)
    out["global_step"] = int(trainer.state.global_step)
    out["installed"] = callback.scaler is not None
    out["history"] = [dict(entry) for entry in trainer.state.log_history]
    out["reported"] = reporter.seen
    return out


def _job(rank: int, world: int, root: str, resume: bool) -> dict[str, Any]:
    """Every run of one phase in one process (each framework's state reset in between)."""
    del rank, world
    _prepare()
    if resume:
        return {
            "accelerate": _accelerate_run(root, True, True),
            "trainer": _trainer_run(root, True, True),
        }
    return {
        "accelerate_own": _accelerate_run(root, False, False),
        "accelerate": _accelerate_run(root, False, True),
        "trainer_own": _trainer_run(root + "/own", False, False),
        "trainer": _trainer_run(root, True, False),
        "trainer_logs": _trainer_run(root + "/logs", True, False, logging_steps=2),
    }


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("frameworks")
    with pytest.MonkeyPatch.context() as env:
        for key, value in NO_FLOAT16_CPU_ENV.items():
            env.setenv(key, value)  # the spawned ranks start with it
        first = run_gloo_job(_job, 1, 300, root / "first", args=(str(root), False))[0]
        resumed = run_gloo_job(_job, 1, 300, root / "resumed", args=(str(root), True))[0]
    return first, resumed


def test_hf_trainer_with_deepspeed_keeps_running_and_resumes(
    phases: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    first, resumed = phases
    own, ours = first["trainer_own"], first["trainer"]
    assert "already at minimum" in own["error"]  # 4 -> 2 -> 1, then DeepSpeed's exception
    assert ours["error"] is None and ours["installed"]
    assert ours["global_step"] == 5 and ours["skipped"] == 3
    assert ours["scale"] == 0.5  # 4 -> 2 -> 1 -> 0.5 (window 1000: no growth)
    assert ours["lr_epoch"] == 2  # the LR schedule stepped on the 2 applied steps only
    again = resumed["trainer"]
    assert again["error"] is None and again["installed"]
    assert again["scale"] == 0.5 and again["skipped"] == 3  # carried across the resume
    assert again["global_step"] == 8 and again["lr_epoch"] == 5


def test_hf_trainer_logs_the_loss_scale_and_the_skipped_steps(
    phases: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """Steps 1, 2 and 4 overflow (of 5), a log every 2 steps: the first window, all skipped,
    logs the scale it backed off to and 2 skipped steps beside the Trainer's loss and
    grad_norm; the history and the integrations' on_log (a callback added before lossscale's)
    get the keys."""
    run = phases[0]["trainer_logs"]
    assert run["error"] is None and run["skipped"] == 3
    logged = [e for e in run["history"] if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4]
    keys = ("loss_scale", "skipped_steps", "skipped_since_last_log")
    assert [tuple(e[k] for k in keys) for e in logged] == [(1.0, 2, 2), (0.5, 3, 1)]
    reported = [e for e in run["reported"] if "loss" in e]
    assert [tuple(e[k] for k in keys) for e in reported] == [(1.0, 2, 2), (0.5, 3, 1)]
    assert "loss_scale" not in next(e for e in run["history"] if "train_runtime" in e)
