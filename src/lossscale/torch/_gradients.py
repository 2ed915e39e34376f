"""Gradient helpers of ``LossScaleOptimizer``: unscaled copies (TensorFlow's
``get_unscaled_gradients``) and the report of which gradients are not finite."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lossscale.torch import _engine as engine
from lossscale.torch._state import AnyScale, DisabledScale


def unscaled_copies(grads: Iterable[torch.Tensor | None], ls: AnyScale) -> list[Any]:
    """See ``LossScaleOptimizer.get_unscaled_gradients``: every entry checked before any
    kernel runs, then one multiply per gradient by the float32 reciprocal."""
    if isinstance(grads, torch.Tensor):  # iterating it would unscale its rows
        raise TypeError(
            "grads must be a list (or other iterable) of gradients, got a single tensor; "
            "pass [grad]"
        )
    grads = list(grads)
    for i, g in enumerate(grads):
        if g is not None and not (
            isinstance(g, torch.Tensor) and (g.is_floating_point() or g.is_complex())
        ):
            what = f"dtype {g.dtype}" if isinstance(g, torch.Tensor) else repr(g)
            raise TypeError(
                f"grads[{i}]: gradients must be floating-point (or complex) tensors or "
                f"None, got {what}"
            )
    if isinstance(ls, DisabledScale):
        return grads
    inv = ls.inv_scale()  # float32 reciprocal, as TensorFlow's 1.0 / loss_scale
    out: list[Any] = []
    for g in grads:
        if g is None:
            out.append(None)
            continue
        inv_g = inv if inv.device == g.device else inv.to(g.device, non_blocking=True)
        if g.dtype in engine.HALF:
            out.append((g.float() * inv_g).to(g.dtype))
        else:
            out.append(g * inv_g.to(g.dtype))
    return out


def nonfinite_report(
    param_groups: Sequence[dict[str, Any]], module: torch.nn.Module | None
) -> list[tuple[str, float]]:
    """See ``LossScaleOptimizer.nonfinite_gradients``: one reduction and one read (a host sync
    on a GPU) per gradient; DTensor gradients through this rank's shard (no collective)."""
    names = {}
    if module is not None:
        names = {id(p): n for n, p in module.named_parameters()}
    report = []
    for i, group in enumerate(param_groups):
        for j, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            g = engine.local(g)
            values = g._values() if g.is_sparse else g
            if values.numel() == 0:
                continue
            m = float(values.detach().abs().max().float().item())
            if not math.isfinite(m):
                report.append((names.get(id(p), f"param_groups[{i}][{j}]"), m))
    return report
