"""What the float16 audit knows of torch's operators and autograd nodes (which only move
values, which cast, which write into a tensor; their names and operands), and how it keeps
their magnitudes on the device and reads them in one transfer (see
:func:`lossscale.torch.audit`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "CASTS",
    "COMPUTING",
    "FLOAT16",
    "FLOAT16_MAX",
    "LEAF",
    "MOVES",
    "MOVING",
    "MOVING_NODES",
    "all_finite",
    "float16_max",
    "grouped_norms",
    "magnitudes",
    "mask_arithmetic",
    "may_give_float16",
    "moves",
    "node_kind",
    "op_name",
    "operands",
    "exact_ints",
    "ints_of",
    "read_all",
    "results",
    "tensors_in",
    "upcast",
    "writes",
]

FLOAT16 = torch.float16
#: The largest finite float16 (65504): attention masks fill with its negative.
FLOAT16_MAX = torch.finfo(torch.float16).max
#: Operators that move values without computing new ones: their results cannot overflow.
MOVES = frozenset(
    [
        *("get", "getitem", "view", "view_as", "reshape", "reshape_as", "transpose", "permute"),
        *("t", "contiguous", "expand", "expand_as", "unsqueeze", "squeeze", "flatten"),
        *("unflatten", "chunk", "split", "split_with_sizes", "tensor_split", "narrow", "select"),
        *("detach", "clone", "movedim", "unbind", "cat", "stack", "repeat", "repeat_interleave"),
        *("gather", "index_select", "roll", "tril", "triu", "masked_fill", "flip", "as_strided"),
    ]
)
#: Casts: what float16 had to hold is the operand itself.
CASTS = frozenset(("to", "half", "type", "_to_copy", "to_copy"))
#: Backward nodes of those operators: a gradient passes through them unchanged in value.
MOVING_NODES = (
    "View",
    "UnsafeView",
    "Reshape",
    "Transpose",
    "Permute",
    "TBackward",
    "Squeeze",
    "Unsqueeze",
    "Clone",
    "Slice",
    "Select",
    "AsStrided",
    "Split",
    "Unbind",
    "Alias",
)


def float16_max() -> float:
    """65504, the largest finite float16."""
    return float(FLOAT16_MAX)


def upcast(tree: Any) -> Any:
    """``tree`` with each float16 and bfloat16 tensor in it cast to float32."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
            return x.float()
        return x

    return tree_map(cast, tree)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def results(out: list[Any] | tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors in an operator's list or tuple result, as :func:`tensors_in` finds them (a
    flat walk when nothing in it nests)."""
    if any(isinstance(x, list | tuple | dict) for x in out):
        return tensors_in(out)
    return [x for x in out if isinstance(x, torch.Tensor)]


def operands(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among an operator's arguments (a flat walk for the common shapes)."""
    found = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, list | tuple):
            for y in x:
                if isinstance(y, torch.Tensor):
                    found.append(y)
                elif isinstance(y, list | tuple | dict):
                    found.extend(tensors_in(y))
        elif isinstance(x, dict):
            found.extend(tensors_in(x))
    return found


def op_name(func: Any) -> str:
    name = str(getattr(func, "__name__", func))
    if name.startswith("__r") and name.endswith("__") and name not in ("__repr__",):
        name = "__" + name[3:]  # __rmul__ is mul
    return name.strip("_") or name


#: Whether torch has ``torch._foreach_max`` (a list's maxima in one call).
_FOREACH_MAX = hasattr(torch, "_foreach_max")


def magnitudes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The largest magnitude of each tensor (none empty), as 0-d tensors on its device (NaN
    where it holds a NaN, inf where an inf): no host read. On a GPU one reduction launch per
    dtype (a ``torch._foreach_norm`` of the tensors of that dtype: its multi-tensor kernel
    needs one dtype); on the CPU ``abs`` then ``max`` (faster there than the norm's float16
    kernel), two ``torch._foreach`` calls for them all where torch has ``_foreach_max``."""
    if not tensors:
        return []
    if tensors[0].device.type == "cpu":
        with torch.no_grad():
            if _FOREACH_MAX and all(t.is_cpu for t in tensors):
                return list(torch._foreach_max(torch._foreach_abs(tensors)))
            return [t.abs().amax() for t in tensors]
    return grouped_norms(tensors)


def grouped_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`magnitudes` as on a GPU: the infinity norm of each tensor, one launch per dtype."""
    if len(tensors) == 1:
        return [torch.linalg.vector_norm(tensors[0].detach(), math.inf)]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for idx in groups.values():
        group = [tensors[i].detach() for i in idx]
        if len(group) == 1:
            norms: Any = [torch.linalg.vector_norm(group[0], math.inf)]
        else:
            norms = torch._foreach_norm(group, math.inf)
        for i, n in zip(idx, norms, strict=True):
            out[i] = n
    return out


def read_all(values: list[torch.Tensor]) -> list[float]:
    """Tensors to floats in one transfer: each tensor's entries in order (a 0-d tensor gives
    one), through float64 (exact for float16 and float32 values and for integers below
    2**53), stacked or concatenated per dtype and device, then one ``tolist``."""
    if not values:
        return []
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault((v.dtype, v.device), []).append(i)
    device = values[0].device
    pieces, order = [], []
    for idx in groups.values():
        group = [values[i] for i in idx]
        if all(v.dim() == 0 for v in group):
            pieces.append(torch.stack(group))
        else:
            pieces.append(torch.cat([v.reshape(-1) for v in group]))
        order.extend(idx)
    moved = [p.to(device=device, dtype=torch.float64) for p in pieces]
    flat = (moved[0] if len(moved) == 1 else torch.cat(moved)).tolist()
    parts: list[list[float]] = [[] for _ in values]
    start = 0
    for i in order:
        n = values[i].numel()
        parts[i], start = flat[start : start + n], start + n
    return [x for part in parts for x in part]


def exact_ints(ints: torch.Tensor) -> torch.Tensor:
    """A 1-D int64 tensor as its high and low 32 bits (``[2, n]``), each exact through
    :func:`read_all`'s float64; :func:`ints_of` puts the read values back together."""
    ints = ints.reshape(-1).long()
    return torch.stack([ints >> 32, ints & 0xFFFFFFFF])


def ints_of(values: list[float]) -> list[int]:
    """The ints of :func:`exact_ints`, from its ``2 * n`` values read by :func:`read_all`."""
    n = len(values) // 2
    return [(int(hi) << 32) | int(lo) for hi, lo in zip(values[:n], values[n:], strict=True)]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite (one reduction, one host read)."""
    if not t.numel():
        return True
    return bool(torch.isfinite(t.detach()).all())


def mask_arithmetic(out: torch.Tensor, operands: list[torch.Tensor]) -> bool:
    """Whether every non-finite entry of ``out`` lies where an operand holds +-65504, the value
    attention masks are filled with (``finfo(float16).min``): adding to it gives -inf, which
    softmax turns into an exact 0, not an overflow of the model's values."""
    bad = ~torch.isfinite(out)
    covered = torch.zeros_like(bad)
    for x in operands:
        if x.dtype != FLOAT16:
            continue
        try:
            covered |= torch.broadcast_to(x.abs() == FLOAT16_MAX, out.shape)
        except RuntimeError:
            continue
    return bool((bad & ~covered).sum() == 0)


#: Whether a torch function writes into a tensor (``add_``, ``x[i] = v``), by function.
_WRITES: dict[Any, bool] = {}


def writes(func: Any) -> bool:
    found = _WRITES.get(func)
    if found is None:
        name = str(getattr(func, "__name__", ""))
        found = _WRITES[func] = (name.endswith("_") and not name.endswith("__")) or name in (
            "__setitem__",
            "__iadd__",
            "__isub__",
            "__imul__",
            "__itruediv__",
        )
    return found


#: Kinds of autograd node: a parameter's ``AccumulateGrad``, one that only moves its gradient
#: (:data:`MOVING_NODES`), one that computes.
LEAF, MOVING, COMPUTING = 0, 1, 2
#: Autograd node kind by node class, filled as they are met.
_KINDS: dict[type, int] = {}


def node_kind(node: Any) -> int:
    """:data:`LEAF`, :data:`MOVING` or :data:`COMPUTING` (cached by the node's class)."""
    kind = _KINDS.get(type(node))
    if kind is None:
        name = str(node.name())
        if name.endswith("AccumulateGrad"):
            kind = LEAF
        else:
            kind = MOVING if name.startswith(MOVING_NODES) else COMPUTING
        _KINDS[type(node)] = kind
    return kind


def moves(node: Any) -> bool:
    """Whether an autograd node only moves its gradient (a view's, a transpose's, a copy's)."""
    return bool(node.next_functions) and str(node.name()).startswith(MOVING_NODES)


def may_give_float16(edges: tuple[tuple[Any, int], ...]) -> bool:
    """Whether an autograd node whose ``next_functions`` are ``edges`` may produce a float16
    gradient: unless every edge leads to an input whose gradient torch casts to another dtype
    (the input's dtype; a leaf's ``grad_dtype``). An edge to no node (an input that needs no
    gradient, which a node may still give one) or of a dtype not known counts as float16."""
    for nxt, k in edges:
        if nxt is None:
            return True
        if node_kind(nxt) == LEAF:
            variable = getattr(nxt, "variable", None)
            dtype = None if variable is None else getattr(variable, "grad_dtype", variable.dtype)
        else:
            try:
                dtype = nxt._input_metadata[k].dtype
            except (AttributeError, IndexError):
                return True
        if dtype is None or dtype == FLOAT16:
            return True
    return False
