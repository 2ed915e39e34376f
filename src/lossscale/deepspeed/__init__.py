"""DeepSpeed integration: lossscale's rule in a DeepSpeed engine, in one call.

::

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.load_checkpoint(path)                 # when resuming: before install
    scaler = lossscale.deepspeed.install(engine)  # fp16 or torch_autocast float16, ZeRO 0-3

On an H100/H200 call :func:`set_cuda_arch_list` before ``deepspeed.initialize`` (DeepSpeed's
op builder fails on torch's ``9.0a`` target otherwise).

Importing this package imports torch and deepspeed (``import lossscale`` alone never does), and
registers :class:`DeepSpeedLossScaler` with ``torch.serialization.add_safe_globals`` so that
checkpoints holding it load with ``torch.load(weights_only=True)``.
"""

from lossscale._extras import require

require("deepspeed", "PyTorch and DeepSpeed", "deepspeed", "torch", "deepspeed")

import torch

from lossscale.deepspeed._cuda_arch import set_cuda_arch_list
from lossscale.deepspeed._gradients import engine_gradients
from lossscale.deepspeed._install import install
from lossscale.deepspeed._scaler import DeepSpeedLossScaler

torch.serialization.add_safe_globals([DeepSpeedLossScaler])

__all__ = ["DeepSpeedLossScaler", "engine_gradients", "install", "set_cuda_arch_list"]
