"""The float16 audit's backward instruments: a hook on the autograd nodes a :class:`Watch`
owns, their float16 gradients reduced on the device and read in one transfer, and the nodes
that overflow (see :func:`lossscale.torch.audit`)."""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import torch

from lossscale.torch._audit.ops import (
    COMPUTING,
    FLOAT16,
    FLOAT16_MAX,
    MOVING,
    magnitudes,
    moves,
    node_kind,
    read_all,
)

__all__ = [
    "PENDING_BYTES",
    "PENDING_TENSORS",
    "Backward",
    "BackwardWatch",
    "NodeRecord",
    "Overflow",
    "node_hook",
]

#: The float16 results (forward) and gradients (backward) reduced together (one launch per
#: dtype on a GPU): at most this many tensors, or this many bytes, held at once.
PENDING_TENSORS = 256
PENDING_BYTES = 1 << 28


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


#: A backward node's record: ``(node, float16 slots, largest produced per slot, whether every
#: gradient it received was finite, whether it casts a gradient down to float16)``; the fourth
#: is None where not needed: for a node that receives only float16 gradients and produced only
#: finite ones.
NodeRecord = tuple[Any, list[int], list[float], bool | None, bool]


class Backward(NamedTuple):
    """A backward started by :meth:`BackwardWatch.start_backward`, not read yet."""

    grads: list[torch.Tensor | None]  # the parameters' gradients
    probe: list[tuple[Any, list[int], bool, int]]  # per hooked node: (node, slots, down, count)
    sizes: list[torch.Tensor]  # 0-d, on the device: the magnitudes the nodes' counts split
    root: Any = None  # the backward's root node
    again: Any = None  # () -> the same backward, reading what every node received
    received: bool = False  # what every node received read, not only what was cast down


def node_hook(
    watch: weakref.ref[BackwardWatch], grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]
) -> None:
    """The hook on every node a watch owns (the node: the one the engine runs)."""
    self = watch()
    if self is not None and self._probe is not None:
        self._node_backward(torch._C._current_autograd_node(), grad_inputs, grad_outputs)


#: What :class:`_Inflow` gives for a node that gave or received no gradient.
_NOTHING = -1.0


class _Inflow:
    """What the nodes of one backward received, from what the hooked nodes feeding them
    produced (``records``): the gradients into a node's input are the sum, in its dtype, of
    those the nodes with an edge to it gave, through nodes that only move values (a view's,
    a slice's, a split's). A largest magnitude bounded from those, ``math.inf`` where one of
    them is not finite, None where it cannot tell (a node not hooked, one that may sum its
    gradient (``as_strided``'s), a sum of finite gradients that may overflow). A hook of the
    model's own that changes a gradient between two nodes is not seen."""

    def __init__(self, root: Any, records: list[NodeRecord], owner: dict[Any, Any]) -> None:
        self.produced = {r[0]: dict(zip(r[1], r[2], strict=True)) for r in records}
        self.owner = owner
        self.feeds: dict[Any, list[tuple[int, Any, int]]] = {}  # node -> (input, giver, slot)
        seen, todo = {root}, [root]
        while todo:
            node = todo.pop()
            for slot, (nxt, k) in enumerate(node.next_functions):
                if nxt is not None:
                    self.feeds.setdefault(nxt, []).append((k, node, slot))
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
        self.memo: dict[Any, float | None] = {}

    def received(self, node: Any) -> float | None:
        """The largest magnitude of the gradients ``node`` received, bounded (``_NOTHING``:
        none came)."""
        if node in self.memo:
            return self.memo[node]
        self.memo[node] = None  # a graph has no cycle: a guard only
        inputs: dict[int, list[float | None]] = {}
        for k, giver, slot in self.feeds.get(node, ()):
            size = self.given(giver, slot)
            if size != _NOTHING:
                inputs.setdefault(k, []).append(size)
        found: float | None = _NOTHING
        for sizes in inputs.values():
            if math.inf in sizes:
                found = math.inf
                break
            bounded = [x for x in sizes if x is not None]
            if found is None or len(bounded) < len(sizes):
                found = None
                continue
            total = sum(bounded)
            if len(sizes) > 1:  # float16 sums round each step: at most 2**-11 each
                total *= math.exp((len(sizes) - 1) * 2.0**-11)
                if total >= FLOAT16_MAX:
                    found = None
                    continue
            found = max(found, total)
        self.memo[node] = found
        return found

    def given(self, node: Any, slot: int) -> float | None:
        """The largest magnitude of the float16 gradient ``node`` gave at ``slot``, bounded."""
        produced = self.produced.get(node)
        if produced is not None:
            size = produced.get(slot)
            if size is None:
                return _NOTHING
            return size if math.isfinite(size) else math.inf
        kind = node_kind(node)
        if kind == COMPUTING and node in self.owner:
            return _NOTHING  # hooked and no record: it gave no float16 gradient
        if (
            kind == MOVING
            and len(node.next_functions) == 1
            and not str(node.name()).startswith("AsStrided")
        ):
            return self.received(node)  # every value it received, moved to its one input
        return None


class BackwardWatch:
    """The backward half of a :class:`~lossscale.torch._audit.watch.Watch`: during
    :meth:`backward` a hook per node that may produce a float16 gradient (none on a node that
    only moves its gradient: a view's, a transpose's) holds the float16 gradients it
    produces, and those it receives where one came in another dtype, reduced to their largest
    magnitudes on the device in groups (up to :data:`PENDING_TENSORS` tensors or
    :data:`PENDING_BYTES` bytes, one launch per dtype on a GPU), read in one transfer at the
    end. Whether the other nodes received finite gradients is known from what the nodes
    feeding them produced (see :class:`_Inflow`), looked at only for a node that produced a
    non-finite one; where that cannot tell, the backward runs again reading what every node
    received (one more host read, only then).

    Host reads: one per :meth:`backward` (:meth:`start_backward` none: its values can ride on
    the forward's read), one more where a backward runs again (above)."""

    model: torch.nn.Module
    owner: dict[Any, tuple[str, str]]
    _param_module: dict[int, str] | None
    _probe: list[tuple[Any, list[int], bool, int]] | None
    _received: bool  # every node's received gradients read, not only those cast down
    _pending: list[torch.Tensor]
    _pending_bytes: int
    _grad_sizes: list[torch.Tensor]

    def reduce_pending(self) -> None:
        raise NotImplementedError

    def _node_backward(
        self, node: Any, grad_inputs: tuple[Any, ...], outputs: tuple[Any, ...]
    ) -> None:
        """What the hook does at ``node`` in a backward started by :meth:`start_backward`."""
        slots = [
            i
            for i, g in enumerate(grad_inputs)
            if isinstance(g, torch.Tensor) and g.dtype == FLOAT16 and g.numel()
        ]
        if not slots:
            return
        incoming = [
            g
            for g in outputs
            if isinstance(g, torch.Tensor) and g.is_floating_point() and g.numel()
        ]
        down = any(g.dtype != FLOAT16 for g in incoming)
        grads = [grad_inputs[i] for i in slots]
        if down or self._received:
            grads += incoming
        self._probe.append((node, slots, down, len(grads)))  # type: ignore[union-attr]
        self._pending.extend(grads)
        self._pending_bytes += sum(g.numel() * g.element_size() for g in grads)
        if len(self._pending) >= PENDING_TENSORS or self._pending_bytes >= PENDING_BYTES:
            self._flush()

    def _flush(self) -> None:
        """The magnitudes of the gradients held since the last flush (one reduction launch
        per dtype on a GPU), kept on the device; the gradients let go."""
        self._grad_sizes.extend(magnitudes(self._pending))
        self._pending, self._pending_bytes = [], 0

    def start_backward(
        self, loss: torch.Tensor, params: list[torch.Tensor], scale: float, received: bool = False
    ) -> Backward:
        """``scale * loss`` backward through the retained graph, its magnitudes left on the
        device (no host read; :meth:`finish_backward` reads them). ``received``: what every
        node received read too, not only what came in another dtype than float16."""
        self.reduce_pending()  # the forward's, should it not have been read
        self._probe, self._grad_sizes, self._received = [], [], received
        try:
            root = loss.float() * scale
            grads = torch.autograd.grad(root, params, retain_graph=True, allow_unused=True)
            self._flush()
        finally:
            probe, self._probe = self._probe, None
            sizes, self._grad_sizes = self._grad_sizes, []
            self._pending, self._pending_bytes = [], 0

        def again() -> Backward:
            return self.start_backward(loss, params, scale, received=True)

        return Backward(list(grads), probe, sizes, root.grad_fn, again, received)

    def finish_backward(
        self, started: Backward, values: list[float]
    ) -> tuple[list[torch.Tensor | None], list[NodeRecord]]:
        """The gradients of ``started`` and its node records, from ``values`` (its ``sizes``
        read on the host). A node that produced a non-finite float16 gradient is told whether
        it received finite ones; where what fed it cannot tell, the backward runs again (one
        more host read)."""
        nodes: list[NodeRecord] = []
        start = 0
        for node, slots, down, count in started.probe:
            got = values[start : start + count]
            start += count
            produced, incoming = got[: len(slots)], got[len(slots) :]
            finite = all(map(math.isfinite, incoming)) if down or started.received else None
            nodes.append((node, slots, produced, finite, down))
        asked = [
            i
            for i, (_, _, produced, finite, _) in enumerate(nodes)
            if finite is None and not all(map(math.isfinite, produced))
        ]
        if not asked:
            return started.grads, nodes
        inflow = _Inflow(started.root, nodes, self.owner)
        exact: dict[Any, bool | None] | None = None
        for i in asked:
            node, slots, produced, _, down = nodes[i]
            bound = inflow.received(node)
            if bound is None:
                if exact is None:
                    again = started.again()
                    _, records = self.finish_backward(again, read_all(again.sizes))
                    exact = {r[0]: r[3] for r in records}
                finite = exact.get(node)
            else:
                finite = bound != math.inf
            nodes[i] = (node, slots, produced, finite, down)
        return started.grads, nodes

    def backward(
        self, loss: torch.Tensor, params: list[torch.Tensor], scale: float
    ) -> tuple[list[torch.Tensor | None], list[NodeRecord]]:
        """``scale * loss`` backward through the retained graph: the parameters' gradients
        (``.grad`` untouched) and, per node that produced a float16 gradient, in the order
        they ran, its :data:`NodeRecord` (NaN where non-finite). One host read (none when no
        node produced a float16 gradient; see the class for one more)."""
        started = self.start_backward(loss, params, scale)
        if not started.probe:
            return started.grads, []
        return self.finish_backward(started, read_all(started.sizes))

    def param_module(self) -> dict[int, str]:
        """The module that holds each parameter, by ``id`` (computed on first use)."""
        if self._param_module is None:
            self._param_module = {}
            for name, m in self.model.named_modules():
                for p in m.parameters(recurse=False):
                    self._param_module.setdefault(id(p), name)
        return self._param_module

    def producer(self, node: Any, slot: int) -> str | None:
        """The module that made the tensor behind ``node``'s input ``slot``, looking through
        operators that only move values (views, transposes, copies)."""
        nxt = node.next_functions[slot][0]
        while nxt is not None:
            if nxt.name().endswith("AccumulateGrad"):
                return self.param_module().get(id(nxt.variable))
            if not moves(nxt):
                owner = self.owner.get(nxt)
                return None if owner is None else owner[0]
            nxt = nxt.next_functions[0][0]
        return None

    def backward_overflows(self, nodes: list[NodeRecord]) -> list[Overflow]:
        """The nodes that produced a non-finite float16 gradient from finite ones, each with
        the module to keep in float32 (``amax`` left inf, for the caller to measure)."""
        found = []
        for node, slots, produced, finite, down in nodes:
            if moves(node):
                continue
            bad = [s for s, a in zip(slots, produced, strict=True) if not math.isfinite(a)]
            if not bad or not finite:
                continue
            module, _ = self.owner.get(node, ("", ""))
            fix = module
            if down:
                fix = self.producer(node, bad[0]) or module
            found.append(Overflow(module, "backward", node.name(), math.inf, fix, node))
        return found
