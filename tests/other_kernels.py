"""Another CPU's matrix products, for the docs' "another CPU" runs.

Two CPUs compute in different orders and with different kernels (vector widths, blocking, MKL's
and oneDNN's paths for Intel and for AMD processors, vectorized or scalar transcendentals), so
float32 results differ in their last bits, and float16 ones (accumulated in float32, rounded
once) where the float32 sum lies near a float16 rounding boundary. This mode moves every matrix
product (``mm``, ``bmm``, ``addmm``, ``baddbmm``, a convolution), where those differences end up
in a model: a float32 result has a third of its entries multiplied by ``1 + 2**-16`` and a third
by ``1 - 2**-16`` (about a hundred float32 ulps: the differences of a long float32 sum, and of
what came before it, amplified); a float16 or bfloat16 result is computed again in float32, its
entries moved the same way by ``2**-20`` (about 0.1% of them then round the other way, as
measured between two code paths of one CPU), and rounded to its dtype. A page whose printed
numbers follow the arithmetic in detail (the smallest weight after 20 float16 training steps,
to 3 digits: it printed 6.57e-06 on an Intel Xeon and 6.85e-06 on an AMD EPYC) prints something
else under it, as on another machine; one whose numbers hold with a margin prints the same.

``start()`` enters the mode for the rest of the process (the docs runner calls it before a
page's first block). Not collected by pytest (no ``_test`` suffix); the docs test runs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

_aten = torch.ops.aten
#: The products whose results are nudged.
PRODUCTS = {
    _aten.mm.default,
    _aten.bmm.default,
    _aten.addmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
}
#: The relative moves: float32 results; float32 sums before a cast down to float16/bfloat16.
FLOAT32_MOVE, SUM_MOVE = 2.0**-16, 2.0**-20
_LOW = (torch.float16, torch.bfloat16)


def _pattern(out: torch.Tensor, move: float) -> torch.Tensor:
    """``1 + move``, ``1 - move`` and 1 on entries ``i % 3 == 0, 1, 2`` (float32)."""
    which = torch.arange(out.numel(), device=out.device).reshape(out.shape) % 3
    factor = torch.ones(out.shape, dtype=torch.float32, device=out.device)
    factor = torch.where(which == 0, 1.0 + move, factor)
    return torch.where(which == 1, 1.0 - move, factor)


class OtherKernels(TorchDispatchMode):
    """Moves the results of :data:`PRODUCTS` as another CPU's kernels would (module doc)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in PRODUCTS or not isinstance(out, torch.Tensor) or not out.numel():
            return out
        if out.dtype == torch.float32:
            return out * _pattern(out, FLOAT32_MOVE)
        if out.dtype in _LOW:

            def up(x: Any) -> Any:
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW else x

            exact = func(*tree_map(up, args), **tree_map(up, kwargs))
            moved = (exact * _pattern(out, SUM_MOVE)).to(out.dtype)
            # where the float32 sum overflows the dtype, keep the kernel's own inf
            return torch.where(torch.isfinite(moved), moved, out)
        return out


def start() -> OtherKernels:
    """Enter :class:`OtherKernels` for the rest of the process and return it."""
    mode = OtherKernels()
    mode.__enter__()
    return mode
