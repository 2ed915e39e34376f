"""Lightning's ``DeepSpeedStrategy``: :class:`LossScaleCallback` installs lossscale into the
strategy's engine when training starts (after Lightning restored ``ckpt_path``).

Importing this module imports Lightning (``import lossscale.deepspeed`` does not)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from lossscale.deepspeed._install import install

__all__ = ["LossScaleCallback"]


class LossScaleCallback(Callback):  # type: ignore[misc]
    """Install lossscale into ``trainer.strategy.deepspeed_engine`` in ``on_train_start``.

    Lightning restores a checkpoint (``trainer.fit(..., ckpt_path=...)``, through DeepSpeed's
    ``load_checkpoint``) before ``on_train_start``, so the scaler state saved with lossscale
    carries over. ``overrides`` are :func:`lossscale.deepspeed.install`'s keywords; the
    installed scaler is :attr:`scaler`. A strategy without a DeepSpeed engine is refused there
    (``ValueError``).

    >>> from lossscale.deepspeed.lightning import LossScaleCallback
    >>> LossScaleCallback(stall_steps=500).scaler is None  # Trainer(callbacks=[...])
    True
    """

    def __init__(self, **overrides: Any) -> None:
        self.overrides = overrides
        self.scaler: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        del pl_module
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if engine is None:
            raise ValueError(
                "LossScaleCallback: the Trainer's strategy has no DeepSpeed engine (use "
                "strategy='deepspeed_stage_2' or DeepSpeedStrategy(...))"
            )
        self.scaler = install(engine, **self.overrides)
