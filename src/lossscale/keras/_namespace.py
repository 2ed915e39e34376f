"""The core rule's array operations on Keras 3's backend tensors (``keras.ops``).

:func:`lossscale.core.dynamic_update` is written against :class:`lossscale.core.ArrayNamespace`;
this namespace runs it on whatever backend Keras uses (JAX, torch, TensorFlow), eagerly or
inside a traced train step, so the Keras optimizer calls the same rule as every front end.
"""

from __future__ import annotations

from typing import Any

import keras

from lossscale.core._backends import ArrayNamespace


class KerasNamespace(ArrayNamespace):
    """``keras.ops`` on backend tensors: 0-d constants, select, maximum, IEEE division."""

    name = "keras"

    def owns(self, x: Any) -> bool:
        return bool(keras.ops.is_tensor(x))

    def full_like(self, like: Any, value: float | int | bool) -> Any:
        return keras.ops.full_like(like, value)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return keras.ops.where(cond, a, b)

    def float32(self, x: Any) -> Any:
        return keras.ops.cast(x, "float32")

    def maximum(self, a: Any, b: Any) -> Any:
        return keras.ops.maximum(a, b)

    def divide(self, a: Any, b: Any) -> Any:
        return keras.ops.divide(a, b)


KERAS = KerasNamespace()
