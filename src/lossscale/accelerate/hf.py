"""The Hugging Face Trainer's callbacks that :func:`lossscale.accelerate.install` adds: the logs of
lossscale's scaler (:class:`LossScaleLogCallback`) and, with ``plan=``, the first step's check
that the float16 plan's modules ran (:class:`PlanCheckCallback`).

Importing this module imports transformers (``import lossscale.accelerate`` does not)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from lossscale.accelerate._plan import FirstStepCheck
from lossscale.torch import ScaleLog

__all__ = ["LossScaleLogCallback", "PlanCheckCallback"]


class LossScaleLogCallback(TrainerCallback):  # type: ignore[misc]
    """Put the loss scale and the skipped steps of ``scaler`` (the scaler
    :func:`lossscale.accelerate.install` put in ``trainer.accelerator.scaler``) into the
    Trainer's training logs.

    Every training log (``logging_steps``; one with ``loss``) gets three more keys, in
    ``trainer.state.log_history`` and in what the reporting integrations (TensorBoard, W&B,
    the console) receive: ``loss_scale`` (the scale in use now), ``skipped_steps`` (the
    scaler's count of skipped steps, carried by its checkpoints) and ``skipped_since_last_log``
    (those of the logging window). The keys and their meaning are those of
    :class:`lossscale.deepspeed.hf.LossScaleCallback`, DeepSpeed's. So that the integrations
    see them, ``install`` puts the callback first among the Trainer's callbacks. Reads the
    scale on the host at each log (a sync on a GPU, once per log).

    >>> import torch
    >>> from lossscale.accelerate import AcceleratorGradScaler
    >>> from lossscale.accelerate.hf import LossScaleLogCallback
    >>> callback = LossScaleLogCallback(AcceleratorGradScaler("cpu", init_scale=256.0))
    >>> logs = {"loss": 0.5}
    >>> callback.on_log(None, type("State", (), {"log_history": []})(), None, logs=logs)
    >>> logs
    {'loss': 0.5, 'loss_scale': 256.0, 'skipped_steps': 0, 'skipped_since_last_log': 0}
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._log = ScaleLog()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, state, control, kwargs
        self._log.start(int(self.scaler.skipped_steps))

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add ``loss_scale``, ``skipped_steps`` and ``skipped_since_last_log`` to a training
        log (one with ``loss``), and to the entry the Trainer just put in ``log_history``."""
        del args, control, kwargs
        if logs is None or "loss" not in logs:
            return
        skipped = int(self.scaler.skipped_steps)
        self._log.add(logs, state.log_history, self.scaler.get_scale(), skipped)


class PlanCheckCallback(TrainerCallback):  # type: ignore[misc]
    """Check, in the first training step, that the modules the float16 plan keeps in float32
    ran their forwards (:func:`lossscale.accelerate.install` adds it with ``plan=``): counting
    starts at ``on_train_begin`` and ends at the first ``on_pre_optimizer_step``, after the
    step's backward passes and before its optimizer step. A kept module that its model
    bypassed while its parameters got gradients stops training there with a ``ValueError``
    (the weights as they were); one without gradients gets a
    :class:`lossscale.accelerate.PlanBypassWarning`. Hooks only during that step; no sync.

    ``install(trainer, plan=...)`` adds one (the float16 RL page of the documentation runs it
    in TRL's trainers):

    >>> from transformers import TrainerCallback
    >>> from lossscale.accelerate.hf import PlanCheckCallback
    >>> issubclass(PlanCheckCallback, TrainerCallback)
    True
    """

    def __init__(self, check: FirstStepCheck) -> None:
        self.check = check

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, state, control, kwargs
        self.check.start()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, state, control, kwargs
        self.check.finish()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, state, control, kwargs
        self.check.stop()
