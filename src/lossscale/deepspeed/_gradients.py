"""The gradients of a DeepSpeed engine where it keeps them, for
:class:`lossscale.torch.NumericsMonitor` (``gradients=``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lossscale.deepspeed._install import check_engine


def engine_gradients(engine: Any) -> Callable[[], list[tuple[str, torch.Tensor]]]:
    """A function that returns the engine's gradients as ``(name, tensor)`` pairs, named as
    in ``engine.module``, for ``NumericsMonitor(engine.module, scaler, gradients=...)``.

    Each is DeepSpeed's ``deepspeed.utils.safe_get_full_grad(param)``: on ZeRO 0 the
    parameter's ``.grad``; on ZeRO 1-3, whose optimizers leave ``.grad`` None after the
    backward pass, the gradient assembled from DeepSpeed's partitioned buffers (as float32:
    exact copies of the float16 values the scaled backward left). Call it between
    ``engine.backward`` and ``engine.step``.

    Host syncs and collectives: on ZeRO 1-3 one all-reduce per parameter over the data-parallel
    group, so every rank must call it on the same steps (every rank's monitor samples the same
    steps); none on ZeRO 0.

    Raises:
      TypeError: ``engine`` is not a DeepSpeed engine (as for
        :func:`lossscale.deepspeed.install`).

    Example (in a training script)::

        monitor = NumericsMonitor(engine.module, scaler, gradients=engine_gradients(engine))
        engine.backward(loss)
        monitor.record()
        engine.step()

    It takes the engine, not its module:

      >>> import torch
      >>> from lossscale.deepspeed import engine_gradients
      >>> engine_gradients(torch.nn.Linear(2, 2))
      Traceback (most recent call last):
      ...
      TypeError: engine_gradients(engine) needs the DeepSpeed engine that deepspeed.initialize ...
    """
    check_engine(engine, "engine_gradients(engine)")
    from deepspeed.utils import safe_get_full_grad

    module = engine.module

    def gradients() -> list[tuple[str, torch.Tensor]]:
        return [(name, safe_get_full_grad(p)) for name, p in module.named_parameters()]

    return gradients
