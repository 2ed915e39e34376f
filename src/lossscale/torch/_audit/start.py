"""Where a run audited by :func:`lossscale.torch.audit` should start its dynamic loss scale:
inside the range, with headroom below its top for the gradients' growth early in training."""

from __future__ import annotations

__all__ = ["HEADROOM", "initial_scale"]

#: Doublings kept free below the range's top: the range is measured on the weights as they
#: are, and gradients grow in the first steps of training (the audit's test Llama with a massive
#: activation, AdamW at lr 1e-4: a start one doubling below the top backs off at step 22, two
#: below at step 28, three below not in 100 steps).
HEADROOM = 3


def initial_scale(scale_range: tuple[float, float] | None) -> float | None:
    """``max(low, high / 2**HEADROOM)`` for ``scale_range = (low, high)`` (powers of two): three
    doublings below the top, or the bottom when the range is narrower than that; None without
    a range.

    Example:
      >>> initial_scale((2.0**10, 2.0**17)), initial_scale((2.0**5, 2.0**6)), initial_scale(None)
      (16384.0, 32.0, None)
    """
    if scale_range is None:
        return None
    low, high = scale_range
    return max(low, high / 2.0**HEADROOM)
