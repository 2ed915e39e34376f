"""The float16 audit of a model trained on several ranks: each rank audits its own batches on
its replica, and the ranks agree after every pass, so that every rank grows the same plan and
ends with the same findings (their union) and the same range (their intersection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lossscale.torch._audit_watch import Overflow

__all__ = ["across_ranks", "agreed", "rank_subject", "unwrapped"]

T = TypeVar("T")
#: A place: ``(module, phase, op)``.
Place = tuple[str, str, str]


def rank_subject(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """The module to audit and the process group its ranks agree over: a
    ``DistributedDataParallel``'s ``module`` (each rank holds the whole model) and its
    ``process_group``; any other module and None (audited alone).

    Raises:
      TypeError: ``model`` is sharded by FSDP (FSDP2's ``fully_shard`` or FSDP1): no rank
        holds the whole model to run.
    """
    if not torch.distributed.is_available():
        return model, None
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, model.process_group
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    fsdp = (FSDPModule, FullyShardedDataParallel)
    sharded = [n for n, m in model.named_modules() if isinstance(m, fsdp)]
    if sharded:
        raise TypeError(
            f"model is sharded by FSDP ({type(model).__name__}; sharded modules: "
            f"{', '.join(n or '(root)' for n in sharded[:3])}): audit the model before "
            "fully_shard, or an unsharded copy of it on every rank, in DistributedDataParallel "
            "or alone"
        )
    return model, None


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """A ``DistributedDataParallel``'s ``module``, else ``model``."""
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            inner: torch.nn.Module = model.module
            return inner
    return model


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
