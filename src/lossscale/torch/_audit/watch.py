"""The float16 audit's instruments: every operator of a forward pass and every node of its
backward, each placed in the module that ran it (see :func:`lossscale.torch.audit`)."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lossscale.torch._audit.backward import (
    PENDING_BYTES,
    PENDING_TENSORS,
    Backward,
    BackwardWatch,
    NodeRecord,
    Overflow,
    node_hook,
)
from lossscale.torch._audit.ops import (
    CASTS,
    COMPUTING,
    FLOAT16,
    LEAF,
    MOVES,
    all_finite,
    float16_max,
    grouped_norms,
    magnitudes,
    mask_arithmetic,
    may_give_float16,
    moves,
    node_kind,
    op_name,
    operands,
    read_all,
    results,
    tensors_in,
    upcast,
    writes,
)

__all__ = [
    "PENDING_BYTES",
    "PENDING_TENSORS",
    "Backward",
    "NodeRecord",
    "OpKey",
    "Overflow",
    "Watch",
    "float16_max",
    "grouped_norms",
    "magnitudes",
    "moves",
    "read_all",
    "upcast",
    "watched_forward",
]


#: An operator's place across reruns of the same forward: ``(module, op, occurrence)``, the
#: occurrence counted per module and op, so that a repair (which changes dtypes, and with them
#: the code some models run) does not shift the places of other modules.
OpKey = tuple[str, str, int]
#: Operator name by torch function, filled as they are met.
_NAMES: dict[Any, str] = {}
#: Reruns of one forward at most, each locating the overflows the last one's read showed.
MAX_RERUNS = 16


class _Mode(TorchFunctionMode):
    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if writes(func) or "out" in kwargs:
            self.watch.reduce_pending()  # the results held so far, before this op changes one
        out = func(*args, **kwargs)
        return self.watch.forward_op(func, args, kwargs, out)


class Watch(BackwardWatch):
    """Instruments one float16 run of ``model`` (a context manager).

    Forward: a :class:`TorchFunctionMode` sees every torch operator with its result, placed in
    the innermost running module (tracked by forward pre- and post-hooks on every module).
    The largest magnitude of each float16 result is kept on the device (no host read; the
    results reduced in groups, one launch per dtype on a GPU, and always before an operator
    that writes into a tensor) and :meth:`read` reads them all in one transfer after the
    forward, with the loss. An operator
    whose float16 result is not finite while every watched result it reads is finite is a
    *candidate*; a rerun with its :data:`OpKey` in ``check`` looks at it on the host: a
    result with inf or NaN from finite operands (not the arithmetic of an attention mask) is
    an :class:`Overflow`, and with ``repair=True`` (autocast runs) the operator is run again
    in float32 on the same operands and that result handed on, so that the rest of the pass
    runs on finite values (see :func:`watched_forward`).
    Backward: every autograd node the forward created is owned by the operator and module
    that created it, and hooked where it may produce a float16 gradient (see
    :class:`~lossscale.torch._audit.backward.BackwardWatch`).

    Host reads: one per :meth:`read` and per :meth:`backward` (:meth:`start_backward` none: its
    values can ride on the forward's read); a few at each checked operator.
    """

    def __init__(
        self, model: torch.nn.Module, *, repair: bool, check: frozenset[OpKey] = frozenset()
    ) -> None:
        self.model = model
        self.repair = repair
        self.check = check
        self.names = {id(m): name for name, m in model.named_modules()}
        self._param_module: dict[int, str] | None = None
        self.stack: list[str] = [""]
        self.owner: dict[Any, tuple[str, str]] = {}
        # one hook for every node, holding the watch weakly: the graph holds the hook and the
        # watch the graph's nodes, and a strong reference would be a cycle through C++ that
        # keeps every graph (and its saved activations) alive after the audit
        self._hook = functools.partial(node_hook, weakref.ref(self))
        self.forward: list[Overflow] = []
        self._handles: list[Any] = []
        self._mode = _Mode(self)
        self._probe: list[tuple[Any, list[int], bool, int]] | None = None
        self._received = False
        # the results or gradients not yet reduced (see _flush), and their bytes
        self._pending: list[torch.Tensor] = []
        self._pending_bytes = 0
        self._grad_sizes: list[torch.Tensor] = []
        self._seen: dict[tuple[str, str], int] = {}
        self._claims: dict[tuple[str, str], tuple[str, str]] = {}
        # per watched float16 result: its operator's key and the watched results it read
        self._ops: list[tuple[OpKey, tuple[int, ...]]] = []
        self._sizes: list[torch.Tensor] = []
        self._size_op: list[int] = []
        # id(tensor) -> (the tensor, the watched results it was computed from by unwatched ops)
        self._from: dict[int, tuple[Any, tuple[int, ...]]] = {}

    # -- forward ---------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._push, prepend=True))
            self._handles.append(m.register_forward_hook(self._pop, always_call=True))
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._from.clear()

    def _push(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append(self.names[id(module)])

    def _pop(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if len(self.stack) > 1:
            self.stack.pop()

    def _sources(self, args: Any, kwargs: Any) -> tuple[int, ...]:
        """The watched results the operands were computed from (through unwatched ops)."""
        found: list[int] = []
        known = self._from
        for t in operands(args, kwargs):
            entry = known.get(id(t))
            if entry is not None and entry[0]() is t:
                found.extend(entry[1])
        if len(found) < 2:
            return tuple(found)
        return tuple(dict.fromkeys(found))

    def _mark(self, out: Any, sources: tuple[int, ...]) -> None:
        if not sources:
            return
        if isinstance(out, torch.Tensor):
            self._from[id(out)] = (weakref.ref(out), sources)
            return
        for t in results(out):
            self._from[id(t)] = (weakref.ref(t), sources)

    def forward_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
        """What the mode does with each operator's result (returns the result to hand on)."""
        name = _NAMES.get(func)
        if name is None:
            name = _NAMES[func] = op_name(func)
        single = isinstance(out, torch.Tensor)
        if not single and (not isinstance(out, list | tuple) or not results(out)):
            return out  # a size, a dtype, a number: nothing to watch
        if name in MOVES:
            self._mark(out, self._sources(args, kwargs))
        else:
            module = self.stack[-1]
            place = (module, name)
            n = self._seen.get(place, 0)
            self._seen[place] = n + 1
            key = (module, name, n)
            if self.check and key in self.check:
                out = self._checked(func, name, module, args, kwargs, out)
                single = isinstance(out, torch.Tensor)
            found = [out] if single else results(out)
            found = [t for t in found if t.dtype == FLOAT16 and t.numel()]
            sources = self._sources(args, kwargs)
            if found:
                i = len(self._ops)
                self._ops.append((key, sources))
                self._size_op.extend([i] * len(found))
                self._pending.extend(found)
                self._pending_bytes += sum(t.numel() * t.element_size() for t in found)
                if len(self._pending) >= PENDING_TENSORS or self._pending_bytes >= PENDING_BYTES:
                    self.reduce_pending()
                self._mark(out, (i,))
            else:
                self._mark(out, sources)
        if single:  # the common case, without a tree walk
            node = out.grad_fn
            if node is not None and node not in self.owner:
                self._own([node], name)
            return out
        self._own([t.grad_fn for t in results(out) if t.grad_fn is not None], name)
        return out

    def reduce_pending(self) -> None:
        """The forward's float16 results held since the last call reduced to their largest
        magnitudes (kept on the device; one launch per dtype on a GPU) and let go. Called
        every :data:`PENDING_TENSORS` results or :data:`PENDING_BYTES`, before an operator
        that writes into a tensor, and by :meth:`read`."""
        if self._pending:
            self._sizes.extend(magnitudes(self._pending))
            self._pending, self._pending_bytes = [], 0

    def read(
        self,
        loss: torch.Tensor,
        more: list[torch.Tensor] = (),  # type: ignore[assignment]
    ) -> tuple[bool, set[OpKey], list[float]]:
        """After the forward: whether ``loss`` is finite, the candidates (see the class) not
        checked yet, and the values of ``more`` (0-d tensors read in the same transfer). One
        host read."""
        self.reduce_pending()
        n = len(self._sizes)
        values = read_all([*self._sizes, loss.detach().float().reshape(()), *(more or [])])
        sizes, loss_value, extra = values[:n], values[n], values[n + 1 :]
        finite = [True] * len(self._ops)
        for i, v in zip(self._size_op, sizes, strict=True):
            if not math.isfinite(v):
                finite[i] = False
        candidates = {
            key
            for (key, sources), ok in zip(self._ops, finite, strict=True)
            if not ok and key not in self.check and all(finite[j] for j in sources)
        }
        return math.isfinite(loss_value), candidates, extra

    def _checked(self, func: Any, name: str, module: str, args: Any, kwargs: Any, out: Any) -> Any:
        """A candidate, looked at on the host: an overflow is recorded (and repaired)."""
        results = [t for t in tensors_in(out) if t.dtype == FLOAT16 and t.numel()]
        if all(all_finite(t) for t in results):
            return out
        operands = [t for t in tensors_in((args, kwargs)) if t.is_floating_point()]
        if not all(all_finite(t) for t in operands):
            return out  # carried in from an earlier place
        if all(mask_arithmetic(t, operands) for t in results):
            return out
        in_place = writes(func) or "out" in kwargs
        amax = math.inf
        if not in_place:
            if name in CASTS:  # a cast's value is its operand's
                out32 = operands[0]
            else:
                with torch.autocast(results[0].device.type, enabled=False):
                    out32 = func(*upcast(args), **upcast(kwargs))
            floating = [t for t in tensors_in(out32) if t.is_floating_point()]
            if floating and all(all_finite(t) for t in floating):
                amax = max(float(t.detach().abs().max()) if t.numel() else 0.0 for t in floating)
                if self.repair:
                    out = out32
        self.forward.append(Overflow(module, "forward", name, amax, module))
        return out

    def _own(self, todo: list[Any], op: str) -> None:
        """Claim the autograd nodes ``todo`` and those they lead to that no earlier operator
        claimed for the running module and ``op``, with a hook for :meth:`backward` on each
        that computes (not a view's: its gradient is its consumer's) and may produce a float16
        gradient (:func:`may_give_float16`)."""
        owner, module, hook = self.owner, self.stack[-1], self._hook
        claim = self._claims.setdefault((module, op), (module, op))  # one tuple per place
        while todo:
            node = todo.pop()
            if node in owner:
                continue
            kind = node_kind(node)
            if kind == LEAF:
                continue
            owner[node] = claim
            edges = node.next_functions
            if kind == COMPUTING and may_give_float16(edges):
                node.register_hook(hook)
            for nxt, _ in edges:
                if nxt is not None and nxt not in owner:
                    todo.append(nxt)


def watched_forward(
    model: torch.nn.Module,
    repair: bool,
    run: Callable[[], torch.Tensor],
    ahead: Callable[[Watch, torch.Tensor], list[torch.Tensor]] | None = None,
) -> tuple[Watch, torch.Tensor, bool, list[float], bool]:
    """``run()`` (a forward giving the loss) under a :class:`Watch`, again while the last
    run's :meth:`Watch.read` shows candidates not looked at yet, each rerun looking at them on
    the host (with ``repair``, an overflow repaired shows the places after it in the next
    run's read). ``ahead(watch, loss)``: work queued after the first run, before its read
    (the backward, which the device runs while the host waits for nothing), returning 0-d
    device values read with it. Returns the last run's watch, its loss, whether that loss is
    finite, the values of ``ahead`` (empty without it) and whether the forward ran again (the
    work of ``ahead`` then belongs to a run that is gone). A clean forward: one run, one host
    read."""
    check: set[OpKey] = set()
    first: list[float] = []
    for attempt in range(MAX_RERUNS):
        with Watch(model, repair=repair, check=frozenset(check)) as watch:
            loss = run()
        more = ahead(watch, loss) if ahead is not None and attempt == 0 else []
        finite, candidates, values = watch.read(loss, more)
        if attempt == 0:
            first = values
        if not candidates:
            break
        check |= candidates
    return watch, loss, finite, first, attempt > 0
