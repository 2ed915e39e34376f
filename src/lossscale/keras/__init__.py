"""Keras 3 integration: ``LossScaleOptimizer``, TensorFlow's API as a Keras optimizer.

Importing this package imports keras (``import lossscale`` alone never does); Keras's backend
(JAX, torch or TensorFlow) is the user's choice::

    import keras
    from lossscale.keras import LossScaleOptimizer
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.AdamW(1e-3)), loss="mse")

The scale follows the one rule, :func:`lossscale.core.dynamic_update`, on every backend.
"""

# Without the framework, say which extra installs it (instead of a bare "No module named").
try:
    import keras  # noqa: F401
except ModuleNotFoundError as _missing:
    if _missing.name != "keras":
        raise
    raise ModuleNotFoundError(
        'lossscale.keras needs Keras 3: pip install "lossscale[keras]"', name=_missing.name
    ) from _missing

from lossscale.keras import experimental
from lossscale.keras._optimizer import LossScaleOptimizer

__all__ = ["LossScaleOptimizer", "experimental"]
