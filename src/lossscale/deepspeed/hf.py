"""The Hugging Face Trainer with ``deepspeed=``: :class:`LossScaleCallback` installs lossscale
into the engine the Trainer builds, after it loads a checkpoint, on every ``train()`` call.

Importing this module imports transformers (``import lossscale.deepspeed`` does not)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from lossscale.deepspeed._install import install

__all__ = ["LossScaleCallback"]


class LossScaleCallback(TrainerCallback):  # type: ignore[misc]
    """Install lossscale into the DeepSpeed engine of ``trainer`` when its training begins.

    The Trainer builds the engine inside ``train()``, then loads ``resume_from_checkpoint``
    (the DeepSpeed checkpoint, with the scaler state lossscale saved in it), then calls
    ``on_train_begin``: here, where :func:`lossscale.deepspeed.install` belongs. ``overrides``
    are ``install``'s keywords. The installed scaler is :attr:`scaler` (None before training
    begins). The Trainer's own skip handling is DeepSpeed's: ``engine.skipped_steps`` and the
    LR schedule held back on skipped steps. A Trainer without DeepSpeed is refused at that point
    (``ValueError``).

    >>> from lossscale.deepspeed.hf import LossScaleCallback
    >>> callback = LossScaleCallback(None, min_loss_scale=2**-10)  # Trainer(...).add_callback
    >>> callback.scaler is None
    True
    """

    def __init__(self, trainer: Any, **overrides: Any) -> None:
        self.trainer = trainer
        self.overrides = overrides
        self.scaler: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, state, control, kwargs
        engine = getattr(self.trainer, "deepspeed", None)
        if engine is None:
            raise ValueError(
                "LossScaleCallback: the Trainer runs without DeepSpeed (TrainingArguments("
                "deepspeed=...) is not set); use lossscale.torch.GradScaler there instead"
            )
        self.scaler = install(engine, **self.overrides)
