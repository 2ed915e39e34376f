"""Scaling, unscaling and the finite check on JAX pytrees.

The check is exact everywhere: "finite" means every floating element of every leaf is finite,
as TensorFlow's ``reduce_all(is_finite(g))``. How it is computed depends on the platform, chosen
when the computation is lowered (``lax.platform_dependent``; no branch at run time):

* **CPU**: XLA:CPU compiles a per-leaf ``all(isfinite(g))`` into a pass that writes a boolean
  mask of the whole leaf and a second pass that reduces it. Instead each leaf is summed in rows
  of up to :data:`ROW` elements (a free ``reshape``) after ``g - g``, which is 0 where ``g`` is
  finite and NaN where it is not (inf - inf is NaN). A row sum is therefore NaN exactly when
  its row holds a non-finite element, and it cannot overflow (a sum of zeros); summing ``g``
  itself could overflow on finite values, so it would not be exact. XLA:CPU runs these row
  sums in its vectorised reduction library: one read of the leaf, nothing written but the row
  sums, which are then checked a few at a time. Leaves of the same size (and dtype) are summed
  element-wise, up to :data:`SUMMED` at a time, into one row-sum kernel: still NaN exactly
  where some leaf is not finite, the same bytes read, and fewer kernels to compile for a model
  of many same-shaped leaves. A row *maximum* is not used: XLA:CPU does not guarantee that it
  propagates NaN. A leaf split across devices (GSPMD or explicit sharding) keeps the
  per-element check: regrouping it into rows would move gradient data between devices.
* **Other platforms** (GPU, TPU): ``all(isfinite(g))`` per leaf, which their compilers fuse into
  one reduction.

:func:`unscaled_all_finite` answers "are the *unscaled* gradients finite?". When the caller knows
the scale is at least 1 it reads the *scaled* gradients instead, with the same answer: the
reciprocal of the scale is then at most 1, so a finite gradient stays finite when unscaled, and
inf or NaN stays non-finite. The unscale multiply then fuses into the optimizer update instead
of being materialised for the check.

Per-leaf work is written with ``lax`` ops rather than ``jnp``'s wrappers (which add dtype
promotion and argument checks), to keep tracing and lowering of many-leaf steps cheap. The
measured costs are on the Performance page (``docs/performance.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

#: Longest row summed by the CPU check; a row is the largest power of two dividing a leaf's
#: size, up to this (rows of 128 to 1024 elements ran fastest on XLA:CPU).
ROW = 1024
#: Rows shorter than this run slowly; a leaf whose size has no power-of-two divisor this large
#: is summed along its trailing axes instead (enough of them to reach this length).
MIN_ROW = 128
#: Leaves of one size (and row length and dtype) summed element-wise into one reduction
#: kernel by the CPU check: fewer kernels to compile (see :func:`_finite_by_rows`).
SUMMED = 8
#: Row-sum vectors concatenated and checked together (see :func:`_finite_by_rows`).
GROUP = 4


def is_inexact(x: Any) -> bool:
    """Whether a pytree leaf holds floating-point (or complex) numbers: the leaves to check."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:  # a Python number
        return isinstance(x, float | complex)
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # float0 and other dtypes jnp does not know
        return False


def compute_dtype(dtype: Any) -> Any:
    """float32 for float16/bfloat16 (and smaller floats); the dtype itself otherwise."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


def scale_tree(tree: Any, scale: jax.Array) -> Any:
    """Every leaf times ``scale``, computed and returned in at least float32.

    A Python int leaf is taken as the Python float of its value (JAX would make it an int32
    array first, which fails from 2**31); one beyond float64's range is a ``ValueError``.
    """

    def one(x: Any) -> Any:
        if isinstance(x, int) and not isinstance(x, bool):
            try:
                x = float(x)
            except OverflowError:
                raise ValueError(
                    f"loss={x!r}: a Python int beyond float64's range cannot be scaled"
                ) from None
        x = jnp.asarray(x)
        dtype = jnp.promote_types(x.dtype, jnp.float32)
        return x.astype(dtype) * scale.astype(dtype)

    return jax.tree_util.tree_map(one, tree)


def _is_float0(x: Any) -> bool:
    """Whether ``x`` is a ``float0`` leaf (``jax.grad(..., allow_int=True)`` of an integer)."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def unscale_tree(tree: Any, scale: jax.Array) -> Any:
    """Every gradient leaf times the float32 reciprocal of ``scale``, in the leaf's own dtype.

    float16/bfloat16 leaves are multiplied in float32 and cast back (a float16 reciprocal of a
    large scale would be subnormal or 0). ``float0`` leaves (what ``jax.grad(...,
    allow_int=True)`` returns for integer inputs) are not gradients: they are returned
    unchanged, as no update. ``None`` is an empty subtree.

    Raises:
      TypeError: an integer, bool or other non-floating leaf, naming its path: applying it
        unscaled would be an update ``scale`` times too large. Checked when tracing.
    """
    inv = lax.div(jnp.float32(1), jnp.asarray(scale, jnp.float32))
    factors: dict[Any, jax.Array] = {}  # the reciprocal once per compute dtype, not per leaf

    def one(path: Any, g: Any) -> Any:
        if _is_float0(g):
            return g
        if not is_inexact(g):
            raise TypeError(
                f"gradient leaf {jax.tree_util.keystr(path) or '(root)'} has "
                f"{_describe(g)}; gradients must be floating point (an integer or bool "
                "gradient cannot be unscaled: it would be applied as is, scale times too large)"
            )
        g = jnp.asarray(g)
        compute = compute_dtype(g.dtype)
        if compute not in factors:
            factors[compute] = lax.convert_element_type(inv, compute)
        if compute == g.dtype:
            return lax.mul(g, factors[compute])
        product = lax.mul(lax.convert_element_type(g, compute), factors[compute])
        return lax.convert_element_type(product, g.dtype)

    return jax.tree_util.tree_map_with_path(one, tree)


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return f"type {type(x).__name__} ({x!r})"
    return f"dtype {dtype}"


def _inexact_leaves(tree: Any) -> list[jax.Array]:
    """The floating leaves of ``tree`` that hold any element, as arrays."""
    leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(tree) if is_inexact(x)]
    return [x for x in leaves if x.size]


def _is_finite(x: jax.Array) -> jax.Array:
    """Element-wise finiteness (``lax`` ops: cheaper to trace than ``jnp``'s wrappers)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return lax.bitwise_and(lax.is_finite(lax.real(x)), lax.is_finite(lax.imag(x)))
    return lax.is_finite(x)


def _all(flags: Sequence[jax.Array]) -> jax.Array:
    """AND of 0-d bool flags, as one reduction over their stack."""
    if not flags:
        return jnp.asarray(True)
    if len(flags) == 1:
        return flags[0]
    stacked = lax.concatenate([lax.broadcast(f, (1,)) for f in flags], 0)
    return lax.reduce_and(stacked, (0,))


def _finite_by_element(leaves: Sequence[jax.Array]) -> jax.Array:
    """The per-element check: ``all(isfinite(x))`` per leaf, AND-ed."""
    return _all([lax.reduce_and(_is_finite(x), tuple(range(x.ndim))) for x in leaves if x.size])


def _row_length(shape: tuple[int, ...], size: int) -> int:
    """How many consecutive elements of a leaf one row sum covers (see :data:`ROW`)."""
    if size <= ROW:
        return size
    row = min(size & -size, ROW)  # the largest power of two dividing size, capped
    if row >= MIN_ROW:
        return row
    row = 1
    for dim in reversed(shape):  # trailing axes, until the row is long enough
        row *= dim
        if row >= MIN_ROW:
            break
    return row


def _may_be_split(x: jax.Array) -> bool:
    """Whether ``x`` may be split across devices (GSPMD or explicit sharding on a mesh axis of
    more than one device; not the per-device values inside ``shard_map``/``pmap``). Regrouping
    such a leaf into rows would cross shard boundaries (an all-gather under GSPMD, an error
    under explicit sharding), so it gets the per-element check: a local reduction per shard and
    one scalar all-reduce. When the sharding cannot be read, True (the check is exact anyway).
    """
    try:
        mesh = jax.typeof(x).sharding.mesh
        if mesh.empty:
            return False
        manual = jax.sharding.AxisType.Manual
        return any(
            size > 1 and kind != manual
            for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True)
        )
    except Exception:  # any failure to read the sharding: take the safe path
        return True


def _row_sums(leaves: Sequence[jax.Array], row: int) -> jax.Array:
    """Row sums of ``sum_i (x_i - x_i)`` over leaves of one size and row length, each viewed
    as ``(size // row, row)``: NaN in a row exactly when some leaf holds a non-finite element
    there (``x - x`` is 0 or NaN; sums of zeros cannot overflow). One reduction kernel reads
    all of them; float16/bfloat16 are summed in float32."""

    def zeros_or_nans(x: jax.Array) -> jax.Array:
        d = lax.reshape(lax.sub(x, x), (x.size // row, row))
        dtype = compute_dtype(x.dtype)
        return d if dtype == d.dtype else lax.convert_element_type(d, dtype)

    first, *rest = leaves
    acc = zeros_or_nans(first)
    for x in rest:
        acc = lax.add(acc, zeros_or_nans(x))
    return lax.reduce_sum(acc, (1,))


def _finite_by_rows(leaves: Sequence[jax.Array]) -> jax.Array:
    """The CPU check: row sums of ``x - x`` (see :func:`_row_sums`), checked, AND-ed.

    Leaves of the same size, row length and dtype are summed element-wise, up to
    :data:`SUMMED` at a time, before their rows are reduced: one reduction kernel instead of
    one per leaf, the same bytes read. Leaves that may be split across devices are checked
    element by element."""
    split: list[jax.Array] = []  # checked element by element
    same: dict[tuple[int, int, Any], list[jax.Array]] = {}  # (size, row, dtype) -> leaves
    for x in leaves:
        if not x.size:
            continue
        if _may_be_split(x):
            split.append(x)
        else:
            row = _row_length(x.shape, x.size)
            same.setdefault((x.size, row, x.dtype), []).append(x)
    sums = [
        _row_sums(group[i : i + SUMMED], row)
        for (_, row, _), group in same.items()
        for i in range(0, len(group), SUMMED)
    ]
    # One concatenation of every group's sums would be a kernel with one operand per group,
    # slow to compile (XLA:CPU, ~0.15 s for 200 operands); a few at a time compile to small,
    # shared kernels.
    flags = []
    for i in range(0, len(sums), GROUP):
        group = sums[i : i + GROUP]
        dtype = jnp.result_type(*group)  # sums of several dtypes: concatenated in the widest
        group = [g if g.dtype == dtype else lax.convert_element_type(g, dtype) for g in group]
        flags.append(lax.reduce_and(_is_finite(lax.concatenate(group, 0)), (0,)))
    if split:
        flags.append(_finite_by_element(split))
    return _all(flags)


def _finite(leaves: list[jax.Array]) -> jax.Array:
    """Whether every element of every leaf is finite, by the platform's method."""
    if not leaves:
        return jnp.asarray(True)
    out: jax.Array = lax.platform_dependent(leaves, cpu=_finite_by_rows, default=_finite_by_element)
    return out


def all_finite(tree: Any) -> jax.Array:
    """0-d bool array: whether every floating-point element of every leaf of ``tree`` is finite.

    Integer, bool and ``float0`` leaves are finite by definition and are not read; an empty
    tree is finite. One read of every floating leaf and no host sync. On CPU each leaf is
    summed in rows after ``g - g`` (0 where finite, NaN where not; the sums cannot overflow)
    instead of writing an ``isfinite`` mask; elsewhere ``all(isfinite(g))`` per leaf. The
    answer is the element-wise one either way. Under ``pmap``/``shard_map`` the flag is per
    device: reduce it across devices yourself (see ``axis_name`` of
    :func:`lossscale.jax.loss_scale_optimizer`).

    Example:
      >>> import jax.numpy as jnp
      >>> from lossscale.jax import all_finite
      >>> bool(all_finite({"w": jnp.ones(3), "b": None})), bool(all_finite([jnp.inf]))
      (True, False)
    """
    return _finite(_inexact_leaves(tree))


def unscaled_all_finite(
    scaled_grads: Any, scale: jax.Array, *, scale_at_least_one: bool
) -> jax.Array:
    """Whether ``unscale_tree(scaled_grads, scale)`` is all finite.

    With ``scale_at_least_one`` (the caller knows the scale never drops below 1) the *scaled*
    gradients are checked: the same answer, without materialising the unscaled ones for the
    check. Should the scale be below 1 after all (a state replaced by hand), the answer is
    False: the step is skipped and a back-off lifts the scale to its floor, never an
    unchecked update. Without it, the unscaled gradients are checked.
    """
    if not scale_at_least_one:
        return all_finite(unscale_tree(scaled_grads, scale))
    return all_finite(scaled_grads) & (jnp.asarray(scale, jnp.float32) >= 1)


def reduce_finite(finite: jax.Array, axis_name: Any) -> jax.Array:
    """The flag AND-ed over the devices of ``axis_name`` (one scalar ``pmin``)."""
    if axis_name is None:
        return finite
    reduced: jax.Array = lax.pmin(finite.astype(jnp.int32), axis_name)  # type: ignore[no-untyped-call]
    return reduced > 0
