"""PyTorch integration: ``GradScaler`` (a drop-in for ``torch.amp.GradScaler``, for frameworks
and GradScaler-style loops), ``ShardedGradScaler`` (the same for FSDP1's) and
``LossScaleOptimizer`` (TensorFlow's API, for any ``torch.optim`` optimizer), on one engine.

Importing this package imports torch (``import lossscale`` alone never does)::

    from lossscale.torch import GradScaler, LossScaleOptimizer
    scaler = GradScaler()                                  # was: torch.amp.GradScaler()
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

The experimental TF 2.3 form, ``LossScaleOptimizer(optimizer, loss_scale)``, is
:class:`lossscale.torch.experimental.LossScaleOptimizer`.
"""

from lossscale._extras import require

require("torch", "PyTorch", "torch", "torch")  # the extra named when torch is missing


from lossscale.torch import experimental
from lossscale.torch._numerics import NumericsMonitor, NumericsNoGradientsWarning
from lossscale.torch._optimizer import LossScaleOptimizer, step_together
from lossscale.torch._reader import ScaleReader, scale_reader
from lossscale.torch._scaler import GradScaler
from lossscale.torch._sharded import ShardedGradScaler

__all__ = [
    "GradScaler",
    "LossScaleOptimizer",
    "NumericsMonitor",
    "NumericsNoGradientsWarning",
    "ScaleReader",
    "ShardedGradScaler",
    "experimental",
    "scale_reader",
    "step_together",
]
