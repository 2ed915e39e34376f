"""The runs of one float16 audit: the float32 reference, the watched float16 passes, the
plan's search (see :func:`lossscale.torch.audit` for the algorithm)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lossscale.numerics import Report
from lossscale.numerics._report import Counted
from lossscale.torch._audit.finding import Finding
from lossscale.torch._audit.handle import keep_float32
from lossscale.torch._audit.ops import exact_ints, ints_of
from lossscale.torch._audit.scales import (
    BatchScales,
    Place,
    Reference,
    batch_scales,
    pow2,
    predicted_low,
    reference_of,
    underflow_counts,
    underflow_of,
    worst_underflow,
)
from lossscale.torch._audit.state import (
    full_float32,
)
from lossscale.torch._audit.watch import (
    Overflow,
    Watch,
    magnitudes,
    moves,
    read_all,
    watched_forward,
)

__all__ = ["SHRINK", "Auditor", "Pass", "enclosing_modules"]

#: The loss scales 2**-k of the backwards that measure gradients too large for float16 at 1.
SHRINK = (8, 16, 24)
_UNFIXABLE = (
    "no module-local fix: the value exceeds float16 where a module kept in float32 hands it "
    "back (a residual stream); audit with mode='autocast', which keeps it in float32"
)
#: The place of a parameter that float16 cannot hold (see :meth:`Auditor.check_parameters`).
PARAMETER = "parameter"
#: The root's place for a loss that is not finite while no float16 operator overflowed.
_LOSS: Place = ("", "forward", "loss")


class Pass(NamedTuple):
    """One run of every batch with a plan."""

    intrinsic: list[Overflow]  # forward overflows and backward ones at loss scale 1
    places: dict[Place, float]  # float16 gradient places: largest magnitude at loss scale 1
    scales: list[BatchScales] | None  # when probed and no fixable intrinsic overflow


def _keeper(into: dict[str, torch.Tensor], name: str) -> Callable[..., None]:
    """A forward hook that keeps the module's floating output in ``into[name]``."""

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            into[name] = out.detach()

    return hook


def enclosing_modules(model: torch.nn.Module) -> Callable[[str], str | None]:
    """The enclosing module to try in ``"half"`` mode when keeping a module in float32 does
    not fix an overflow (its float32 output, cast back to float16, still overflows):
    ``parent(name)`` is the smallest ancestor of module ``name`` (in ``named_modules()``)
    that runs a forward of its own (not a ``ModuleList`` or ``ModuleDict``), or None when
    there is none to try. The ancestors tried go up to one repeated block at most: an element
    of a block list (a ``ModuleList`` inside no other ``ModuleList``: the decoder or encoder
    layers, not a layer's experts) is the last; the root and a module that holds a block
    list (the backbone, an encoder) are never tried (keeping the container of the residual
    stream is not a float16 plan)."""
    named = dict(model.named_modules())
    lists = [n for n, m in named.items() if isinstance(m, torch.nn.ModuleList)]
    outermost = [n for n in lists if not any(n.startswith(f"{o}.") for o in lists if o)]
    blocks = {
        f"{n}.{child}" if n else child for n in outermost for child, _ in named[n].named_children()
    }
    containers = {""}
    for n in outermost:
        parts = n.split(".")
        containers.update(".".join(parts[:i]) for i in range(len(parts) + 1))

    def parent(name: str) -> str | None:
        while name not in blocks and "." in name:
            name = name.rsplit(".", 1)[0]
            if name in containers:
                return None
            if not isinstance(named.get(name), torch.nn.ModuleList | torch.nn.ModuleDict):
                return name
        return None

    return parent


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a torch.Tensor, got {type(loss).__name__}")
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn must return a floating loss, got dtype {loss.dtype}")
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
    return loss


class Auditor:
    """The runs of one audit (see :func:`audit` for what it finds and how)."""

    def __init__(
        self,
        f16: torch.nn.Module,
        f32: torch.nn.Module,
        loss_fn: Callable[[torch.nn.Module, Any], Any],
        batches: list[Any],
        mode: str,
        device: torch.device,
        underflow: float,
        rng: Callable[[], Any],
    ) -> None:
        self.f16, self.f32 = f16, f32
        self.loss_fn, self.batches = loss_fn, batches
        self.mode, self.device, self.threshold = mode, device, underflow
        self.rng = rng
        self.report: Report | None = None
        self.reference: list[Reference] = []
        # the float32 losses and report rows not read yet: read with the first float16
        # forward's values (see unread and take_reference)
        self.unread_losses: list[torch.Tensor] = []
        self.unread_rows: list[tuple[int, Counted]] = []
        # per batch, from its float16 forwards so far: the places of the fixable overflows of
        # one, and whether the last one's loss was finite (whether to queue the backward
        # before the next forward's read: when the plan holds the fix of each place)
        self.forwards_seen: dict[int, tuple[frozenset[Place], bool]] = {}
        self.unfixable: set[Place] = set()
        self.notes: dict[Place, str] = {}
        # the module whose float32 run fixes each place met (the search's; the place's own
        # module until an enclosing one is tried, see enclosing_modules)
        self.fix_of: dict[Place, str] = {}
        # "half" mode: the parameters' largest magnitudes, 0 where float16 holds them (read
        # with the float32 losses), and the findings of those it cannot hold
        self.unread_params: tuple[list[tuple[str, str]], torch.Tensor] | None = None
        self.parameters: list[Finding] = []

    def loss(self, model: torch.nn.Module, batch: Any, *, autocast: bool) -> torch.Tensor:
        with self.rng(), torch.autocast(self.device.type, torch.float16, enabled=autocast):
            return _check_loss(self.loss_fn(model, batch))

    def params(self, model: torch.nn.Module) -> tuple[list[str], list[torch.Tensor]]:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return [n for n, _ in named], [p for _, p in named]

    # -- the float32 reference --------------------------------------------------------------
    def run_reference(self) -> None:
        """Each batch in float32 (TF32 off on CUDA): its gradients prepared for the underflow
        count (:func:`reference_of`) and its report rows counted. No host read: the losses and
        the rows are read with the first float16 forward (:meth:`take_reference`), so that the
        device runs this pass while the host watches that one."""
        leaves = []
        if self.report is not None:
            leaves = [(n, m) for n, m in self.f32.named_modules() if not any(m.children())]
        names, params = self.params(self.f32)
        losses = []
        rows: list[tuple[int, Counted]] = []
        with full_float32(self.device):
            for step, batch in enumerate(self.batches):
                seen: dict[str, torch.Tensor] = {}
                hooks = [m.register_forward_hook(_keeper(seen, f"forward:{n}")) for n, m in leaves]
                try:
                    loss = self.loss(self.f32, batch, autocast=False)
                finally:
                    for h in hooks:
                        h.remove()
                losses.append(loss.detach().float().reshape(()))
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                ref = {n: g.detach() for n, g in zip(names, grads, strict=True) if g is not None}
                self.reference.append(reference_of(ref))
                if self.report is not None:
                    counted = self.report.count({**seen, **ref}, loss_scale=1.0)
                    if counted.entries:
                        rows.append((step, counted))
        self.unread_losses, self.unread_rows = losses, rows

    def check_parameters(self) -> None:
        """``"half"`` mode: which parameters float16 cannot hold (finite in float32, not in
        the float16 copy: a value above 65504 becomes inf under ``model.half()``), queued on
        the device (no host read: read with the float32 losses, see :meth:`take_reference`,
        each a finding in :attr:`parameters`). A reduction per parameter (:func:`magnitudes`: on a
        GPU one launch per dtype)."""
        named32 = dict(self.f32.named_parameters())
        pairs = [
            (n, p, named32[n])
            for n, p in self.f16.named_parameters()
            if n in named32 and p.is_floating_point() and p.numel()
        ]
        if not pairs:
            return
        with torch.no_grad():
            amax16 = torch.stack(magnitudes([p.detach() for _, p, _ in pairs])).float()
            amax32 = torch.stack(magnitudes([q.detach().float() for _, _, q in pairs]))
            lost = torch.isfinite(amax32) & ~torch.isfinite(amax16)
            sizes = torch.where(lost, amax32, torch.zeros_like(amax32))
        names = []
        for n, _, _ in pairs:
            module, _, param = n.rpartition(".")
            names.append((module, param))
        self.unread_params = (names, sizes)

    def unread(self) -> list[torch.Tensor]:
        """The float32 pass's values not read yet, for :func:`read_all`: the losses, each
        report row's integers as :func:`exact_ints`, then the parameters' sizes of
        :meth:`check_parameters` (no host read)."""
        params = [] if self.unread_params is None else [self.unread_params[1]]
        return [*self.unread_losses, *(exact_ints(c.ints) for _, c in self.unread_rows), *params]

    def take_reference(self, values: list[float] | None = None) -> None:
        """The float32 pass's values not read yet (``values``: read with other values by
        :func:`read_all`; None: read them now, one host read, none when all were read): its
        losses checked, its report rows added.

        Raises:
          ValueError: a loss is not finite (the audit needs batches float32 computes).
        """
        n_losses, rows, params = len(self.unread_losses), self.unread_rows, self.unread_params
        if values is None:
            values = read_all(self.unread())
        self.unread_losses, self.unread_rows, self.unread_params = [], [], None
        losses = values[:n_losses]
        for step, value in enumerate(losses):
            if not math.isfinite(value):
                raise ValueError(
                    f"loss_fn gives a non-finite loss in float32 on batch {step} "
                    f"({value}): the audit needs a batch that float32 computes"
                )
        start = len(losses)
        for step, counted in rows:
            n = 2 * counted.ints.numel()
            assert self.report is not None
            self.report.add_counted(step, counted, ints_of(values[start : start + n]))
            start += n
        if params is not None:
            for (module, param), amax in zip(params[0], values[start:], strict=True):
                if amax > 0:
                    self.parameters.append(_parameter_finding(module, param, amax))

    # -- float16 passes ----------------------------------------------------------------------
    def run(self, plan: tuple[str, ...], *, probe: bool, stop: bool = False) -> Pass:
        """Every batch in float16 with ``plan`` kept in float32: the intrinsic overflows, the
        largest float16 gradient of each place at loss scale 1, and (``probe``) the scales
        each batch allows. ``stop``: end at the first batch with a fixable intrinsic one."""
        intrinsic: list[Overflow] = []
        places: dict[Place, float] = {}
        scales: list[BatchScales] | None = [] if probe else None
        names, params = self.params(self.f16)
        with keep_float32(self.f16, plan, self.mode):
            for step, batch in enumerate(self.batches):
                probing = scales is not None
                found, batch_scales = self._batch(
                    step, batch, names, params, places, probing, frozenset(plan)
                )
                intrinsic.extend(found)
                fixable = [o for o in found if self.place(o) not in self.unfixable]
                if scales is not None:
                    if fixable or batch_scales is None:
                        scales = None
                    else:
                        scales.append(batch_scales)
                if stop and fixable:
                    break
        return Pass(intrinsic, places, scales)

    @staticmethod
    def place(o: Overflow | Finding) -> Place:
        return (o.module, o.phase, o.op)

    def _batch(
        self,
        step: int,
        batch: Any,
        names: list[str],
        params: list[torch.Tensor],
        places: dict[Place, float],
        probe: bool,
        plan: frozenset[str],
    ) -> tuple[list[Overflow], BatchScales | None]:
        autocast = self.mode == "autocast"
        # the backward is queued before the forward's read when the forward should be clean:
        # every module that fixed an overflow of this batch's forward is in the plan, and the
        # last one's loss was finite
        fixed, was_finite = self.forwards_seen.get(step, (frozenset(), True))
        queue_backward = was_finite and all(self.fix_of.get(p, p[0]) in plan for p in fixed)
        reference = self.reference[step]
        unread = self.unread()
        n_unread = sum(t.numel() for t in unread)
        ahead: dict[str, Any] = {}

        def backward_ahead(watch: Watch, loss: torch.Tensor) -> list[torch.Tensor]:
            # queued before the forward's read, read with it: when the forward is clean (the
            # common case) its one read serves the float32 losses, the backward at scale 1 and
            # the underflow there; otherwise the work is dropped and done again below
            if not queue_backward:
                return list(unread)
            ahead["backward"] = started = watch.start_backward(loss, params, 1.0)
            ahead["counted"], counts = (
                underflow_counts(reference, names, started.grads) if probe else ([], [])
            )
            return [*unread, *started.sizes, *counts]

        watch, loss, loss_finite, values, reran = watched_forward(
            self.f16,
            autocast,
            lambda: self.loss(self.f16, batch, autocast=autocast),
            backward_ahead,
        )
        if unread:
            self.take_reference(values[:n_unread])
        values = values[n_unread:]
        found = list(watch.forward)
        fixable = frozenset(self.place(o) for o in found if self.place(o) not in self.unfixable)
        self.forwards_seen[step] = (fixed | fixable, loss_finite)
        if any(self.place(o) not in self.unfixable for o in found):
            # the plan changes here: the backward of the next pass is the one that counts
            return found, None
        if not loss_finite:
            if not found:
                note = "the loss is not finite, yet no float16 operator overflowed"
                found.append(Overflow(*_LOSS, math.inf, ""))
                self.unfixable.add(_LOSS)
                self.notes[_LOSS] = note
            return found, None
        at_scale_1 = None
        if reran or "backward" not in ahead:  # none queued, or on a graph that is gone
            grads, nodes = watch.backward(loss, params, 1.0)
        else:
            started = ahead["backward"]
            n = len(started.sizes)
            grads, nodes = watch.finish_backward(started, values[:n])
            if probe:
                at_scale_1 = worst_underflow(ahead["counted"], values[n:])
        back = watch.backward_overflows(nodes)
        if back:
            back = self._sizes(watch, loss, params, back)
        found.extend(back)
        for node, _, produced, _, _ in nodes:
            if moves(node):
                continue
            module, _ = watch.owner.get(node, ("", ""))
            place = (module, "backward", node.name())
            finite = [a for a in produced if math.isfinite(a)]
            if finite:
                places[place] = max(places.get(place, 0.0), *finite)
        if not probe or found:  # an overflow at loss scale 1 leaves no range to probe
            return found, None

        def underflow_at(k: int) -> tuple[float, str]:
            if k == 0 and at_scale_1 is not None:
                return at_scale_1
            at_k = grads if k == 0 else watch.backward(loss, params, pow2(k))[0]
            return underflow_of(reference, names, at_k)

        def predicted() -> int:
            return predicted_low(reference, self.threshold)

        return found, batch_scales(nodes, underflow_at, predicted, self.threshold)

    @staticmethod
    def _sizes(
        watch: Watch, loss: torch.Tensor, params: list[torch.Tensor], back: list[Overflow]
    ) -> list[Overflow]:
        """The backward overflows with their magnitude at loss scale 1, measured by a
        backward at 2**-8, 2**-16, 2**-24 (the first at which each is finite and nonzero: the
        gradients scale exactly with a power of two until they underflow)."""
        sized: dict[Any, float] = {}
        for k in SHRINK:
            _, nodes = watch.backward(loss, params, pow2(-k))
            for node, _, produced, _, _ in nodes:
                if node not in sized and all(map(math.isfinite, produced)) and max(produced) > 0:
                    sized[node] = max(produced) * pow2(k)
            if all(o.node in sized for o in back):
                break
        return [o._replace(amax=sized.get(o.node, math.inf)) for o in back]

    # -- the plan ----------------------------------------------------------------------------
    def search(self) -> tuple[tuple[str, ...], list[Finding], Pass]:
        """The plan: grown from the intrinsic overflows' fixes until a pass has none left,
        then pruned to 1-minimal. A place still met with its fix kept is unfixable, except in
        ``"half"`` mode while an enclosing module is left to try (:func:`enclosing_modules`,
        smallest first): the fix moves there, in place of the module that did not help.
        Returns the plan, the intrinsic findings met on the way (those of
        :meth:`check_parameters` first, in place of the root's non-finite loss), and the
        pass that probed the scales with the final plan."""
        plan: list[str] = []
        seen: dict[Place, float] = {}
        fix_of = self.fix_of
        parent = enclosing_modules(self.f16) if self.mode == "half" else lambda name: None
        result = self.run((), probe=True)
        probed: dict[tuple[str, ...], Pass] = {(): result}
        for _ in range(2 * len(list(self.f16.modules())) + 1):
            failed: set[str] = set()  # kept in float32, and the place is still here
            for o in result.intrinsic:
                place = self.place(o)
                seen[place] = max(seen.get(place, 0.0), o.amax)
                fix = fix_of.setdefault(place, o.fix)
                if fix in plan and place not in self.unfixable:
                    failed.add(fix)
            for fix in failed:
                moved = [p for p, f in fix_of.items() if f == fix and p not in self.unfixable]
                up = parent(fix)
                if up is None:
                    self.unfixable.update(moved)
                    continue
                plan.remove(fix)
                fix_of.update(dict.fromkeys(moved, up))
            new = [fix_of[self.place(o)] for o in self._fixable(result)]
            new = list(dict.fromkeys(f for f in new if f not in plan))
            if not new and not failed:
                break
            plan.extend(new)
            if tuple(plan) not in probed:
                probed[tuple(plan)] = self.run(tuple(plan), probe=True)
            result = probed[tuple(plan)]
        known = dict(probed)
        for name in reversed(list(plan)):
            trial = tuple(m for m in plan if m != name)
            if trial not in known:
                known[trial] = self.run(trial, probe=False, stop=True)
            if not self._fixable(known[trial]):
                plan = list(trial)
        final = tuple(plan)
        if final not in probed:
            probed[final] = self.run(final, probe=True)
        findings = [
            Finding(
                *place,
                amax,
                True,
                None if place[1] == "forward" else 1.0,
                place not in self.unfixable,
                self.notes.get(place, _UNFIXABLE) if place in self.unfixable else "",
            )
            for place, amax in seen.items()
            if not (place == _LOSS and self.parameters)
        ]
        return final, [*self.parameters, *findings], probed[final]

    def _fixable(self, result: Pass) -> list[Overflow]:
        return [o for o in result.intrinsic if self.place(o) not in self.unfixable]


def _parameter_finding(module: str, param: str, amax: float) -> Finding:
    """The finding of parameter ``param`` of ``module``, ``amax`` in float32, that float16
    cannot hold."""
    where = f"{module}.{param}" if module else param
    note = (
        f"parameter {where!r} holds {amax:.3g}, past float16's 65504: model.half() makes it "
        "inf, and no module kept in float32 brings it back; bring it within float16's range "
        "(or audit with mode='autocast', which keeps the parameters in float32)"
    )
    return Finding(module, "forward", PARAMETER, amax, True, None, False, note)
