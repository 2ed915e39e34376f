"""Integer operations of the array namespaces, for the numerics kernel
(:mod:`lossscale.numerics._counts`): a float array's bits as integers, counts below bounds, an
exponent histogram, and rows of counts. Mixed into the namespaces of
:mod:`lossscale.core._backends`; like them, none of these reads a device value back to the
host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
#: Entries times bounds above which torch's count_below compares bound by bound instead of
#: in one broadcast comparison (whose boolean temporary has that many bytes).
_BROADCAST_LIMIT = 1 << 26
#: Device types on which torch's count_below always compares bound by bound.
_BOUND_BY_BOUND = frozenset({"cpu"})
#: Device types on which torch's count_values adds each entry to its value's bin directly.
#: Elsewhere (a GPU) the adds are atomic, and atomics on one address serialize: with most
#: entries in a few bins (the exponents of one tensor cluster), the bins are copied into
#: _LANES lanes, entry i counted in lane i % _LANES, the lanes summed at the end.
_DIRECT_COUNT = frozenset({"cpu"})
_LANES = 1024
#: Entries counted per launch on a laned device (bounds the lane-index temporary and the
#: cached offsets), and the fewest entries that are laned at all.
_LANE_CHUNK = 1 << 20
_LANE_MIN = 1 << 16


class IntegerOps:
    """The integer operations every namespace provides."""

    def bits(self, x: Any) -> Any:
        """The bits of floating-point ``x`` as a signed integer array of the same width and
        shape (a view where the library has one; no host sync)."""
        raise NotImplementedError

    def count_values(self, ints: Any, length: int) -> Any:
        """A 1-D integer array of ``length``: how many entries of ``ints`` (integers in
        ``[0, length)``) equal each value. One pass, on ``ints``' device, no host sync."""
        raise NotImplementedError

    def count_below(self, ints: Any, bounds: Sequence[Any]) -> Any:
        """A 1-D integer array: for each bound (a Python int, or a 0-d integer array of this
        library), how many entries of the integer array ``ints`` are below it. About one read
        of ``ints`` for all bounds together; on ``ints``' device, no host sync."""
        raise NotImplementedError

    def stack_ints(self, values: Sequence[Any]) -> Any:
        """One 1-D integer array (int64, or JAX's default integer) of the 0-d and 1-d integer
        arrays ``values``, in order, on their device."""
        raise NotImplementedError


class NumpyIntegerOps(IntegerOps):
    """NumPy's."""

    def bits(self, x: Any) -> Any:
        x = np.asarray(x)
        return x.view(_SIGNED[x.dtype.itemsize])

    def count_values(self, ints: Any, length: int) -> Any:
        return np.bincount(np.asarray(ints).reshape(-1), minlength=length)

    def count_below(self, ints: Any, bounds: Sequence[Any]) -> Any:
        flat = np.asarray(ints).reshape(-1)
        return np.array([np.count_nonzero(flat < k) for k in bounds], np.int64)

    def stack_ints(self, values: Sequence[Any]) -> Any:
        return np.concatenate([np.asarray(v, np.int64).reshape(-1) for v in values])


class TorchIntegerOps(IntegerOps):
    """torch's (on the namespace's ``torch`` module and its cache of constants)."""

    torch: Any
    _constants: dict[Any, Any]

    def bits(self, x: Any) -> Any:
        t = self.torch
        return x.view({1: t.int8, 2: t.int16, 4: t.int32, 8: t.int64}[x.element_size()])

    def count_values(self, ints: Any, length: int) -> Any:
        # index_add_ of an expanded one: torch.bincount reads its input's maximum back to the
        # host on CUDA to size its output (a sync); this does not.
        t = self.torch
        flat = ints.reshape(-1)
        if flat.dtype not in (t.int32, t.int64):
            flat = flat.int()
        key = ("one", flat.device)
        one = self._constants.get(key)
        if one is None:  # a shared read-only 1, expanded (a view) to the input's length
            one = self._constants[key] = t.ones((), dtype=t.int64, device=flat.device)
        if flat.device.type in _DIRECT_COUNT or flat.numel() < _LANE_MIN:
            out = t.zeros(length, dtype=t.int64, device=flat.device)
            return out.index_add_(0, flat, one.expand(flat.numel()))
        laned = ("lanes", flat.device, flat.dtype, length)
        offsets = self._constants.get(laned)
        if offsets is None:  # entry i of a chunk goes to lane i % _LANES: offset lane * length
            index = t.arange(_LANE_CHUNK, device=flat.device)
            offsets = self._constants[laned] = ((index % _LANES) * length).to(flat.dtype)
        out = t.zeros(_LANES * length, dtype=t.int64, device=flat.device)
        step = offsets.numel()
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            out.index_add_(0, part + offsets[: part.numel()], one.expand(part.numel()))
        return out.view(_LANES, length).sum(0)

    def count_below(self, ints: Any, bounds: Sequence[Any]) -> Any:
        # On a GPU one comparison kernel for every bound at once (fewer launches); on the CPU,
        # and for tensors whose boolean temporary would be large, one bound at a time, which
        # the CPU runs faster (its simple kernels vectorise; measured on torch 2.13).
        t = self.torch
        flat = ints.reshape(-1)
        if flat.device.type in _BOUND_BY_BOUND or flat.numel() * len(bounds) > _BROADCAST_LIMIT:
            return t.stack([(flat < k).sum() for k in bounds])
        key = ("bounds", flat.device, flat.dtype, tuple(bounds))
        edges = self._constants.get(key)
        if edges is None:  # made by fills, once: a copy from the host would sync
            edges = self._constants[key] = t.stack(
                [t.full((), k, dtype=flat.dtype, device=flat.device) for k in bounds]
            ).unsqueeze(1)
        return (edges > flat).sum(1)  # [bounds, entries] booleans, summed row by row

    def stack_ints(self, values: Sequence[Any]) -> Any:
        # runs of 0-d values go through one stack: two ops where a view each would be many
        t = self.torch
        pieces: list[Any] = []
        run: list[Any] = []
        for v in values:
            if v.dim() == 0:
                run.append(v if v.dtype == t.int64 else v.long())
                continue
            if run:
                pieces.append(t.stack(run))
                run = []
            pieces.append(v.reshape(-1).long())
        if run:
            pieces.append(t.stack(run))
        return pieces[0] if len(pieces) == 1 else t.cat(pieces)


class JaxIntegerOps(IntegerOps):
    """JAX's (on the namespace's ``jax`` and ``jnp`` modules)."""

    jax: Any
    jnp: Any

    def bits(self, x: Any) -> Any:
        jnp = self.jnp
        width = jnp.dtype(x.dtype).itemsize
        signed = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[width]
        return self.jax.lax.bitcast_convert_type(x, signed)

    def count_values(self, ints: Any, length: int) -> Any:
        return self.jnp.bincount(ints.reshape(-1).astype(self.jnp.int32), length=length)

    def count_below(self, ints: Any, bounds: Sequence[Any]) -> Any:
        jnp = self.jnp
        flat = ints.reshape(-1)
        edges = jnp.stack([jnp.asarray(k).astype(flat.dtype) for k in bounds])
        return jnp.sum(edges[:, None] > flat, axis=1)  # one fused pass under jit

    def stack_ints(self, values: Sequence[Any]) -> Any:
        jnp = self.jnp
        int_dtype = self.jax.dtypes.canonicalize_dtype(jnp.int64)
        return jnp.concatenate([jnp.reshape(v, (-1,)).astype(int_dtype) for v in values])
