"""The Hugging Face Trainer with ``deepspeed=``: :class:`LossScaleCallback` installs lossscale
into the engine the Trainer builds, after it loads a checkpoint, on every ``train()`` call.

Importing this module imports transformers (``import lossscale.deepspeed`` does not)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from lossscale.deepspeed._install import install
from lossscale.torch import ScaleLog

__all__ = ["LossScaleCallback"]


class LossScaleCallback(TrainerCallback):  # type: ignore[misc]
    """Install lossscale into the DeepSpeed engine of ``trainer`` when its training begins, and
    log the loss scale and the skipped steps with the Trainer's logs.

    The Trainer builds the engine inside ``train()``, then loads ``resume_from_checkpoint``
    (the DeepSpeed checkpoint, with the scaler state lossscale saved in it), then calls
    ``on_train_begin``: here, where :func:`lossscale.deepspeed.install` belongs. ``overrides``
    are ``install``'s keywords. The installed scaler is :attr:`scaler` (None before training
    begins). The Trainer's own skip handling is DeepSpeed's: ``engine.skipped_steps`` and the
    LR schedule held back on skipped steps. A Trainer without DeepSpeed is refused at that point
    (``ValueError``).

    Every training log (``logging_steps``) gets three more keys, in ``trainer.state.log_history``
    and in what the reporting integrations (TensorBoard, W&B, the console) receive:
    ``loss_scale`` (the scale in use now), ``skipped_steps`` (the steps skipped since training
    began, DeepSpeed's count) and ``skipped_since_last_log`` (those of the logging window). A
    window whose every step overflowed then says so beside its ``loss`` and ``grad_norm``
    (which the Trainer reports as 0.0 and inf there). So that the integrations see the keys,
    the callback moves itself to the front of the Trainer's callbacks when training begins.

    >>> from lossscale.deepspeed.hf import LossScaleCallback
    >>> callback = LossScaleCallback(None, min_loss_scale=2**-10)  # Trainer(...).add_callback
    >>> callback.scaler is None
    True
    """

    def __init__(self, trainer: Any, **overrides: Any) -> None:
        self.trainer = trainer
        self.overrides = overrides
        self.scaler: Any = None
        self._log = ScaleLog()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, state, control, kwargs
        engine = getattr(self.trainer, "deepspeed", None)
        if engine is None:
            raise ValueError(
                "LossScaleCallback: the Trainer runs without DeepSpeed (TrainingArguments("
                "deepspeed=...) is not set); use lossscale.torch.GradScaler there instead"
            )
        self.scaler = install(engine, **self.overrides)
        self._log.start(int(engine.skipped_steps))
        # First among the callbacks, so that the reporting integrations' on_log sees the keys
        # on_log adds. Reordered in place while the Trainer iterates over the list for this
        # event: the callbacks after this one keep their places, so each is still called once.
        callbacks = self.trainer.callback_handler.callbacks
        callbacks[:] = [self, *(c for c in callbacks if c is not self)]

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add ``loss_scale``, ``skipped_steps`` and ``skipped_since_last_log`` to a training
        log (one with ``loss``), and to the entry the Trainer just put in ``log_history``."""
        del args, control, kwargs
        if self.scaler is None or logs is None or "loss" not in logs:
            return
        scaler = self.scaler
        scale = scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.cur_scale
        self._log.add(logs, state.log_history, scale, int(self.trainer.deepspeed.skipped_steps))
