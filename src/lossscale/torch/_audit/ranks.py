"""The float16 audit of a model trained on several ranks (``DistributedDataParallel``, FSDP2's
``fully_shard``): each rank audits its own batches on its whole replica, and the ranks agree
after every pass, so that every rank grows the same plan and ends with the same findings
(their union) and the same range (their intersection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lossscale.torch._audit.watch import Overflow

__all__ = ["across_ranks", "agreed", "rank_subject", "unsharded_replica"]

T = TypeVar("T")
#: A place: ``(module, phase, op)``.
Place = tuple[str, str, str]


def rank_subject(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """The module to audit and the process group its ranks agree over: a
    ``DistributedDataParallel``'s ``module`` (each rank holds the whole model) and its
    ``process_group``; for a model sharded by FSDP2's ``fully_shard``, an unsharded replica
    (:func:`unsharded_replica`, collectives over the parameters' mesh) and that mesh's group;
    any other module and None (audited alone).

    Raises:
      TypeError: ``model`` holds FSDP1 (``FullyShardedDataParallel``) modules, or FSDP2
        parameters on a mesh of more than one dimension.
    """
    if not torch.distributed.is_available():
        return model, None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, model.process_group
    fsdp1 = [n for n, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if fsdp1:
        raise TypeError(
            f"model holds FullyShardedDataParallel (FSDP1) modules ({fsdp1[0] or '(root)'}): "
            "audit the model before wrapping it, in DistributedDataParallel, under FSDP2's "
            "fully_shard, or alone on every rank"
        )
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return unsharded_replica(model)
    return model, None


#: The prefix of the module attributes where torch's composable APIs (FSDP2) keep their state.
_STATE_KEY = "__composable_api_state_key"
#: Where FSDP2 defines the hooks it puts on the modules it manages.
_FSDP_CODE = ("torch.distributed.fsdp", "torch.distributed._composable")


def _from_fsdp(hook: Any) -> bool:
    """Whether ``hook`` (a function, bound method, partial, or torch's ``_WrappedHook``) is
    FSDP's own."""
    f = getattr(hook, "hook", hook)
    f = getattr(f, "func", f)
    f = getattr(f, "__func__", f)
    return str(getattr(f, "__module__", "") or "").startswith(_FSDP_CODE)


def unsharded_replica(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """A plain copy of a model sharded by FSDP2's ``fully_shard``, whole on this rank, and the
    process group of its parameters' mesh (every rank of it must call this, in the same
    order: each sharded parameter is all-gathered).

    The copy has the original classes (``FSDPLinear`` -> ``Linear``), the full parameters
    (``DTensor.full_tensor()``) as plain ``Parameter``, the buffers, and the hooks that are
    not FSDP's (shared with the model, not copied). The model itself is unchanged.

    Raises:
      TypeError: the parameters lie on a mesh of more than one dimension (HSDP).
    """
    import copy
    from collections import OrderedDict

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    memo: dict[int, Any] = {}
    group = None
    for t in [*model.parameters(), *model.buffers()]:
        full = t
        if isinstance(t, DTensor):
            if t.device_mesh.ndim != 1:
                raise TypeError(
                    f"model is sharded on a {t.device_mesh.ndim}-dimensional mesh: the audit "
                    "takes FSDP2 on one dimension, DistributedDataParallel, or a model alone"
                )
            group = t.device_mesh.get_group()
            full = t.full_tensor()
        full = full.detach().clone()
        if isinstance(t, torch.nn.Parameter):
            full = torch.nn.Parameter(full, requires_grad=t.requires_grad)
        memo[id(t)] = full
    swapped: list[tuple[torch.nn.Module, type]] = []
    for m in model.modules():
        for name, value in vars(m).items():
            if name.startswith(_STATE_KEY):  # the composable API's registry: FSDP's state
                memo[id(value)] = OrderedDict()
            elif "hooks" in name and isinstance(value, dict):
                kept = [(k, v) for k, v in value.items() if not _from_fsdp(v)]
                memo[id(value)] = OrderedDict(kept)
        if isinstance(m, FSDPModule):
            cls = type(m)
            swapped.append((m, cls))
            m.__class__ = next(  # type: ignore[assignment]
                c
                for c in cls.__mro__
                if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule)
            )
    try:
        replica = copy.deepcopy(model, memo)
    finally:
        for m, cls in swapped:
            m.__class__ = cls
    for m in replica.modules():
        for key in [k for k in vars(m) if k.startswith(_STATE_KEY)]:
            del m.__dict__[key]
        for flag in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            m.__dict__.pop(flag, None)
    return replica, group


def agreed(group: Any, fn: Callable[[], T], payload: Callable[[T], Any]) -> tuple[T, list[Any]]:
    """``fn()`` on this rank and ``payload`` of its result from every rank (rank order), in
    one ``all_gather_object``. An exception on any rank is raised on every rank: this rank's
    own, or a RuntimeError naming the rank that failed (so that no rank waits for ever)."""
    import torch.distributed as dist

    result: T | None = None
    mine: Any = None
    error: Exception | None = None
    try:
        result = fn()
        mine = payload(result)
    except Exception as exc:  # raised again below, on every rank
        error = exc
    parts: list[Any] = [None] * dist.get_world_size(group)
    failed = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(parts, (failed, mine), group=group)
    if error is not None:
        raise error
    for rank, (failure, _) in enumerate(parts):
        if failure is not None:
            raise RuntimeError(f"audit: rank {rank} failed ({failure}); every rank stops")
    return result, [part for _, part in parts]  # type: ignore[return-value]


def across_ranks(auditor: Any, group: Any) -> None:
    """Make ``auditor``'s runs agree over ``group``: its float32 reference (an error on one
    rank stops all) and each float16 pass, whose result becomes the ranks' union: every
    intrinsic overflow (rank order, then each rank's order), the largest gradient of each
    place, and every batch's scales (None when any rank has none), and the places no module
    fixes. Every rank then takes the same steps of the plan's search."""
    run_reference: Callable[[], None] = auditor.run_reference
    run: Callable[..., Any] = auditor.run

    def reference() -> None:
        agreed(group, run_reference, lambda _: None)

    def combined(plan: tuple[str, ...], *, probe: bool, stop: bool = False) -> Any:
        def part(local: Any) -> Any:
            intrinsic = [(o.module, o.phase, o.op, o.amax, o.fix) for o in local.intrinsic]
            return intrinsic, local.places, local.scales, auditor.unfixable, auditor.notes

        local, parts = agreed(group, lambda: run(plan, probe=probe, stop=stop), part)
        places: dict[Place, float] = {}
        unfixable: set[Place] = set()
        notes: dict[Place, str] = {}
        for _, their_places, _, their_unfixable, their_notes in parts:
            for place, amax in their_places.items():
                places[place] = max(places.get(place, 0.0), amax)
            unfixable |= their_unfixable
            for place, note in their_notes.items():
                notes.setdefault(place, note)
        auditor.unfixable, auditor.notes = unfixable, notes
        intrinsic = [Overflow(*o) for their, *_ in parts for o in their]
        scales = None if any(p[2] is None for p in parts) else [s for p in parts for s in p[2]]
        return type(local)(intrinsic, places, scales)

    auditor.run_reference = reference
    auditor.run = combined
