"""The float16 audit's instruments: every operator of a forward pass and every node of its
backward, each placed in the module that ran it (see :func:`lossscale.torch.audit`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["NodeRecord", "Overflow", "Watch", "float16_max", "moves", "upcast"]

FLOAT16 = torch.float16
#: The largest finite float16 (65504): attention masks fill with its negative.
FLOAT16_MAX = torch.finfo(torch.float16).max
#: Operators that move values without computing new ones: their results cannot overflow.
_MOVES = frozenset(
    [
        *("get", "getitem", "view", "view_as", "reshape", "reshape_as", "transpose", "permute"),
        *("t", "contiguous", "expand", "expand_as", "unsqueeze", "squeeze", "flatten"),
        *("unflatten", "chunk", "split", "split_with_sizes", "tensor_split", "narrow", "select"),
        *("detach", "clone", "movedim", "unbind", "cat", "stack", "repeat", "repeat_interleave"),
        *("gather", "index_select", "roll", "tril", "triu", "masked_fill", "flip", "as_strided"),
    ]
)
#: Casts: what float16 had to hold is the operand itself.
_CASTS = frozenset(("to", "half", "type", "_to_copy", "to_copy"))
#: Backward nodes of those operators: a gradient passes through them unchanged in value.
_MOVING_NODES = (
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


class Overflow(NamedTuple):
    """One place where the float16 run gave inf or NaN from finite operands.

    Attributes:
      module: the innermost module running when the operator ran (``""``: the root, or code
        outside every module, such as the loss function's).
      phase: ``"forward"`` or ``"backward"``.
      op: the operator (a torch function's name) or the autograd node (``MmBackward0``).
      amax: the forward: the largest magnitude the operator gives in float32 on the same
        operands (inf where no finite value exists); the backward: filled in by the caller.
      fix: the module whose running in float32 removes the overflow here (the forward: the
        module itself; the backward: the producer of the float16 tensor whose gradient
        overflowed, when the node casts a float32 gradient down to it).
      node: the backward node (None in the forward).
    """

    module: str
    phase: str
    op: str
    amax: float
    fix: str
    node: Any = None


def upcast(tree: Any) -> Any:
    """``tree`` with each float16 and bfloat16 tensor in it cast to float32."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
            return x.float()
        return x

    return tree_map(cast, tree)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _op_name(func: Any) -> str:
    name = str(getattr(func, "__name__", func))
    if name.startswith("__r") and name.endswith("__") and name not in ("__repr__",):
        name = "__" + name[3:]  # __rmul__ is mul
    return name.strip("_") or name


#: A backward node's record: ``(node, float16 slots, largest produced per slot, largest
#: received, whether it casts a gradient down to float16)``.
NodeRecord = tuple[Any, list[int], list[float], float, bool]
#: Operator name by torch function, filled as they are met.
_NAMES: dict[Any, str] = {}


def _finite(t: torch.Tensor) -> bool:
    """Whether every entry of ``t`` is finite (one reduction, one host read)."""
    if not t.numel():
        return True
    low, high = torch.aminmax(t.detach())  # NaN anywhere makes both NaN
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _magnitude(low: float, high: float) -> float:
    """The largest magnitude of a tensor whose entries lie in ``[low, high]``; NaN when either
    is NaN, inf when either is infinite."""
    if math.isnan(low) or math.isnan(high):
        return math.nan
    return max(-low, high)


def _mask_arithmetic(out: torch.Tensor, operands: list[torch.Tensor]) -> bool:
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


class _Mode(TorchFunctionMode):
    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        return self.watch.forward_op(func, args, kwargs, out)


class Watch:
    """Instruments one float16 run of ``model`` (a context manager).

    Forward: a :class:`TorchFunctionMode` sees every torch operator with its result; a float16
    result that holds inf or NaN while its floating operands are finite is an
    :class:`Overflow`, placed in the innermost running module (tracked by forward pre- and
    post-hooks on every module). With ``repair=True`` (autocast runs) the operator is run
    again in float32 on the same operands and that result is returned instead, so that the
    rest of the pass runs on finite values and later places are seen in the same pass.
    Backward: every autograd node the forward created is owned by the operator and module
    that created it; during :meth:`backward` a hook per node reads the largest float16
    gradient the node produces and the largest it receives.

    Host syncs: one per float16 operator result in the forward (its finiteness, read at
    once so that an overflow can be repaired); one per :meth:`backward`.
    """

    def __init__(self, model: torch.nn.Module, *, repair: bool) -> None:
        self.model = model
        self.repair = repair
        self.names = {id(m): name for name, m in model.named_modules()}
        self.param_module: dict[int, str] = {}
        for name, m in model.named_modules():
            for p in m.parameters(recurse=False):
                self.param_module.setdefault(id(p), name)
        self.stack: list[str] = [""]
        self.owner: dict[Any, tuple[str, str]] = {}
        self.forward: list[Overflow] = []
        self._handles: list[Any] = []
        self._mode = _Mode(self)
        self._probe: list[tuple[Any, list[int], bool, torch.Tensor]] | None = None

    # -- forward ---------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        for m in self.model.modules():
            name = self.names[id(m)]
            self._handles.append(m.register_forward_pre_hook(self._push(name), prepend=True))
            self._handles.append(m.register_forward_hook(self._pop, always_call=True))
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(name)

        return hook

    def _pop(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if len(self.stack) > 1:
            self.stack.pop()

    def forward_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """What the mode does with each operator's result (returns the result to hand on)."""
        name = _NAMES.get(func)
        if name is None:
            name = _NAMES[func] = _op_name(func)
        if isinstance(out, torch.Tensor):  # the common case, without a tree walk
            if name not in _MOVES and out.dtype == FLOAT16 and not _finite(out):
                out = self._overflowed(func, name, args, kwargs, out)
            node = out.grad_fn
            if node is not None and node not in self.owner:
                self._own([node], name)
            return out
        if name not in _MOVES:
            results = [t for t in _tensors(out) if t.dtype == FLOAT16]
            if not all(_finite(t) for t in results):
                out = self._overflowed(func, name, args, kwargs, out)
        self._own([t.grad_fn for t in _tensors(out) if t.grad_fn is not None], name)
        return out

    def _overflowed(self, func: Any, name: str, args: Any, kwargs: Any, out: Any) -> Any:
        operands = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        if not all(bool(torch.isfinite(t).all()) for t in operands):
            return out  # carried in from an earlier place
        results = [t for t in _tensors(out) if t.dtype == FLOAT16 and t.numel()]
        if all(_mask_arithmetic(t, operands) for t in results):
            return out
        module = self.stack[-1]
        in_place = name.endswith("_") or "out" in kwargs
        amax = math.inf
        if not in_place:
            if name in _CASTS:  # a cast's value is its operand's
                out32 = operands[0]
            else:
                with torch.autocast(results[0].device.type, enabled=False):
                    out32 = func(*upcast(args), **upcast(kwargs))
            floating = [t for t in _tensors(out32) if t.is_floating_point()]
            if floating and all(_finite(t) for t in floating):
                amax = max(float(t.detach().abs().max()) if t.numel() else 0.0 for t in floating)
                if self.repair:
                    out = out32
        self.forward.append(Overflow(module, "forward", name, amax, module))
        return out

    def _own(self, todo: list[Any], op: str) -> None:
        """Claim the autograd nodes ``todo`` and those they lead to that no earlier operator
        claimed for the running module and ``op``, each with a hook for :meth:`backward`."""
        module = self.stack[-1]
        while todo:
            node = todo.pop()
            if node in self.owner or node.name().endswith("AccumulateGrad"):
                continue
            self.owner[node] = (module, op)
            node.register_hook(self._node_hook(node))
            todo.extend(n for n, _ in node.next_functions if n is not None)

    # -- backward --------------------------------------------------------------------------
    def _node_hook(self, node: Any) -> Callable[..., None]:
        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
            if self._probe is None:
                return
            slots = [
                i
                for i, g in enumerate(grad_inputs)
                if isinstance(g, torch.Tensor) and g.dtype == FLOAT16 and g.numel()
            ]
            if not slots:
                return
            incoming = [
                g
                for g in grad_outputs
                if isinstance(g, torch.Tensor) and g.is_floating_point() and g.numel()
            ]
            down = any(g.dtype != FLOAT16 for g in incoming)
            bounds = [
                b.float()
                for g in (*(grad_inputs[i] for i in slots), *incoming)
                for b in torch.aminmax(g.detach())
            ]
            self._probe.append((node, slots, down, torch.stack(bounds)))

        return hook

    def backward(
        self, loss: torch.Tensor, params: list[torch.Tensor], scale: float
    ) -> tuple[list[torch.Tensor | None], list[NodeRecord]]:
        """``scale * loss`` backward through the retained graph: the parameters' gradients
        (``.grad`` untouched) and, per node that produced a float16 gradient, in the order
        they ran: ``(node, slots, largest produced per slot, largest received, casts down)``
        (NaN where non-finite). One host sync."""
        self._probe = []
        try:
            grads = torch.autograd.grad(
                loss.float() * scale, params, retain_graph=True, allow_unused=True
            )
        finally:
            probe, self._probe = self._probe, None
        if not probe:
            return list(grads), []
        device = probe[0][3].device
        flat = torch.cat([r.to(device) for *_, r in probe]).tolist()
        nodes, start = [], 0
        for node, slots, down, record in probe:
            values = flat[start : start + record.numel()]
            start += record.numel()
            sizes = [_magnitude(values[i], values[i + 1]) for i in range(0, len(values), 2)]
            produced, incoming = sizes[: len(slots)], sizes[len(slots) :]
            received = max(incoming, default=0.0) if all(map(math.isfinite, incoming)) else math.inf
            nodes.append((node, slots, produced, received, down))
        return list(grads), nodes

    def producer(self, node: Any, slot: int) -> str | None:
        """The module that made the tensor behind ``node``'s input ``slot``, looking through
        operators that only move values (views, transposes, copies)."""
        nxt = node.next_functions[slot][0]
        while nxt is not None:
            if nxt.name().endswith("AccumulateGrad"):
                return self.param_module.get(id(nxt.variable))
            if not moves(nxt):
                owner = self.owner.get(nxt)
                return None if owner is None else owner[0]
            nxt = nxt.next_functions[0][0]
        return None

    def backward_overflows(self, nodes: list[NodeRecord]) -> list[Overflow]:
        """The nodes that produced a non-finite float16 gradient from finite ones, each with
        the module to keep in float32 (``amax`` left inf, for the caller to measure)."""
        found = []
        for node, slots, produced, received, down in nodes:
            if not math.isfinite(received) or moves(node):
                continue
            bad = [s for s, a in zip(slots, produced, strict=True) if not math.isfinite(a)]
            if not bad:
                continue
            module, _ = self.owner.get(node, ("", ""))
            fix = module
            if down:
                fix = self.producer(node, bad[0]) or module
            found.append(Overflow(module, "backward", node.name(), math.inf, fix, node))
        return found


def moves(node: Any) -> bool:
    """Whether an autograd node only moves its gradient (a view's, a transpose's, a copy's)."""
    return bool(node.next_functions) and str(node.name()).startswith(_MOVING_NODES)
