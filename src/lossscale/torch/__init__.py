"""PyTorch integration: ``GradScaler`` (a drop-in for ``torch.amp.GradScaler``, for frameworks
and GradScaler-style loops), ``ShardedGradScaler`` (the same for FSDP1's) and
``LossScaleOptimizer`` (TensorFlow's API, for any ``torch.optim`` optimizer), on one engine;
``audit``: where a model overflows in float16, the modules to keep in float32 and the loss
scales that then fit.

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
from lossscale.torch._audit.finding import Finding
from lossscale.torch._audit.handle import PlanHandle, kept_by
from lossscale.torch._audit.plan import Float16Plan, load_plan
from lossscale.torch._audit.result import Float16Audit
from lossscale.torch._audit.run import audit
from lossscale.torch._numerics import NumericsMonitor, NumericsNoGradientsWarning
from lossscale.torch._optimizer import LossScaleOptimizer, step_together
from lossscale.torch._reader import ScaleReader, scale_reader
from lossscale.torch._scaler import GradScaler
from lossscale.torch._sharded import ShardedGradScaler
from lossscale.torch._step import Float16ParametersWarning
from lossscale.torch._trainer_logs import ScaleLog

__all__ = [
    "Finding",
    "Float16Audit",
    "Float16ParametersWarning",
    "Float16Plan",
    "GradScaler",
    "LossScaleOptimizer",
    "NumericsMonitor",
    "NumericsNoGradientsWarning",
    "PlanHandle",
    "ScaleLog",
    "ScaleReader",
    "ShardedGradScaler",
    "audit",
    "experimental",
    "kept_by",
    "load_plan",
    "scale_reader",
    "step_together",
]
