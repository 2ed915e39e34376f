"""Flattening gradient structures the way ``tf.nest`` does, with type checks that name the entry.

Gradients come as any nesting of ``list``, ``tuple`` (named tuples included) and ``dict``
(visited in sorted key order, as ``tf.nest.flatten``), with ``None`` for variables that have no
gradient. Leaves are float arrays of one library (NumPy, torch or JAX) or Python floats.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from lossscale.core._backends import FLOAT_DTYPES, NUMPY, ArrayNamespace, namespace_of


class Leaves(NamedTuple):
    """The result of :func:`flatten_grads`.

    Attributes:
      arrays: the non-None leaves, in ``tf.nest.flatten`` order, Python floats converted to
        0-d float32 arrays of ``namespace`` (as TensorFlow converts them to float32 tensors).
      namespace: the library the arrays belong to, or None when there were no array leaves
        (only Python floats or nothing at all); then the caller picks one.

    Example:
      >>> import numpy as np
      >>> from lossscale.core import Leaves, flatten_grads
      >>> leaves = flatten_grads([None, (np.ones(2),), 0.5])
      >>> isinstance(leaves, Leaves), len(leaves.arrays), leaves.namespace
      (True, 2, <ArrayNamespace numpy>)
      >>> only_floats = flatten_grads([0.5, None])
      >>> [str(a.dtype) for a in only_floats.arrays], only_floats.namespace
      (['float32'], None)
    """

    arrays: list[Any]
    namespace: ArrayNamespace | None


def _walk(grads: Any, keys: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(keys, leaf) in tf.nest order; the keys become a path only for an error message."""
    if grads is None:
        return
    if isinstance(grads, Mapping):
        try:
            ordered = sorted(grads)
        except TypeError as err:
            raise TypeError(
                f"{_path(keys)}: dict keys must be sortable (tf.nest order), got {list(grads)!r}"
            ) from err
        for key in ordered:
            yield from _walk(grads[key], (*keys, key))
    elif isinstance(grads, list | tuple):
        for i, item in enumerate(grads):
            if item is None:
                continue
            if isinstance(item, Mapping | list | tuple):
                yield from _walk(item, (*keys, i))
            else:
                yield (*keys, i), item
    else:
        yield keys, grads


def _path(keys: tuple[Any, ...]) -> str:
    """``grads[0]['w']``: where a leaf is, for error messages."""
    return "grads" + "".join(f"[{k!r}]" for k in keys)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_float0(leaf: Any) -> bool:
    """Whether ``leaf`` is a JAX ``float0`` array (a NumPy array of the structured dtype
    ``[('float0', 'V')]``), recognised without importing JAX."""
    dtype = getattr(leaf, "dtype", None)
    return isinstance(dtype, np.dtype) and dtype.names == ("float0",)


def flatten_grads(grads: Any) -> Leaves:
    """Flatten ``grads`` and check every leaf is a float gradient.

    ``float0`` leaves (what ``jax.grad(..., allow_int=True)`` returns for integer inputs) are
    not gradients: they are left out, as ``None``.

    Raises:
      TypeError: naming the entry (``grads[0]['w']``) for an integer, bool, complex or string
        gradient, an object that is not an array, or arrays of two different libraries.

    Example:
      >>> import numpy as np
      >>> from lossscale.core import flatten_grads
      >>> leaves = flatten_grads({"b": [np.ones(2, np.float16), None], "a": 1.5})
      >>> [str(a.dtype) for a in leaves.arrays], leaves.namespace.name
      (['float32', 'float16'], 'numpy')
    """
    entries = list(_walk(grads, ()))
    namespace: ArrayNamespace | None = None
    floats: list[int] = []
    arrays: list[Any] = []
    for keys, leaf in entries:
        if isinstance(leaf, bool | int | complex | str | bytes):
            raise TypeError(
                f"{_path(keys)} is {_describe(leaf)} of type {type(leaf).__name__}; gradients "
                f"must be floating point (float16, bfloat16, float32 or float64)"
            )
        if isinstance(leaf, float) and not isinstance(leaf, np.generic):
            # A Python float (TensorFlow converts it to float32). np.float64 subclasses float
            # but is a NumPy scalar: it is judged in its own dtype, below.
            floats.append(len(arrays))
            arrays.append(leaf)
            continue
        if is_float0(leaf):
            continue  # jax.grad(..., allow_int=True) of an integer input: no gradient, as None
        ns = namespace_of(leaf)
        if ns is None:
            raise TypeError(
                f"{_path(keys)} is {_describe(leaf)} of type {type(leaf).__module__}."
                f"{type(leaf).__qualname__}; expected a NumPy array, a torch tensor, a JAX array "
                f"or a Python float"
            )
        dtype = ns.dtype_name(leaf)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{_path(keys)} has dtype {dtype}; gradients must be floating point "
                f"(float16, bfloat16, float32 or float64)"
            )
        if namespace is None:
            namespace = ns
        elif ns is not namespace:
            raise TypeError(
                f"{_path(keys)} is a {ns.name} array but earlier gradients are "
                f"{namespace.name} arrays; pass gradients of one library at a time"
            )
        arrays.append(leaf)
    if floats:
        target = namespace if namespace is not None else NUMPY
        like = next((a for a in arrays if not isinstance(a, float)), None)
        for i in floats:
            with np.errstate(over="ignore"):  # 1e39 becomes inf: a non-finite step (TF raises)
                value = np.float32(arrays[i])
            # Rounded on the host first: torch.full refuses a Python float beyond float32.
            arrays[i] = value if target is NUMPY else target.scalar(float(value), "float32", like)
    return Leaves(arrays, namespace)


def all_finite(grads: Any, like: Any | None = None) -> Any:
    """0-d bool array: whether every element of every gradient in ``grads`` is finite.

    ``grads`` is any nesting of list/tuple/dict with ``None`` entries (see
    :func:`flatten_grads`). Finiteness is judged in each gradient's own dtype; an empty
    structure is finite. The result is an array of the gradients' library on ``like``'s device
    (default: the first gradient's). No host sync.

    Example:
      >>> import numpy as np
      >>> from lossscale.core import all_finite
      >>> bool(all_finite([np.ones(3), None])), bool(all_finite({"w": np.array([np.inf])}))
      (True, False)
    """
    leaves = flatten_grads(grads)
    xp = leaves.namespace or NUMPY
    if like is None:
        like = leaves.arrays[0] if leaves.arrays else None
    if like is None:
        return xp.scalar(True, "bool", None)
    return xp.all_finite(leaves.arrays, like)
