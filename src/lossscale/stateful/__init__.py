"""The stateful API: TensorFlow's ``LossScale`` classes and their (de)serialization."""

from lossscale.core._checkpoint import STATE_VERSION
from lossscale.stateful._loss_scale import (
    DynamicLossScale,
    FixedLossScale,
    LossScale,
)
from lossscale.stateful._serialization import deserialize, get, serialize

__all__ = [
    "STATE_VERSION",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "deserialize",
    "get",
    "serialize",
]
