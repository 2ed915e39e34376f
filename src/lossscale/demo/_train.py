"""The demo's training loop: a small MLP trained in float16 with NumPy, with or without scaling.

The task is chosen so that float16 gradients really underflow. A 2-layer tanh MLP (4 inputs, 48
hidden units, 32 outputs) regresses small targets (about 2e-5, made by a random "teacher"
network) with the mean squared error over a batch of 128 x 32 outputs. The gradient of the loss
with respect to each prediction is ``2 * (prediction - target) / 4096``: around 1e-8, below
float16's smallest subnormal (2**-24, about 6e-8), so most of it rounds to zero. Without loss
scaling almost every float16 gradient entry is zero and SGD stalls; multiplying the loss by the
scale before the backward pass keeps the gradients representable.

Numerics, step by step:

* master weights are float32; each step casts them (and the inputs, once) to float16;
* every layer takes float16 inputs and writes a float16 output, accumulating in float32 as
  tensor cores and fused GPU kernels do (``linear``: matmul plus bias; tanh; the tanh backward);
* the loss is computed in float32 from the float16 predictions (as mixed-precision frameworks
  do), and its gradient, scaled, is cast back to float16 where it enters the network;
* the float16 weight gradients are unscaled into float32, handed to
  :meth:`lossscale.DynamicLossScale.update`, and applied by SGD with momentum only when it says
  so.

NumPy's own float32 -> float16 cast takes a slow path (tens of times slower) whenever a result
is subnormal, which is exactly what this demo is about; :func:`to_float16` is a vectorized,
bit-exact replacement (the tests compare it with ``astype(np.float16)``), and
:func:`to_float32` is a table lookup.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from numpy.typing import NDArray

import lossscale
from lossscale.numerics import Report

__all__ = [
    "DEFAULT_STEPS",
    "INCREMENT_PERIOD",
    "INITIAL_LOSS_SCALE",
    "RunResult",
    "run",
    "to_float16",
    "to_float32",
]

#: Training steps of ``python -m lossscale demo`` without ``--steps``.
DEFAULT_STEPS: Final = 400
#: The scaled run's ``DynamicLossScale(initial_loss_scale=..., increment_period=...)``. The
#: period is far below the default 2000 so that growth and back-off show in a short run.
INITIAL_LOSS_SCALE: Final = 2**15
INCREMENT_PERIOD: Final = 10

# The problem. Every matmul stays under 2**18 multiply-adds: BLAS libraries then run it on one
# thread (OpenBLAS's threshold), which keeps the demo fast on a busy two-core machine, where
# their threads only wait for each other.
BATCH: Final = 128
N_IN: Final = 4
N_HIDDEN: Final = 48
N_OUT: Final = 32
TEACHER_HIDDEN: Final = 8
TARGET_SCALE: Final = 2.5e-5
LEARNING_RATE: Final = 1.0
MOMENTUM: Final = 0.9

F32 = NDArray[np.float32]
F16 = NDArray[np.float16]

# float16 bit pattern -> float32 value, for all 65536 patterns (exact: every float16 is a float32).
_HALF_TO_SINGLE: Final[F32] = (
    np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
)
_SMALLEST_NORMAL_BITS: Final = 0x38800000  # float32 bits of 2**-14, float16's smallest normal
_INFINITY_BITS: Final = 0x7F800000


def to_float32(x: F16) -> F32:
    """Widen a float16 array to float32 (exact; a table lookup, fast for subnormals too)."""
    return _HALF_TO_SINGLE[np.asarray(x, dtype=np.float16).view(np.uint16)]


def to_float16(x: F32) -> F16:
    """Round a float32 array to float16: IEEE round to nearest even, bit-exact ``astype``.

    Overflow gives ±inf, NaN stays NaN, and subnormal results are exact. It equals
    ``x.astype(np.float16)`` bit for bit (NaN payloads aside) without NumPy's slow path for
    subnormal results, and raises no floating-point warnings.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = (bits >> 16) & 0x8000
    magnitude = bits & 0x7FFFFFFF
    # Normal results: round the 23-bit significand to 10 bits (ties to even), rebias the
    # exponent from 127 to 15; anything at or above 65520 becomes inf (0x7C00).
    normal = np.minimum(
        ((magnitude + 0x0FFF + ((magnitude >> 13) & 1)) >> 13) - (112 << 10), 0x7C00
    )
    # Subnormal results (|x| < 2**-14): 0.5 + |x| in float32 rounds |x| to a multiple of 2**-24
    # (ties to even), and the low bits of that sum count the multiples.
    subnormal = (magnitude.view(np.float32) + np.float32(0.5)).view(np.uint32) - 0x3F000000
    half = np.where(magnitude < _SMALLEST_NORMAL_BITS, subnormal, normal)
    half = np.where(magnitude > _INFINITY_BITS, 0x7E00, half)  # NaN
    result: F16 = (half | sign).astype(np.uint16).view(np.float16)
    return result


@dataclass(frozen=True)
class RunResult:
    """What one training run did.

    Attributes:
      scaled: whether the loss was scaled by a :class:`lossscale.DynamicLossScale`.
      losses: the float32 loss of each step's forward pass (before that step's update).
      scales: the loss scale each step's backward pass used (empty for the unscaled run).
      skipped_steps: the steps (numbered from 1) whose gradients were not finite, so their
        update was skipped.
      final_scale: the scale after the last update (None for the unscaled run).
      zero_grad_fraction: over all steps, the fraction of float16 weight-gradient entries that
        were exactly zero (underflowed, before unscaling).
      seconds: wall time of the run.
      report: the numerics report of the sampled steps (None when not asked for): per
        backward tensor, what its float16 cast did, at the scale in use.

    Example:
      >>> from lossscale.demo import RunResult
      >>> result = RunResult(
      ...     scaled=True, losses=[4.0, 2.0, 1.0], scales=[8.0, 8.0, 4.0], skipped_steps=[2]
      ... )
      >>> result.skipped, result.initial_loss, result.final_loss
      (1, 4.0, 1.0)
    """

    scaled: bool
    losses: list[float]
    scales: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    final_scale: float | None = None
    zero_grad_fraction: float = 0.0
    seconds: float = 0.0
    report: Report | None = None

    @property
    def skipped(self) -> int:
        """How many steps were skipped."""
        return len(self.skipped_steps)

    @property
    def initial_loss(self) -> float:
        """The loss of the first step."""
        return self.losses[0]

    @property
    def final_loss(self) -> float:
        """The loss of the last step."""
        return self.losses[-1]


def _store_half(x: F32) -> F32:
    """Round to float16 and widen back: what writing a tensor in float16 and reading it does.

    The loop keeps every activation and gradient this way: float16 values, held in float32
    arrays only so that the next kernel can accumulate in float32 without another conversion.
    """
    return to_float32(to_float16(x))


def _store_sampled(wide: dict[str, F32] | None, name: str, value: F32) -> F32:
    """:func:`_store_half`, keeping the float32 ``value`` in ``wide`` (a sampled step's)."""
    if wide is not None:
        wide[name] = value
    return _store_half(value)


def make_problem(seed: int) -> tuple[F32, F32, list[F32]]:
    """The inputs, the targets and the initial float32 weights ``[w1, b1, w2, b2]``.

    Inputs are standard normal; targets are ``TARGET_SCALE * tanh(x @ t1) @ t2`` for a random
    teacher. The student's first layer is random, its output layer starts at zero.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, N_IN)).astype(np.float32)
    t1 = rng.standard_normal((N_IN, TEACHER_HIDDEN)) * (2.0 / np.sqrt(N_IN))
    t2 = rng.standard_normal((TEACHER_HIDDEN, N_OUT)) / np.sqrt(TEACHER_HIDDEN)
    y = (TARGET_SCALE * np.tanh(x @ t1) @ t2).astype(np.float32)
    w1 = (rng.standard_normal((N_IN, N_HIDDEN)) / np.sqrt(N_IN)).astype(np.float32)
    params = [
        w1,
        np.zeros(N_HIDDEN, np.float32),
        np.zeros((N_HIDDEN, N_OUT), np.float32),
        np.zeros(N_OUT, np.float32),
    ]
    return x, y, params


def run(
    scaled: bool,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    report_every: int | None = None,
) -> RunResult:
    """Train the demo MLP in float16 for ``steps`` SGD steps, with or without loss scaling.

    Args:
      scaled: scale the loss with ``lossscale.DynamicLossScale(INITIAL_LOSS_SCALE,
        INCREMENT_PERIOD)`` (2**15 and 10) and skip the steps whose gradients overflow;
        otherwise train on the raw float16 gradients.
      steps: number of training steps (≥ 1).
      seed: seeds the data and the initial weights; both runs with one seed see the same ones.
      on_step: called after every step with the number of steps done and that step's loss.
      report_every: sample the numerics every this many steps (steps 0, N, 2N, ...; None:
        no report): each float32 result of the backward pass, just before it is stored in
        float16, is counted against float16 (:class:`lossscale.numerics.Report`).

    Returns:
      A :class:`RunResult`. The run is deterministic given ``seed``.

    Example:
      >>> from lossscale.demo import run
      >>> scaled, plain = run(scaled=True, steps=30), run(scaled=False, steps=30)
      >>> scaled.skipped, scaled.final_scale, plain.final_scale  # grew at steps 10, 20, 30
      (0, 262144.0, None)
      >>> plain.zero_grad_fraction > 0.99, scaled.final_loss < plain.final_loss / 5
      (True, True)
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    start = time.perf_counter()
    x, y, params = make_problem(seed)
    x_half = _store_half(x)  # the inputs in float16 (cast once: they do not change)
    velocity = [np.zeros_like(p) for p in params]
    loss_scale = (
        lossscale.DynamicLossScale(
            initial_loss_scale=INITIAL_LOSS_SCALE, increment_period=INCREMENT_PERIOD
        )
        if scaled
        else None
    )
    grad_of_mean = 2.0 / y.size  # d mean((pred - y)**2) / d pred = grad_of_mean * (pred - y)
    losses: list[float] = []
    scales: list[float] = []
    skipped_steps: list[int] = []
    zeros = entries = 0
    report = Report(("float16",), every=report_every) if report_every is not None else None
    for step in range(steps):
        scale = float(loss_scale()) if loss_scale is not None else 1.0
        # Every array below holds float16 values (see _store_half); the gradients handed to the
        # loss scale are real float16 arrays until they are unscaled.
        w1, b1, w2, b2 = (_store_half(p) for p in params)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected, not warned
            # Forward in float16: each kernel accumulates in float32 and writes float16.
            z = _store_half(x_half @ w1 + b1)
            h = _store_half(np.tanh(z))
            pred = _store_half(h @ w2 + b2)
            # The loss in float32; its gradient, times the scale, enters the network in float16.
            err = pred - y
            losses.append(float(np.mean(err * err)))
            # Backward in float16: each float32 result below is stored in float16 (where the
            # report, on a sampled step, counts what that cast does).
            wide: dict[str, F32] | None = {} if report is not None and report.due(step) else None
            store = functools.partial(_store_sampled, wide)
            g_pred = store("output", err * np.float32(scale * grad_of_mean))
            g_w2 = to_float16(store("layer2.weight", h.T @ g_pred))
            g_b2 = to_float16(store("layer2.bias", g_pred.sum(axis=0)))
            g_h = store("hidden", g_pred @ w2.T)
            g_z = store("tanh", g_h * (1.0 - h * h))  # tanh backward, one fused kernel
            g_w1 = to_float16(store("layer1.weight", x_half.T @ g_z))
            g_b1 = to_float16(store("layer1.bias", g_z.sum(axis=0)))
            if report is not None and wide is not None:
                report.record(step, wide, loss_scale=scale)
        grads16 = [g_w1, g_b1, g_w2, g_b2]
        # Unscale in float32: g = g16 / scale.
        grads = [to_float32(g) / np.float32(scale) for g in grads16]
        zeros += sum(int(np.count_nonzero(g == 0)) for g in grads)
        entries += sum(g.size for g in grads)
        apply = True
        if loss_scale is not None:
            scales.append(scale)
            _, should_apply = loss_scale.update(grads)
            apply = bool(should_apply)
        if apply:
            for p, v, g in zip(params, velocity, grads, strict=True):
                v *= np.float32(MOMENTUM)
                v += g
                p -= np.float32(LEARNING_RATE) * v
        else:
            skipped_steps.append(step + 1)
        if on_step is not None:
            on_step(step + 1, losses[-1])
    return RunResult(
        scaled=scaled,
        losses=losses,
        scales=scales,
        skipped_steps=skipped_steps,
        final_scale=float(loss_scale()) if loss_scale is not None else None,
        zero_grad_fraction=zeros / entries,
        seconds=time.perf_counter() - start,
        report=report,
    )
