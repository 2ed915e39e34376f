"""The Hugging Face Trainer's logs of lossscale's scaler: :class:`LossScaleLogCallback`, which
:func:`lossscale.accelerate.install` adds to a Trainer.

Importing this module imports transformers (``import lossscale.accelerate`` does not)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

__all__ = ["LossScaleLogCallback"]


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
        self._skipped_at_last_log = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, state, control, kwargs
        self._skipped_at_last_log = int(self.scaler.skipped_steps)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add ``loss_scale``, ``skipped_steps`` and ``skipped_since_last_log`` to a training
        log (one with ``loss``), and to the entry the Trainer just put in ``log_history``."""
        del args, control, kwargs
        if logs is None or "loss" not in logs:
            return
        history = state.log_history
        entry = history[-1] if history else None
        if entry is not None and any(entry.get(k) is not v for k, v in logs.items()):
            entry = None  # not the copy of these logs that Trainer.log appended
        skipped = int(self.scaler.skipped_steps)
        added = {
            "loss_scale": float(self.scaler.get_scale()),
            "skipped_steps": skipped,
            "skipped_since_last_log": skipped - self._skipped_at_last_log,
        }
        self._skipped_at_last_log = skipped
        logs.update(added)
        if entry is not None:
            entry.update(added)
