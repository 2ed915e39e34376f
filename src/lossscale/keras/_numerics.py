"""``NumericsCallback``: the float16/float8 numerics of a Keras model's gradients, every N steps.

Keras's trainers keep the gradients inside their compiled train step, out of a callback's
reach, so on a sampled step the callback computes them once more, on a batch the user gives,
with the backend's own differentiation (``jax.grad``, ``tf.GradientTape``,
``torch.autograd.grad``), the loss multiplied by the optimizer's current loss scale: the
gradients a scaled backward pass produces, which is what float16 sees.
"""

from __future__ import annotations

import os
from typing import Any

import keras
from keras import ops

from lossscale.numerics import Report

__all__ = ["NumericsCallback"]


def _scale_of(optimizer: Any) -> float:
    """The optimizer's current loss scale (1.0 without one); reads it on the host."""
    scale = getattr(optimizer, "loss_scale", None)  # lossscale's LossScaleOptimizer
    if scale is None:
        scale = getattr(optimizer, "dynamic_scale", None)  # Keras's own
    return 1.0 if scale is None else float(ops.convert_to_numpy(scale))


def _loss_fn(model: Any, loss: Any) -> Any:
    chosen = loss if loss is not None else getattr(model, "loss", None)
    if chosen is None or isinstance(chosen, list | tuple | dict):
        raise ValueError(
            "NumericsCallback needs one loss function: compile the model with a single loss "
            f"or pass loss=, got {chosen!r}"
        )
    return keras.losses.get(chosen)


def scaled_gradients(model: Any, x: Any, y: Any, loss: Any, scale: float) -> list[Any]:
    """The gradients of ``mean(loss(y, model(x))) * scale`` with respect to the trainable variables,
    as arrays of the backend (NumPy arrays on TensorFlow, which lossscale's kernel does not
    read directly)."""
    backend = keras.backend.backend()
    variables = model.trainable_variables
    if backend == "jax":
        import jax

        non_trainable = [v.value for v in model.non_trainable_variables]

        def scaled_loss(trainable: list[Any]) -> Any:
            y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return ops.mean(ops.cast(loss(y, y_pred), "float32")) * scale

        return list(jax.grad(scaled_loss)([v.value for v in variables]))
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = ops.mean(ops.cast(loss(y, model(x, training=True)), "float32")) * scale
        return [ops.convert_to_numpy(g) for g in tape.gradient(value, variables)]
    if backend == "torch":
        import torch

        value = ops.mean(ops.cast(loss(y, model(x, training=True)), "float32")) * scale
        return list(torch.autograd.grad(value, [v.value for v in variables]))
    raise NotImplementedError(f"NumericsCallback does not support the {backend!r} backend")


class NumericsCallback(keras.callbacks.Callback):  # type: ignore[misc]
    """Every ``every``-th training batch, what float16 (or float8) makes of the model's
    gradients at the optimizer's loss scale.

    On a sampled batch it computes the gradients of the model's loss on ``data`` (one extra
    forward and backward pass, the loss multiplied by the current loss scale of the
    optimizer: lossscale's or Keras's ``LossScaleOptimizer``, else 1) and adds a row per
    trainable variable (named by its path) and format to :attr:`report`. On other batches it
    only advances a Python counter: no backend op, no host sync.

    Args:
      data: ``(x, y)``: the batch to differentiate on a sampled step (NumPy arrays or
        backend tensors).
      every: sample batches 0, every, 2 * every, ... of the whole fit (counted here).
      formats: format names or dtypes, as for :func:`lossscale.numerics.tensor_stats`.
      loss: the loss function (default: the model's compiled loss, which must be one).
      path: a ``.jsonl`` or ``.csv`` log (see :class:`lossscale.numerics.Report`).

    Raises:
      TypeError: ``data`` is not an ``(x, y)`` pair.
      ValueError: ``every`` < 1, a format is unknown, or (at the first sample) the model has
        no single loss.

    Example:
      >>> import keras, numpy as np
      >>> from lossscale.keras import LossScaleOptimizer, NumericsCallback
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
      >>> x = np.ones((8, 4), "float32")
      >>> y = np.full((8, 1), 1e-9, "float32")
      >>> callback = NumericsCallback((x, y), every=2)
      >>> _ = model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
      >>> callback.report.steps, callback.report.rows[0].loss_scale
      ([0], 32768.0)
    """

    def __init__(
        self,
        data: Any,
        *,
        every: int = 100,
        formats: Any = ("float16",),
        loss: Any = None,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(data, tuple | list) or len(data) != 2:
            raise TypeError(f"data must be an (x, y) pair, got {type(data).__name__}")
        self.report = Report(formats, every=every, path=path)
        self.data = tuple(data)
        self.loss = loss
        self.steps = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """Count the gradients if this batch is sampled."""
        step = self.steps
        self.steps += 1
        if not self.report.due(step):
            return
        model = self.model
        scale = _scale_of(model.optimizer)
        x, y = self.data
        grads = scaled_gradients(model, x, y, _loss_fn(model, self.loss), scale)
        named = [
            (v.path, g)
            for v, g in zip(model.trainable_variables, grads, strict=True)
            if g is not None
        ]
        self.report.record(step, named, loss_scale=scale)

    def on_train_end(self, logs: Any = None) -> None:
        """Close the log file."""
        self.report.close()
