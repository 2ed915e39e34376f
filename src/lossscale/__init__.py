"""lossscale: TensorFlow's loss-scaling API for NumPy, PyTorch and JAX.

The public namespace is flat::

    import lossscale
    ls = lossscale.DynamicLossScale()          # or lossscale.get("dynamic")
    scaled_loss = loss * ls()
    ...                                         # backward, then divide the grads by the scale
    _, should_apply = ls.update(grads)          # skip the step when it is False

Layout: :mod:`lossscale.core` is the pure update rule over an array namespace;
:mod:`lossscale.stateful` the TensorFlow classes built on it; framework adapters live in their
own subpackages and are imported explicitly. Importing :mod:`lossscale` never imports torch,
jax or tensorflow.
"""

from lossscale import core
from lossscale._version import __version__
from lossscale.stateful import (
    DynamicLossScale,
    FixedLossScale,
    LossScale,
    deserialize,
    get,
    serialize,
)

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "__version__",
    "core",
    "deserialize",
    "get",
    "serialize",
]
