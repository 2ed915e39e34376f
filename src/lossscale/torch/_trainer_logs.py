"""What a scaler adds to a training framework's logs (the Hugging Face Trainer's, through the
callbacks of :mod:`lossscale.accelerate.hf` and :mod:`lossscale.deepspeed.hf`): the scale in
use and the skipped steps, overall and since the last log. Plain Python on dicts: no torch
call, no framework import."""

from __future__ import annotations

from typing import Any

__all__ = ["ScaleLog"]


class ScaleLog:
    """The three keys a training log gets: ``loss_scale`` (the scale in use now),
    ``skipped_steps`` (the run's skipped steps) and ``skipped_since_last_log`` (those of the
    logging window), added to the log a framework is about to report and to the copy of it
    the framework keeps in its history. For a callback of one's own (the Trainer's
    ``on_train_begin`` calls :meth:`start`, its ``on_log`` :meth:`add`); reads nothing from
    the device itself (the caller passes the scale and the count, read once per log).

    Example:
      >>> from lossscale.torch import ScaleLog
      >>> log = ScaleLog()
      >>> log.start(skipped=2)
      >>> logs = {"loss": 0.5}
      >>> history = [logs.copy()]  # what the Trainer keeps
      >>> log.add(logs, history, scale=1024.0, skipped=5)
      >>> logs
      {'loss': 0.5, 'loss_scale': 1024.0, 'skipped_steps': 5, 'skipped_since_last_log': 3}
      >>> history[-1] == logs
      True
    """

    def __init__(self) -> None:
        self._skipped_at_last_log = 0

    def start(self, skipped: int) -> None:
        """Training begins (or resumes) with ``skipped`` steps skipped so far."""
        self._skipped_at_last_log = skipped

    def add(self, logs: dict[str, Any], history: list[Any], scale: float, skipped: int) -> None:
        """Add the keys to ``logs`` and, when the last entry of ``history`` is the copy of
        ``logs`` the Trainer just appended (the same values), to that entry too."""
        entry = history[-1] if history else None
        if entry is not None and any(entry.get(k) is not v for k, v in logs.items()):
            entry = None  # not the copy of these logs that Trainer.log appended
        added = {
            "loss_scale": float(scale),
            "skipped_steps": skipped,
            "skipped_since_last_log": skipped - self._skipped_at_last_log,
        }
        self._skipped_at_last_log = skipped
        logs.update(added)
        if entry is not None:
            entry.update(added)
