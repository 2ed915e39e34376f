"""Keras 3 integration: ``LossScaleOptimizer``, TensorFlow's API as a Keras optimizer.

Importing this package imports keras (``import lossscale`` alone never does); Keras's backend
(JAX, torch or TensorFlow) is the user's choice::

    import keras
    from lossscale.keras import LossScaleOptimizer
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.AdamW(1e-3)), loss="mse")

The scale follows the one rule, :func:`lossscale.core.dynamic_update`, on every backend.
:class:`NumericsCallback` reports what float16 or float8 makes of the gradients at that scale.
"""

from lossscale._extras import require

require("keras", "Keras 3", "keras", "keras")  # the extra named when keras is missing


from lossscale.keras import experimental
from lossscale.keras._numerics import NumericsCallback
from lossscale.keras._optimizer import LossScaleOptimizer

__all__ = ["LossScaleOptimizer", "NumericsCallback", "experimental"]
