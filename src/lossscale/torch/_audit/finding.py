"""A place where float16 overflows: what the audit finds, what a plan file records."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Finding"]


class Finding(NamedTuple):
    """One place where float16 overflows: an operator of a module, in the forward or the
    backward pass (the same place on several batches is one finding, with the largest
    ``amax``).

    Attributes:
      module: the innermost module that ran the operator, named as in ``named_modules()``
        (``""``: the root, or code outside every module, such as the loss function's).
      phase: ``"forward"`` or ``"backward"``.
      op: the operator: a torch function (``"linear"``, ``"matmul"``) in the forward, an
        autograd node (``"MmBackward0"``, ``"ToCopyBackward0"``: a gradient cast down to
        float16) in the backward; ``"parameter"`` in ``"half"`` mode for a parameter of
        ``module`` that float16 cannot hold (``note`` names it; ``amax`` its float32 size).
      amax: the magnitude float16 had to hold: the forward, the largest the operator gives in
        float32 on the same operands; the backward, the largest gradient it produces at loss
        scale 1. ``inf`` where no finite value exists.
      intrinsic: True when no loss scale avoids it: a forward overflow, or a backward one at
        loss scale 1. False when it only bounds the loss scale (a backward overflow at
        ``scale`` and above).
      scale: the smallest power-of-two loss scale at which it overflows (None in the
        forward; 1.0 for an intrinsic backward overflow).
      fixable: False when no module kept in float32 removes it (``note`` says why).
      note: why it cannot be fixed by a module kept in float32, or ``""``.

    Example:
      >>> from lossscale.torch import Finding
      >>> f = Finding("model.lm_head", "backward", "MmBackward0", 9.5, False, 2.0**13)
      >>> f.kind, f.fixable
      ('bounds the scale', True)
    """

    module: str
    phase: str
    op: str
    amax: float
    intrinsic: bool
    scale: float | None
    fixable: bool = True
    note: str = ""

    @property
    def kind(self) -> str:
        """``"intrinsic"`` or ``"bounds the scale"``."""
        return "intrinsic" if self.intrinsic else "bounds the scale"
