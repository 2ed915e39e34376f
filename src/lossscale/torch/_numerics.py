"""``NumericsMonitor``: the float16/float8 numerics of a model's gradients, every N steps."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lossscale.numerics import Report
from lossscale.torch._reader import scale_reader

__all__ = ["NumericsMonitor", "NumericsNoGradientsWarning"]


class NumericsNoGradientsWarning(RuntimeWarning):
    """Warned when a sampled :meth:`NumericsMonitor.record` finds no gradient to count.

    Example:
      >>> import torch, warnings
      >>> from lossscale.torch import NumericsMonitor, NumericsNoGradientsWarning
      >>> monitor = NumericsMonitor(torch.nn.Linear(2, 2), every=1)
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     monitor.record()  # before any backward pass: no .grad
      True
      >>> caught[0].category is NumericsNoGradientsWarning, monitor.report.rows
      (True, [])
    """


_NO_GRADIENTS = (
    "NumericsMonitor.record(): step {step} was sampled but no gradient was found (every "
    "parameter's .grad is None, or gradients= returned none), so no row was added. Call "
    "record() after the backward pass and before zero_grad(); an engine that keeps its "
    "gradients outside .grad (DeepSpeed's ZeRO optimizers (stages 1-3) keep them in their own "
    "partitioned buffers) needs gradients=, e.g. "
    "NumericsMonitor(engine.module, scaler, gradients=lossscale.deepspeed.engine_gradients("
    "engine))"
)


class NumericsMonitor:
    """Every ``every``-th step, what float16 (or float8) makes of a model's gradients.

    Call :meth:`record` once per iteration after the backward pass and before ``unscale_`` or
    ``step`` (which unscale ``.grad`` in place): it reads each parameter's ``.grad`` as the
    scaled backward left it (``scale * true gradient``), counts it against the formats at
    that scale, and adds a row per parameter and format to :attr:`report`, with the scale in
    use (sparse gradients are left out). With ``modules=True`` each module's incoming
    gradient (``grad_output``, where a float16 backward underflows) is counted too, as
    ``module:<name>``, caught by a hook on the module's output tensor during the sampled
    step's backward pass.

    Args:
      model: the ``torch.nn.Module`` whose parameters' gradients are reported.
      scaler: the scaler whose scale is reported against: any
        :class:`~lossscale.torch.ScaleReader` (lossscale's ``GradScaler``,
        ``ShardedGradScaler``, ``LossScaleOptimizer``, the scaler
        ``lossscale.deepspeed.install`` returns, the ``lossscale.megatron`` scalers), a
        framework's own (``torch.amp.GradScaler``, DeepSpeed's loss scalers, Megatron-core's
        grad scalers: read through :func:`~lossscale.torch.scale_reader`), or None (no loss
        scaling).
      every: sample steps 0, every, 2 * every, ... (counted by :meth:`record`).
      formats: format names or dtypes (``torch.float16``, ``np.float16``,
        ``jnp.bfloat16``), as for :func:`lossscale.numerics.tensor_stats`.
      modules: also report each module's incoming gradient (leaf modules only).
      path: a ``.jsonl`` or ``.csv`` log that gets every row (see
        :class:`lossscale.numerics.Report`).
      gradients: where the gradients are: a function returning ``(name, tensor)`` pairs,
        called on each sampled step; default: each parameter's ``.grad``. An engine that keeps
        them elsewhere needs one: DeepSpeed's ZeRO optimizers (stages 1-3) leave ``.grad``
        None and keep them in partitioned buffers (``lossscale.deepspeed.engine_gradients(
        engine)`` reads them there).

    A sampled step that finds no gradient at all adds no row and warns
    (``NumericsNoGradientsWarning``), saying why: it never records nothing in silence.

    Costs: on an unsampled step :meth:`record` only advances a Python counter, and the module
    hooks (a Python call per module in the forward pass) return at once: no aten op, no host
    sync. A sampled step reads each gradient a few times per format (integer comparisons and
    sums, an exponent histogram) and reads all counts back with one host sync.

    Raises:
      TypeError: ``model`` is not a module, ``scaler`` is of an unknown kind, or
        ``gradients`` is not callable.
      ValueError: ``every`` < 1 or a format is unknown.

    Example:
      >>> import torch
      >>> from lossscale.torch import GradScaler, NumericsMonitor
      >>> model = torch.nn.Linear(4, 2)
      >>> scaler = GradScaler("cpu", init_scale=2.0**10)
      >>> monitor = NumericsMonitor(model, scaler, every=10)
      >>> scaler.scale(model(torch.full((3, 4), 1e-9)).sum()).backward()
      >>> monitor.record()
      True
      >>> [(r.tensor, r.underflow) for r in monitor.report.rows]
      [('weight', 0.0), ('bias', 0.0)]
    """

    def __init__(
        self,
        model: torch.nn.Module,
        scaler: Any = None,
        *,
        every: int = 100,
        formats: Any = ("float16",),
        modules: bool = False,
        path: str | os.PathLike[str] | None = None,
        gradients: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if gradients is not None and not callable(gradients):
            raise TypeError(f"gradients must be a function or None, got {gradients!r}")
        self._reader = scale_reader(scaler)  # TypeError now, not at the first sampled step
        self.report = Report(formats, every=every, path=path)
        self.model = model
        self.scaler = scaler
        self.gradients = gradients
        self.steps = 0
        self._captured: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        if modules:
            for name, module in model.named_modules():
                if next(module.children(), None) is None:  # a leaf module
                    self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not self.report.due(self.steps) or not isinstance(output, torch.Tensor):
                return
            if output.requires_grad and torch.is_floating_point(output):

                def capture(grad: torch.Tensor) -> None:
                    self._captured[f"module:{name}"] = grad

                output.register_hook(capture)  # type: ignore[no-untyped-call]

        return hook

    def record(self) -> bool:
        """Count this step's gradients if it is sampled; returns whether it was.

        Host syncs: none on an unsampled step; one on a sampled step.
        """
        step = self.steps
        self.steps += 1
        if not self.report.due(step):
            return False
        found = (
            self.gradients()
            if self.gradients is not None
            else ((name, p.grad) for name, p in self.model.named_parameters())
        )
        tensors = [(name, g) for name, g in found if g is not None and not g.is_sparse]
        tensors += sorted(self._captured.items())
        self._captured = {}
        if not tensors:
            warnings.warn(_NO_GRADIENTS.format(step=step), NumericsNoGradientsWarning, stacklevel=2)
            return True
        reader = self._reader
        scale = 1.0 if reader is None else reader.current_loss_scale()
        self.report.record(step, tensors, loss_scale=scale)
        return True

    def close(self) -> None:
        """Remove the module hooks and close the log file."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.report.close()
