"""Accelerate, the Hugging Face Trainer and TRL: lossscale's scaler as ``accelerator.scaler``, in
one call, on a GPU and on the CPU alike.

::

    trainer = trl.GRPOTrainer(model=model, args=trl.GRPOConfig(fp16=True, ...), ...)
    scaler = lossscale.accelerate.install(trainer)   # after building it, before train()
    trainer.train()

Importing this package imports torch and accelerate (``import lossscale`` alone never does);
``lossscale.accelerate.hf`` (the Trainer's log callback) imports transformers.
"""

from lossscale._extras import require

require("accelerate", "PyTorch and Accelerate", "accelerate", "torch", "accelerate")

from lossscale.accelerate._install import install
from lossscale.accelerate._plan import PlanBypassWarning
from lossscale.accelerate._scalers import AcceleratorGradScaler, AcceleratorShardedGradScaler

__all__ = [
    "AcceleratorGradScaler",
    "AcceleratorShardedGradScaler",
    "PlanBypassWarning",
    "install",
]
