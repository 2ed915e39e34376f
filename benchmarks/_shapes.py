"""What the NumPy and PyTorch benchmarks share: the parameter sets (shapes only, no arrays) and
the loss scale they start every timed call from."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The scale of every timed step (growth is disabled, so only a skip changes it).
SCALE = 2.0**15
#: A ``DynamicLossScale.state_dict()`` at SCALE: loaded before each timed call to undo a skip.
SCALE_STATE = {
    "version": 1,
    "class_name": "DynamicLossScale",
    "current_loss_scale": SCALE,
    "num_good_steps": 0,
    "num_nonfinite_steps": 0,
}


@dataclass(frozen=True)
class ParamSet:
    """A named list of tensor shapes."""

    name: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    @property
    def n_elements(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def _transformer(width: int, layers: int) -> list[tuple[int, ...]]:
    """12 tensors per layer: qkv, attention out, two MLP matrices, their biases, two norms."""
    w = width
    layer = [(w, 3 * w), (3 * w,), (w, w), (w,), (w, 4 * w), (4 * w,), (4 * w, w), (w,)]
    layer += [(w,)] * 4
    return layer * layers


def param_sets(quick: bool) -> list[ParamSet]:
    """Few big tensors, a transformer-like set, many small tensors.

    Full: 24 tensors / 25.2M elements, 300 / 25.0M, 2000 / 2.0M. ``quick``: the same kinds at
    about 1% of the elements (and 200 small tensors instead of 2000), to exercise the code only.
    """
    if quick:
        return [
            ParamSet("big", ((10_000,),) * 24),
            ParamSet("transformer", tuple(_transformer(28, 25))),
            ParamSet("small", ((100,),) * 200),
        ]
    return [
        ParamSet("big", ((1024 * 1024,),) * 24),
        ParamSet("transformer", tuple(_transformer(288, 25))),
        ParamSet("small", ((1000,),) * 2000),
    ]
