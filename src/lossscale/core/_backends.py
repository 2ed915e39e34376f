"""Array namespaces: the few array operations the update rule needs, per library.

Frameworks are recognised lazily, from modules the user already imported (`sys.modules`), in
the manner of einops' ``_backends.py``: importing :mod:`lossscale` never imports torch, jax or
tensorflow. A namespace wraps one library; the rule in :mod:`lossscale.core._rule` is written
once against this interface and runs unchanged on NumPy arrays, torch tensors (any device)
and JAX arrays (eager or traced under ``jax.jit``).

None of the operations here read a device value back to the host, except the ones named
``to_host_*``; those are used only by accessors that document a host sync.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from lossscale.core._integers import IntegerOps, JaxIntegerOps, NumpyIntegerOps, TorchIntegerOps

#: Names of the gradient dtypes whose finiteness can be judged (TensorFlow's ``is_finite`` set).
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


class ArrayNamespace(IntegerOps):
    """The array operations of one library, as used by the loss-scale rule.

    Subclasses exist for NumPy, torch and JAX. They create 0-d constants on the device of an
    existing array (``full_like``), select (``where``), compare and reduce; none of these
    synchronises with a device.

    Example:
      >>> import numpy as np
      >>> from lossscale.core import ArrayNamespace, namespace_of
      >>> xp = namespace_of(np.ones(2, np.float16))
      >>> isinstance(xp, ArrayNamespace), xp.name, xp.dtype_name(np.ones(2, np.float16))
      (True, 'numpy', 'float16')
      >>> one = xp.scalar(1.0, "float32", None)
      >>> float(xp.divide(one, xp.full_like(one, 4.0)))
      0.25
      >>> bool(xp.all_finite([one, np.array([1.0, np.inf])], one))
      False
    """

    name: str = ""

    def owns(self, x: Any) -> bool:
        """Whether ``x`` is an array of this library."""
        raise NotImplementedError

    def dtype_name(self, x: Any) -> str:
        """The dtype of ``x`` as a NumPy-style name (``'float16'``, ``'bfloat16'``, ``'int32'``)."""
        raise NotImplementedError

    def scalar(self, value: float | int | bool, dtype: str, like: Any | None) -> Any:
        """A new 0-d array holding ``value`` with dtype ``'float32'``, ``'int'`` or ``'bool'``.

        It lives on the device of ``like`` (the library's default device when ``like`` is
        None). ``'int'`` is int64, or JAX's default integer (int32 unless x64 is enabled).
        Allocates one 0-d array with a fill, never a host-to-device copy that would sync.
        """
        raise NotImplementedError

    def full_like(self, like: Any, value: float | int | bool) -> Any:
        """A 0-d array of ``like``'s dtype and device holding ``value`` (no host sync)."""
        raise NotImplementedError

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """Elementwise select; all three are arrays of this library."""
        raise NotImplementedError

    def float32(self, x: Any) -> Any:
        """``x`` rounded to float32 (``x`` itself, no op, when it is float32 already)."""
        raise NotImplementedError

    def maximum(self, a: Any, b: Any) -> Any:
        """Elementwise maximum, propagating NaN."""
        raise NotImplementedError

    def divide(self, a: Any, b: Any) -> Any:
        """IEEE division ``a / b``, correctly rounded (never a multiplication by ``1 / b``)."""
        return a / b

    def all_finite(self, leaves: Sequence[Any], like: Any) -> Any:
        """0-d bool: whether every element of every leaf is finite, judged in its own dtype.

        An empty sequence (or only empty arrays) is finite. The result is on ``like``'s device.
        """
        raise NotImplementedError

    def errstate(self) -> contextlib.AbstractContextManager[None]:
        """A context in which float overflow in the rule (refused growth) raises no warning."""
        return contextlib.nullcontext()

    def copy(self, x: Any) -> Any:
        """A new array equal to ``x`` (for snapshot semantics on mutable libraries)."""
        return x

    def to_host_float(self, x: Any) -> float:
        """``x`` as a Python float. Synchronises with the device when ``x`` lives on one."""
        return float(x)

    def to_host_int(self, x: Any) -> int:
        """``x`` as a Python int. Synchronises with the device when ``x`` lives on one."""
        return int(x)

    def is_traced(self, x: Any) -> bool:
        """Whether ``x`` is a placeholder of a tracing transformation (``jax.jit``)."""
        return False

    def on_host(self, x: Any) -> bool:
        """Whether ``x`` lives in host memory, so that reading it costs no device sync."""
        return True

    def same_place(self, a: Any, b: Any) -> bool:
        """Whether two arrays of this library live on the same device."""
        return True

    def move(self, x: Any, like: Any) -> Any:
        """``x`` (of this library) moved to ``like``'s device (device-to-device, no host sync)."""
        return x

    def __repr__(self) -> str:
        return f"<ArrayNamespace {self.name}>"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle and copy as a reference to the one shared instance (for objects that keep
        their state's namespace: they pickle and deep-copy with it)."""
        return _named_namespace, (self.name, type(self).__name__)


class NumpyNamespace(NumpyIntegerOps, ArrayNamespace):
    """NumPy: arrays live in host memory; every operation is synchronous by nature."""

    name = "numpy"

    def owns(self, x: Any) -> bool:
        return isinstance(x, np.ndarray | np.generic)

    def dtype_name(self, x: Any) -> str:
        dtype = x.dtype
        name = _NUMPY_DTYPE_NAMES.get(dtype)
        if name is None:  # numpy's dtype.name is slow (~10 us): computed once per dtype
            name = _NUMPY_DTYPE_NAMES[dtype] = str(dtype.name)
        return name

    def scalar(self, value: float | int | bool, dtype: str, like: Any | None) -> Any:
        np_dtype = {"float32": np.float32, "int": np.int64, "bool": np.bool_}[dtype]
        return np.asarray(value, dtype=np_dtype)

    def full_like(self, like: Any, value: float | int | bool) -> Any:
        return np.asarray(value, dtype=np.asarray(like).dtype)

    def float32(self, x: Any) -> Any:
        return np.asarray(x, dtype=np.float32)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        # 0-d operands of one dtype (the rule's state: arrays, or NumPy scalars from their
        # arithmetic): a new 0-d array of the chosen one, several times faster than np.where
        if (
            getattr(a, "shape", None) == ()
            and getattr(b, "shape", None) == ()
            and a.dtype == b.dtype
            and np.ndim(cond) == 0
        ):
            return np.array(a if cond else b)
        return np.asarray(np.where(cond, a, b))

    def maximum(self, a: Any, b: Any) -> Any:
        return np.asarray(np.maximum(a, b))

    def all_finite(self, leaves: Sequence[Any], like: Any) -> Any:
        # isfinite into a reused buffer, chunk by chunk: fast for every dtype (NumPy's float16
        # min/max reductions are ~15x slower than its isfinite), no temporary the size of a
        # gradient, and an early exit at the first non-finite chunk.
        buffer = np.empty(0, dtype=bool)
        for leaf in leaves:
            flat = np.asarray(leaf).reshape(-1)  # a view when contiguous
            if flat.size <= _CHUNK:
                if not np.isfinite(flat).all():
                    return np.asarray(False)
                continue
            for start in range(0, flat.size, _CHUNK):
                chunk = flat[start : start + _CHUNK]
                if buffer.size < chunk.size:
                    buffer = np.empty(_CHUNK, dtype=bool)
                out = buffer[: chunk.size]
                np.isfinite(chunk, out=out)
                if not out.all():
                    return np.asarray(False)
        return np.asarray(True)

    def errstate(self) -> contextlib.AbstractContextManager[None]:
        return _np_errstate()

    def copy(self, x: Any) -> Any:
        return np.array(x, copy=True)


_NUMPY_DTYPE_NAMES: dict[Any, str] = {}
_CHUNK = 1 << 16  # elements per isfinite call in NumpyNamespace.all_finite (64 KiB of bools)


def _np_errstate() -> contextlib.AbstractContextManager[Any]:
    # a fresh np.errstate (not a generator around one: half the cost, ~2.5 us)
    return np.errstate(over="ignore", invalid="ignore")


class NumpyScalarNamespace(NumpyNamespace):
    """The rule on NumPy scalars (``np.float32``, ``np.float64``, ``np.int64``, ``np.bool_``)
    instead of 0-d arrays: for a front end that keeps the rule's state on the host and
    advances it every step (``lossscale.torch`` after a host-decided step).

    NumPy rounds its scalar arithmetic exactly as its array arithmetic, so the rule's
    results are the same values, bit for bit, as immutable scalars, at a fraction of the 0-d
    arrays' host time (selects return an operand; constants are made once per dtype and
    value; docs/performance.md has the figures). Not chosen by :func:`namespace_of` (scalars
    belong to NumPy's namespace there): a caller passes it as ``xp``.
    """

    name = "numpy"

    def __init__(self) -> None:
        self._constants: dict[tuple[Any, float | int | bool], Any] = {}

    def owns(self, x: Any) -> bool:
        return isinstance(x, np.generic)

    def scalar(self, value: float | int | bool, dtype: str, like: Any | None) -> Any:
        np_type = {"float32": np.float32, "int": np.int64, "bool": np.bool_}[dtype]
        return np_type(value)

    def full_like(self, like: Any, value: float | int | bool) -> Any:
        key = (like.dtype, value)
        constant = self._constants.get(key)
        if constant is None:
            constant = self._constants[key] = like.dtype.type(value)
        return constant

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        if type(a) is type(b):  # the rule's selects: one scalar type, nothing to promote
            return a if cond else b
        return np.where(cond, a, b)[()]

    def float32(self, x: Any) -> Any:
        return x if type(x) is np.float32 else np.float32(x)

    def maximum(self, a: Any, b: Any) -> Any:
        return np.maximum(a, b)

    def copy(self, x: Any) -> Any:
        return x  # immutable


class TorchNamespace(TorchIntegerOps, ArrayNamespace):
    """PyTorch tensors on any device. Only used once ``torch`` is in ``sys.modules``."""

    name = "torch"

    def __init__(self, torch_module: Any) -> None:
        self.torch = torch_module
        self._constants: dict[Any, Any] = {}
        t = torch_module
        self._names = {
            t.float16: "float16",
            t.bfloat16: "bfloat16",
            t.float32: "float32",
            t.float64: "float64",
        }

    def owns(self, x: Any) -> bool:
        return isinstance(x, self.torch.Tensor)

    def dtype_name(self, x: Any) -> str:
        name = self._names.get(x.dtype)
        return name if name is not None else str(x.dtype).removeprefix("torch.")

    def scalar(self, value: float | int | bool, dtype: str, like: Any | None) -> Any:
        t = self.torch
        torch_dtype = {"float32": t.float32, "int": t.int64, "bool": t.bool}[dtype]
        device = like.device if like is not None else None
        # torch.full launches a fill kernel; torch.tensor(value, device=cuda) would copy from
        # pageable host memory and synchronise the stream.
        return t.full((), value, dtype=torch_dtype, device=device)

    def full_like(self, like: Any, value: float | int | bool) -> Any:
        # The rule's constants are read-only inputs of new tensors (every output of the rule
        # comes from a where), so eager calls share one tensor per (device, dtype, value)
        # instead of a fill kernel each. Inside torch.compile the constant is traced as usual.
        t = self.torch
        if t.compiler.is_compiling():
            return t.full_like(like, value)
        key = (like.device, like.dtype, like.shape, type(value), value)
        cached = self._constants.get(key)
        if cached is None:
            if len(self._constants) > 256:  # e.g. many devices or changing rules: start over
                self._constants.clear()
            cached = self._constants[key] = t.full_like(like, value)
        return cached

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self.torch.where(cond, a, b)

    def float32(self, x: Any) -> Any:
        return x.float()  # the tensor itself when float32: no op

    def maximum(self, a: Any, b: Any) -> Any:
        return self.torch.maximum(a, b)

    def all_finite(self, leaves: Sequence[Any], like: Any) -> Any:
        t = self.torch
        flags = []
        for leaf in leaves:
            values = leaf._values() if leaf.is_sparse else leaf
            if values.numel() == 0:
                continue
            flag = t.isfinite(values).all()
            if flag.device != like.device:
                flag = flag.to(like.device, non_blocking=True)
            flags.append(flag)
        if not flags:
            return t.ones((), dtype=t.bool, device=like.device)
        if len(flags) == 1:
            return flags[0]
        return t.stack(flags).all()

    def copy(self, x: Any) -> Any:
        return x.clone()

    def to_host_float(self, x: Any) -> float:
        return float(x.item())

    def to_host_int(self, x: Any) -> int:
        return int(x.item())

    def same_place(self, a: Any, b: Any) -> bool:
        return bool(a.device == b.device)

    def on_host(self, x: Any) -> bool:
        return bool(x.device.type == "cpu")

    def move(self, x: Any, like: Any) -> Any:
        return x.to(like.device, non_blocking=True)


class JaxNamespace(JaxIntegerOps, ArrayNamespace):
    """JAX arrays, eager or traced. Only used once ``jax`` is in ``sys.modules``."""

    name = "jax"

    def __init__(self, jax_module: Any) -> None:
        import jax.numpy as jnp  # jax itself is already imported by the user

        self.jax = jax_module
        self.jnp = jnp

    def owns(self, x: Any) -> bool:
        return isinstance(x, self.jax.Array)

    def dtype_name(self, x: Any) -> str:
        return str(self.jnp.dtype(x.dtype).name)

    def scalar(self, value: float | int | bool, dtype: str, like: Any | None) -> Any:
        jnp = self.jnp
        int_dtype = self.jax.dtypes.canonicalize_dtype(jnp.int64)  # int32 unless x64 is on
        jax_dtype = {"float32": jnp.float32, "int": int_dtype, "bool": jnp.bool_}[dtype]
        out = jnp.asarray(value, dtype=jax_dtype)
        if like is not None and not self.is_traced(like) and not self.is_traced(out):
            out = self.jax.device_put(out, like.sharding)
        return out

    def full_like(self, like: Any, value: float | int | bool) -> Any:
        return self.jnp.full_like(like, value)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self.jnp.where(cond, a, b)

    def float32(self, x: Any) -> Any:
        return x.astype(self.jnp.float32)

    def maximum(self, a: Any, b: Any) -> Any:
        return self.jnp.maximum(a, b)

    def divide(self, a: Any, b: Any) -> Any:
        # Under jax.jit, XLA rewrites a division by a constant into a multiplication by its
        # rounded reciprocal (10 / 3 -> 3.3333335, not 3.3333333). The barrier hides that the
        # divisor is a constant, so the division stays correctly rounded, as in TensorFlow.
        return a / self.jax.lax.optimization_barrier(b)

    def all_finite(self, leaves: Sequence[Any], like: Any) -> Any:
        jnp = self.jnp
        flags = [jnp.all(jnp.isfinite(leaf)) for leaf in leaves if leaf.size]
        if not flags:
            return jnp.asarray(True)
        if len(flags) == 1:
            return flags[0]
        return jnp.all(jnp.stack(flags))

    def is_traced(self, x: Any) -> bool:
        return isinstance(x, self.jax.core.Tracer)

    def on_host(self, x: Any) -> bool:
        return not self.is_traced(x) and all(d.platform == "cpu" for d in x.devices())


NUMPY = NumpyNamespace()
#: The rule on NumPy scalars (see :class:`NumpyScalarNamespace`), passed as ``xp``.
NUMPY_SCALARS = NumpyScalarNamespace()
_cache: dict[str, ArrayNamespace] = {}


def _framework_namespaces() -> list[ArrayNamespace]:
    """Namespaces of the frameworks the user has imported, created on first need."""
    found: list[ArrayNamespace] = []
    for name, cls in (("torch", TorchNamespace), ("jax", JaxNamespace)):
        module = sys.modules.get(name)
        if module is None:
            continue
        ns = _cache.get(name)
        if ns is None:
            ns = cls(module)
            _cache[name] = ns
        found.append(ns)
    return found


def namespace_of(x: Any) -> ArrayNamespace | None:
    """The namespace owning array ``x``, or None for anything that is not a known array.

    NumPy arrays and NumPy scalars belong to NumPy. torch tensors and JAX arrays are
    recognised only when their library is already imported (never imported here).

    Example:
      >>> import numpy as np
      >>> from lossscale.core import namespace_of
      >>> namespace_of(np.ones(3)), namespace_of(np.float16(1)), namespace_of([1.0])
      (<ArrayNamespace numpy>, <ArrayNamespace numpy>, None)
    """
    if NUMPY.owns(x):
        return NUMPY
    for ns in _framework_namespaces():
        if ns.owns(x):
            return ns
    return None


def _named_namespace(name: str, class_name: str) -> ArrayNamespace:
    """The shared namespace ``name`` (of class ``class_name``): unpickling's counterpart of
    :meth:`ArrayNamespace.__reduce__`; importing the library when it is torch or JAX."""
    if class_name == NumpyScalarNamespace.__name__:
        return NUMPY_SCALARS
    if name == "numpy":
        return NUMPY
    if name in ("torch", "jax"):
        importlib.import_module(name)
        for ns in _framework_namespaces():
            if ns.name == name:
                return ns
    raise ValueError(f"unknown array namespace {name!r}")
