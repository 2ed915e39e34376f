"""The numerics report on JAX: jit-safe counts of a gradient pytree, and their host side.

Sampling is decided in Python, outside ``jax.jit``: the train step takes a static flag and
computes :func:`gradient_counts` only when it is set, so the unsampled step compiles to
exactly the program it would be without the report (no ``lax.cond``, whose branches and
predicate would sit in every step's program), and the sampled step is a second compiled
variant.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale.jax._gradients import is_inexact
from lossscale.jax._state import current_scale
from lossscale.numerics import Report
from lossscale.numerics._counts import RowOps, check_scale, count_row, decode_row, targets_of
from lossscale.numerics._formats import FloatFormat, format_of_dtype, thresholds

__all__ = ["GradientCounts", "grad_stats", "gradient_counts", "record"]


def _named_leaves(grads: Any) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    return [
        (jax.tree_util.keystr(path, simple=True, separator="/") or "leaf", leaf)
        for path, leaf in leaves
        if is_inexact(leaf) and hasattr(leaf, "shape")
    ]


@jax.tree_util.register_pytree_node_class
class GradientCounts:
    """The count rows of a gradient pytree and the loss scale, as :func:`gradient_counts`
    returns them from a jitted step (a pytree: rows and scale are arrays; names, dtypes,
    sizes and formats are static). Hand it to :func:`record` on the host.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale.jax import gradient_counts
      >>> counts = jax.jit(gradient_counts)({"w": jnp.ones(3), "b": jnp.zeros(2)})
      >>> counts.names, counts.sizes, counts.formats
      (('b', 'w'), (2, 3), ('float16',))
    """

    def __init__(
        self,
        rows: tuple[Any, ...],
        loss_scale: Any,
        names: tuple[str, ...],
        sources: tuple[str, ...],
        sizes: tuple[int, ...],
        formats: tuple[str, ...],
    ) -> None:
        self.rows, self.loss_scale = rows, loss_scale
        self.names, self.sources, self.sizes, self.formats = names, sources, sizes, formats

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (self.rows, self.loss_scale), (self.names, self.sources, self.sizes, self.formats)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> GradientCounts:
        return cls(children[0], children[1], *aux)


def gradient_counts(
    grads: Any, state: Any = None, *, formats: Any = ("float16",)
) -> GradientCounts:
    """Count every floating leaf of ``grads`` against ``formats`` at scale 1 (jit-safe).

    Args:
      grads: the gradient pytree as the scaled backward left it (``scale * true
        gradient``): what float16 sees.
      state: the optax state holding the loss scale in use (from
        :func:`loss_scale_optimizer`), or None (scale 1).
      formats: format names or dtypes, as for :func:`lossscale.numerics.tensor_stats`.

    Returns:
      A :class:`GradientCounts` (return it from the jitted step; :func:`record` reads it).
      Under ``jax.jit`` the counts of a leaf fuse into about one read of it per format.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from lossscale.jax import gradient_counts, loss_scale_optimizer
      >>> state = loss_scale_optimizer(optax.sgd(0.1)).init(jnp.ones(2))
      >>> counts = jax.jit(gradient_counts)(jnp.array([1e-9, 2.0]), state)
      >>> float(counts.loss_scale), counts.rows[0].shape  # 3 + 3 counts, 256 exponent bins
      (32768.0, (262,))
    """
    targets = targets_of(formats)
    named = _named_leaves(grads)
    rows = tuple(count_row(leaf, targets) for _, leaf in named)
    scale = current_scale(state) if state is not None else jnp.ones((), jnp.float32)
    return GradientCounts(
        rows,
        scale,
        tuple(name for name, _ in named),
        tuple(str(jnp.dtype(leaf.dtype).name) for _, leaf in named),
        tuple(math.prod(leaf.shape) for _, leaf in named),
        targets,
    )


def record(report: Report, step: int, counts: GradientCounts) -> None:
    """Add ``counts`` (from :func:`gradient_counts`) to ``report`` as step ``step``.

    Host syncs: one (``jax.device_get`` of all rows and the scale together).

    Raises:
      TypeError: ``counts`` is not a GradientCounts.
      ValueError: it was counted against other formats than the report's.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale.jax import gradient_counts, record
      >>> from lossscale.numerics import Report
      >>> report = Report()
      >>> record(report, 0, jax.jit(gradient_counts)({"w": jnp.array([1e-9, 2.0])}))
      >>> report.rows[0].tensor, report.rows[0].underflow
      ('w', 0.5)
    """
    if not isinstance(counts, GradientCounts):
        raise TypeError(f"counts must be a GradientCounts, got {type(counts).__name__}")
    if counts.formats != report.formats:
        raise ValueError(f"counts are of formats {counts.formats}, the report's {report.formats}")
    rows, scale = jax.device_get((counts.rows, counts.loss_scale))
    entries = [
        (name, source, size, np.asarray(row).tolist())
        for name, source, size, row in zip(
            counts.names, counts.sources, counts.sizes, rows, strict=True
        )
    ]
    report.add_rows(step, entries, loss_scale=float(scale))


def _limits_on_host(source: str, targets: tuple[str, ...], dtype: Any) -> Any:
    def limits(scale: Any) -> Any:
        value = float(np.asarray(scale, np.float64))
        table = [thresholds(source, t, value)[:3] for t in targets]
        return np.asarray(table, dtype)

    return limits


def grad_stats(grads: Any, *, scale: Any = 1.0, formats: Any = ("float16",)) -> Any:
    """:class:`~lossscale.numerics.TensorStats` per format of every floating leaf (jit-safe).

    Args:
      grads: a pytree of arrays.
      scale: the factor applied before the cast: a positive host number, or a 0-d float
        array (traced under ``jax.jit`` too: the exact thresholds are then computed on the host
        by a ``jax.pure_callback``, one host round trip per call).
      formats: format names or dtypes.

    Returns:
      A pytree of ``grads``' structure whose floating leaves are ``{format: TensorStats}`` of
      0-d arrays (fractions float32; ``amax`` as float32, exact for float16, bfloat16 and
      float32 leaves); other leaves are None.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale.jax import grad_stats
      >>> grads = {"w": jnp.array([1e-9, 1e-3, 0.0, 2.0], jnp.float32)}
      >>> s = jax.jit(lambda g: grad_stats(g, scale=2.0**4))(grads)["w"]["float16"]
      >>> float(s.underflow), float(s.zeros), float(s.amax)
      (0.25, 0.25, 2.0)
    """
    targets = targets_of(formats)
    traced = isinstance(scale, jax.Array)
    value = 1.0 if traced else check_scale(scale)

    def one(leaf: Any) -> Any:
        if not (is_inexact(leaf) and hasattr(leaf, "shape")):
            return None
        source = format_of_dtype(str(jnp.dtype(leaf.dtype).name))
        limits = None
        if traced:
            int_dtype = np.int64 if source.bits == 64 else np.int32
            shape = jax.ShapeDtypeStruct((len(targets), 3), int_dtype)  # type: ignore[no-untyped-call]
            table = jax.pure_callback(
                _limits_on_host(source.name, targets, int_dtype), shape, scale
            )
            limits = [tuple(table[i]) for i in range(len(targets))]
        row = count_row(leaf, targets, value, limits=limits)
        size = math.prod(leaf.shape)
        return decode_row(row, source, targets, size, scale, ops=_DEVICE_OPS)

    return jax.tree_util.tree_map(one, grads, is_leaf=lambda x: x is None)


class _DeviceOps(RowOps):
    """:func:`~lossscale.numerics._counts.decode_row` on a row that stays on the device."""

    @staticmethod
    def count(value: Any) -> Any:
        return value

    @staticmethod
    def size(size: int) -> Any:
        return jnp.float32(size)

    @staticmethod
    def amax(source: FloatFormat, bits: Any, finite: Any) -> Any:
        width = {8: jnp.int8, 16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[source.bits]
        value = jax.lax.bitcast_convert_type(bits.astype(width), jnp.dtype(source.name))
        return value.astype(jnp.float32)

    @staticmethod
    def log2(value: Any) -> Any:
        return jnp.log2(jnp.asarray(value, jnp.float32))  # -inf at 0

    @staticmethod
    def scale(scale: Any) -> Any:
        return jnp.asarray(scale, jnp.float32)


_DEVICE_OPS = _DeviceOps()
