"""PyTorch integration: ``LossScaleOptimizer`` for any ``torch.optim`` optimizer.

Importing this package imports torch (``import lossscale`` alone never does)::

    from lossscale.torch import LossScaleOptimizer
    opt = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

The experimental TF 2.3 form, ``LossScaleOptimizer(optimizer, loss_scale)``, is
:class:`lossscale.torch.experimental.LossScaleOptimizer`.
"""

from lossscale.torch import experimental
from lossscale.torch._optimizer import LossScaleOptimizer, step_together

__all__ = ["LossScaleOptimizer", "experimental", "step_together"]
