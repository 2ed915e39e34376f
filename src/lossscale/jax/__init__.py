"""JAX integration: functional loss-scale values, an optax transformation, a grad wrapper.

Importing this package imports jax and optax (``import lossscale`` alone never does)::

    from lossscale.jax import loss_scale_optimizer, scale_loss
    opt = loss_scale_optimizer(optax.adamw(1e-3))          # takes the SCALED grads
    grads = jax.grad(lambda p: scale_loss(loss_fn(p), state))(params)
    updates, state = opt.update(grads, state, params)       # unscale, check, apply or skip

For hand-written loops: :class:`DynamicLossScale` / :class:`FixedLossScale` (frozen pytrees with
``update``, ``adjust``, ``scale``, ``unscale``) and :func:`scaled_value_and_grad`. Every scale
update runs the one rule, :func:`lossscale.core.dynamic_update`.

The user switches of :func:`loss_scale_optimizer`: ``enabled=False`` (the inner update exactly),
the stall alarm (``stall_steps``/``on_stall``, read on the host with :func:`check_stall`), and
``multiplier``/``backoff_factor``. Diagnostics: :func:`nonfinite_paths` (host) and
:func:`finite_leaves` (jit) say which gradients are not finite.
Numerics: :func:`grad_stats` (jit) counts what float16 or float8 makes of each gradient;
:func:`gradient_counts` in a sampled jitted step and :func:`record` on the host fill a
:class:`lossscale.numerics.Report`.
"""

from lossscale._extras import require

require("jax", "JAX and optax", "jax", "jax", "optax")  # the extra named when missing


from lossscale.jax._diagnostics import finite_leaves, nonfinite_paths
from lossscale.jax._grad import scaled_value_and_grad
from lossscale.jax._gradients import all_finite
from lossscale.jax._numerics_report import GradientCounts, grad_stats, gradient_counts, record
from lossscale.jax._stall import StallCount
from lossscale.jax._state import (
    LossScaleState,
    check_stall,
    current_scale,
    last_applied,
    last_step_applied,
    scale_loss,
    skipped_steps,
    stalled_steps,
    unscale_grads,
)
from lossscale.jax._transform import loss_scale_optimizer
from lossscale.jax._values import DynamicLossScale, FixedLossScale, LossScale

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "GradientCounts",
    "LossScale",
    "LossScaleState",
    "StallCount",
    "all_finite",
    "check_stall",
    "current_scale",
    "finite_leaves",
    "grad_stats",
    "gradient_counts",
    "last_applied",
    "last_step_applied",
    "loss_scale_optimizer",
    "nonfinite_paths",
    "record",
    "scale_loss",
    "scaled_value_and_grad",
    "skipped_steps",
    "stalled_steps",
    "unscale_grads",
]
