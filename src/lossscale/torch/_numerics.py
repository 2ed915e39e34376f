"""``NumericsMonitor``: the float16/float8 numerics of a model's gradients, every N steps."""

from __future__ import annotations

import os
from typing import Any

import torch

from lossscale.numerics import Report

__all__ = ["NumericsMonitor"]


def _scale_of(scaler: Any) -> Any:
    """The scale in use, without a sync: a 0-d tensor, or 1.0 (no scaler, or disabled)."""
    if scaler is None:
        return 1.0
    ls = getattr(scaler, "_ls", None)  # lossscale's GradScaler and LossScaleOptimizer
    if ls is not None:
        return ls.scale
    if isinstance(scaler, torch.amp.GradScaler):
        scale = scaler._scale if scaler.is_enabled() else None
        return 1.0 if scale is None else scale
    raise TypeError(
        "scaler must be a lossscale GradScaler or LossScaleOptimizer, a torch.amp.GradScaler "
        f"or None, got {type(scaler).__name__}"
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
      scaler: the scaler whose scale is reported against: lossscale's ``GradScaler`` or
        ``LossScaleOptimizer``, a ``torch.amp.GradScaler``, or None (no loss scaling).
      every: sample steps 0, every, 2 * every, ... (counted by :meth:`record`).
      formats: format names, as for :func:`lossscale.numerics.tensor_stats`.
      modules: also report each module's incoming gradient (leaf modules only).
      path: a ``.jsonl`` or ``.csv`` log that gets every row (see
        :class:`lossscale.numerics.Report`).

    Costs: on an unsampled step :meth:`record` only advances a Python counter, and the module
    hooks (a Python call per module in the forward pass) return at once: no aten op, no host
    sync. A sampled step reads each gradient a few times per format (integer comparisons and
    sums, an exponent histogram) and reads all counts back with one host sync.

    Raises:
      TypeError: ``model`` is not a module, or ``scaler`` is of an unknown kind.
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
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _scale_of(scaler)  # TypeError now rather than at the first sampled step
        self.report = Report(formats, every=every, path=path)
        self.model = model
        self.scaler = scaler
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
        tensors: list[tuple[str, torch.Tensor]] = [
            (name, p.grad)
            for name, p in self.model.named_parameters()
            if p.grad is not None and not p.grad.is_sparse
        ]
        tensors += sorted(self._captured.items())
        self._captured = {}
        if tensors:
            self.report.record(step, tensors, loss_scale=_scale_of(self.scaler))
        return True

    def close(self) -> None:
        """Remove the module hooks and close the log file."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.report.close()
