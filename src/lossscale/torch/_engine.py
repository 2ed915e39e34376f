"""The engine under lossscale.torch's front ends (``LossScaleOptimizer`` and ``GradScaler``).

Each idea is here once:

* :class:`GradGroups` and :func:`check_and_unscale`: gradients grouped by (device, dtype), one
  fused unscale + non-finite check per group (``torch._amp_foreach_non_finite_check_and_unscale_``),
  sparse and DTensor (FSDP2) gradients, bfloat16 on CUDA;
* :func:`agree`: the ``MAX`` all-reduce of the non-finite flag across ranks;
* :class:`ScaleState`: the loss scale on the parameters' device (a fixed value, or the core rule's
  :class:`lossscale.core.DynamicState` advanced by :func:`lossscale.core.dynamic_update`), the
  step records (``last_step_applied``, ``skipped_steps``) and the stall alarm's count.

The front ends own only their protocol: TensorFlow's ``step()`` / ``get_scaled_loss`` for the
optimizer, ``scale / unscale_ / step / update`` for the scaler.

The non-finite flag of a check is ``found_inf``: a 0-d float32 tensor, exactly 1.0 when a
gradient was not finite and 0.0 otherwise (fused optimizers skip only on 1.0 and subtract it
from their ``step`` counts); the rule takes its complement, ``is_finite = found_inf == 0``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch

from lossscale.core._backends import torch_namespace
from lossscale.core._checkpoint import read_dynamic_state, read_fixed_state, scale_state_dict
from lossscale.core._rule import DynamicRule, DynamicState, dynamic_state, dynamic_update
from lossscale.core._settings import ScaleSettings
from lossscale.core._stall import StallAlarm, report_stall, stall_update

TORCH = torch_namespace()
HALF = (torch.float16, torch.bfloat16)


def is_dtensor(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (FSDP2, tensor parallel); looked up only if torch imported
    ``torch.distributed.tensor`` already (a DTensor cannot exist otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def local(g: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage, so in-place ops write through), else ``g``."""
    return cast(torch.Tensor, cast(Any, g)._local_tensor) if is_dtensor(g) else g


class GradGroups:
    """Parameters grouped by (device, dtype), cached until the param groups change.

    Per step only ``[p.grad for p in params]`` runs per group: no per-parameter dict work.
    DTensor parameters (FSDP2) form groups of their own, whose gradients are checked through
    their local shards: each rank checks what it holds, and the flag is all-reduced.
    """

    def __init__(self) -> None:
        self.key: tuple[tuple[int, int], ...] | None = None
        self.groups: list[list[torch.nn.Parameter]] = []
        self.sparse: list[bool] = []  # a group seen with sparse grads takes the per-grad path
        self.upcast: list[bool] = []  # a group whose dtype the fused kernel lacks on its device
        self.dtensor: list[bool] = []
        self.complex: list[bool] = []  # checked and unscaled through view_as_real
        self.invalid: list[bool] = []  # a non-float dtype: a gradient there is a TypeError

    def refresh(self, param_groups: Sequence[dict[str, Any]]) -> None:
        key = tuple((id(g["params"]), len(g["params"])) for g in param_groups)
        if key == self.key:
            return
        by_place: dict[tuple[torch.device, torch.dtype, bool], list[torch.nn.Parameter]] = {}
        for group in param_groups:
            for p in group["params"]:
                by_place.setdefault((p.device, p.dtype, is_dtensor(p)), []).append(p)
        self.key = key
        self.groups = list(by_place.values())
        self.sparse = [False] * len(self.groups)
        self.upcast = [False] * len(self.groups)
        self.dtensor = [place[2] for place in by_place]
        self.complex = [place[1].is_complex for place in by_place]
        self.invalid = [not (d.is_floating_point or d.is_complex) for _, d, _ in by_place]

    @staticmethod
    def _reject(param_groups: Sequence[dict[str, Any]], params: list[torch.nn.Parameter]) -> None:
        """A TypeError for a parameter of a non-float dtype that has a gradient (one without a
        gradient, e.g. a frozen integer tensor in a param group, is left alone): an integer
        gradient cannot be unscaled (it would be applied ``loss_scale`` times too large, or
        floored to 0)."""
        p = next(p for p in params if p.grad is not None)
        where = next(
            f"param_groups[{i}]['params'][{j}]"
            for i, group in enumerate(param_groups)
            for j, q in enumerate(group["params"])
            if q is p
        )
        raise TypeError(
            f"{where} has a gradient of dtype {p.dtype}: only floating-point (and complex) "
            "gradients can be unscaled and checked"
        )

    def grad_lists(
        self, param_groups: Sequence[dict[str, Any]]
    ) -> list[tuple[int, list[torch.Tensor]]]:
        """This step's gradients per group that has any, with the group's index (whose
        per-group flags are read and set by that index)."""
        self.refresh(param_groups)
        lists = []
        for index, (params, dtensor) in enumerate(zip(self.groups, self.dtensor, strict=True)):
            grads = [p.grad for p in params if p.grad is not None]
            if dtensor:  # this rank's shards
                grads = [cast(Any, g)._local_tensor for g in grads]
            if grads and self.invalid[index]:
                self._reject(param_groups, params)
            if grads and self.complex[index]:  # float views of the same storage
                grads = [torch.view_as_real(g) for g in grads]
            if grads:
                lists.append((index, grads))
        return lists


def _check_and_unscale_in_float32(
    tensors: list[torch.Tensor], found: torch.Tensor, inv: torch.Tensor
) -> None:
    """The fused unscale + check for a half dtype the kernel lacks on a device (bfloat16 on
    CUDA, pytorch#127176): the same kernel on float32 copies, written back with one rounding,
    which is what the kernel computes where it has the dtype (float32 math, cast back).
    Costs a float32 copy of the group's gradients and two extra passes; no sync."""
    copies = [t.float() for t in tensors]
    torch._amp_foreach_non_finite_check_and_unscale_(copies, found, inv)
    torch._foreach_copy_(tensors, copies)


def _dense_views(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sparse grads replaced by their values (half ones coalesced first, so duplicate entries
    cannot overflow later in the optimizer's own coalesce)."""
    out = []
    for g in grads:
        if g.is_sparse:
            if g.dtype in HALF and not g.is_coalesced():
                g.copy_(g.coalesce())
            out.append(g._values())
        else:
            out.append(g)
    return out


def check_and_unscale(
    groups: GradGroups,
    param_groups: Sequence[dict[str, Any]],
    inv_scale: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Fused unscale (when ``inv_scale`` is given; None: check only) + non-finite check of the
    gradients of ``param_groups``.

    Returns ``found_inf`` (see the module docstring) on ``device``. One fused kernel per
    (device, dtype) group, in place; no sync.
    """
    found = torch.zeros((), dtype=torch.float32, device=device)
    for index, grads in groups.grad_lists(param_groups):
        sparse = groups.sparse[index]
        tensors = _dense_views(grads) if sparse else grads
        where = tensors[0].device
        found_d = found if where == device else torch.zeros((), device=where)
        inv = torch.ones((), device=where) if inv_scale is None else inv_scale
        if inv.device != where:
            inv = inv.to(where, non_blocking=True)
        if groups.upcast[index]:
            _check_and_unscale_in_float32(tensors, found_d, inv)
        else:
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_d, inv)
            except NotImplementedError:
                if not sparse and any(g.is_sparse for g in grads):
                    groups.sparse[index] = True  # remember: sparse grads by values
                    tensors = _dense_views(grads)
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_d, inv)
                elif tensors[0].dtype in HALF:
                    # bfloat16 on CUDA (pytorch#127176), where GradScaler fails
                    groups.upcast[index] = True
                    _check_and_unscale_in_float32(tensors, found_d, inv)
                else:
                    raise
        if found_d is not found:
            # maximum, not a sum: fused optimizers skip only on found_inf == 1.0 exactly
            found = torch.maximum(found, found_d.to(device, non_blocking=True))
    return found


def unscale_and_check(
    groups: GradGroups,
    param_groups: Sequence[dict[str, Any]],
    ls: ScaleState,
    torch_reciprocal: bool = False,
) -> torch.Tensor:
    """Unscale the gradients of ``param_groups`` in place by ``1 / ls.scale`` and check them:
    ``found_inf`` (see the module docstring) on ``ls.device``.

    The fused kernel checks its inputs, the scaled gradients. When the scale may drop below 1
    (``min_loss_scale`` or the initial scale < 1), unscaling multiplies, so a finite scaled
    float16 gradient can overflow: the unscaled gradients are then checked too (a second,
    read-only pass). ``torch_reciprocal``: the reciprocal in float64, as torch's GradScaler
    (see :meth:`ScaleState.inv_scale`). One fused kernel per (device, dtype) group (two when
    the scale may drop below 1); no sync.
    """
    found = check_and_unscale(groups, param_groups, ls.inv_scale(torch_reciprocal), ls.device)
    if ls.dynamic and ls.may_drop_below_one:
        found = torch.maximum(found, check_and_unscale(groups, param_groups, None, ls.device))
    return found


def resolve_group(process_group: Any) -> Any:
    """The process group to agree over, or None for no reduction.

    An explicit group is used as given; ``None`` means the default group when
    torch.distributed is initialised (checked at each step, so initialising it after building
    the front end works), else no reduction.
    """
    if process_group is not None:
        return process_group
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def check_process_group(process_group: Any) -> None:
    """TypeError unless ``process_group`` is None or a ``torch.distributed.ProcessGroup``."""
    if process_group is not None and not (
        torch.distributed.is_available()
        and isinstance(process_group, torch.distributed.ProcessGroup)
    ):
        raise TypeError(
            '"process_group" must be None or a torch.distributed.ProcessGroup, got '
            f"{process_group!r}"
        )


def agree(found_inf: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """``MAX`` all-reduce of ``found_inf`` in place over each distinct group (in order); no-op
    for none. MAX, never SUM: the flag must stay exactly 0.0 or 1.0 when several ranks
    overflow (fused optimizers skip only on 1.0). One collective per group, asynchronous on
    the device for NCCL (no host sync)."""
    seen: list[Any] = []
    for group in groups:
        if group is None or any(group is s for s in seen):
            continue
        seen.append(group)
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=group)
    return found_inf


class ScaleState:
    """The loss scale of one front end, on one device, with its step records.

    A fixed scale (``settings.rule`` None) is one 0-d float32 tensor; a dynamic one is the core
    rule's :class:`DynamicState` as torch tensors, created eagerly on ``device``. Tensors are
    replaced, never modified in place, so a reference taken before a step keeps its value.
    """

    def __init__(
        self,
        settings: ScaleSettings,
        device: torch.device,
        alarm: StallAlarm | None = None,
        where: str = "LossScaleOptimizer",
    ) -> None:
        self.rule: DynamicRule | None = settings.rule
        self.initial_scale = settings.initial_scale
        self.device = device
        self.alarm = alarm
        self.where = where
        like = torch.empty((), device=device)
        self.fixed: torch.Tensor | None = None
        self.state: DynamicState | None = None
        if self.rule is None:
            self.fixed = torch.full((), settings.initial_scale, dtype=torch.float32, device=device)
        else:
            self.state = dynamic_state(settings.initial_scale, self.rule, like, TORCH)
        self.applied = torch.ones((), dtype=torch.bool, device=device)
        self.applied_host: bool | None = True
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.stalled = torch.zeros((), dtype=torch.int64, device=device)
        self.stall_warned = False

    @property
    def dynamic(self) -> bool:
        return self.rule is not None

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, 0-d float32 on ``device`` (no sync, no copy)."""
        if self.state is None:
            return cast(torch.Tensor, self.fixed)
        return cast(torch.Tensor, self.state.loss_scale)

    def inv_scale(self, float64: bool = False) -> torch.Tensor:
        """``1 / scale`` in float32: TensorFlow's float32 reciprocal, or (``float64``) torch's
        GradScaler's, computed in float64 and rounded (equal whenever the scale is a power of
        two, as in every run with the default factors). One or three tiny kernels, no sync."""
        if float64 and self.scale.device.type != "mps":
            return self.scale.double().reciprocal().float()
        return torch.reciprocal(self.scale)

    @property
    def may_drop_below_one(self) -> bool:
        """Whether the scale can ever be < 1 (then unscaling can overflow float16 grads)."""
        if self.rule is None:
            return self.initial_scale < 1
        return self.rule.min_loss_scale < 1 or self.initial_scale < 1

    def move_to(self, device: torch.device) -> None:
        """Move every tensor to ``device`` (device to device, no host sync)."""
        self.device = device

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        if self.fixed is not None:
            self.fixed = move(self.fixed)
        if self.state is not None:
            self.state = DynamicState(*(move(t) for t in self.state))
        self.applied, self.skipped, self.stalled = (
            move(self.applied),
            move(self.skipped),
            move(self.stalled),
        )

    # -- a step's outcome ---------------------------------------------------------------------
    def next_stalled(self, is_finite: torch.Tensor) -> torch.Tensor:
        """The stall count after a step with this flag (not stored; no sync)."""
        rule = cast(DynamicRule, self.rule)
        return cast(torch.Tensor, stall_update(self.stalled, is_finite, self.scale, rule, TORCH))

    def record(
        self,
        is_finite: torch.Tensor | None,
        applied_host: bool | None,
        stalled: torch.Tensor | None = None,
    ) -> None:
        """Record a step (``is_finite`` None: a fixed scale, which always applies) and advance
        the dynamic scale by the rule. ``stalled``: the count already computed with
        :meth:`next_stalled`. A handful of 0-d kernels, no sync."""
        self.applied_host = applied_host
        if is_finite is None or self.state is None:
            self.applied = torch.ones((), dtype=torch.bool, device=self.device)
            return
        rule = cast(DynamicRule, self.rule)
        self.applied = is_finite
        self.skipped = self.skipped + (~is_finite).to(torch.int64)
        self.stalled = self.next_stalled(is_finite) if stalled is None else stalled
        self.state = dynamic_update(self.state, is_finite, rule, TORCH)

    def check_stall(self, stalled_host: int | None = None, stacklevel: int = 5) -> None:
        """The stall alarm's host-side check, with a count the caller already read (else it is
        read here: a host sync on a GPU)."""
        if self.alarm is None or self.alarm.steps is None or self.state is None:
            return
        count = int(self.stalled.item()) if stalled_host is None else stalled_host
        if count < self.alarm.steps and not self.stall_warned:
            return
        self.stall_warned = report_stall(
            count,
            float(self.scale.item()),
            self.alarm,
            warned=self.stall_warned,
            where=self.where,
            stacklevel=stacklevel,
        )

    # -- host reads and checkpoints -------------------------------------------------------------
    def good_steps(self) -> int:
        """The growth counter as a Python int (a host sync on a GPU)."""
        return int(cast(DynamicState, self.state).good_steps.item())

    def state_dict_values(self) -> tuple[float, int, int]:
        """(scale, good_steps, nonfinite_steps) of a dynamic scale as Python numbers, in one
        read (a host sync on a GPU)."""
        state = cast(DynamicState, self.state)
        scale = float(state.loss_scale.item())
        good, bad = torch.stack([state.good_steps, state.nonfinite_steps]).tolist()
        return scale, int(good), int(bad)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint dict of :mod:`lossscale.core._checkpoint` (a host sync on a GPU)."""
        if self.state is None:
            return scale_state_dict(self.initial_scale)
        scale, good, bad = self.state_dict_values()
        return scale_state_dict(scale, (good, bad))

    def check_state_dict(self, state: Any) -> tuple[float, int, int] | None:
        """Validate a checkpoint dict against this configuration (ValueError naming the key);
        nothing changes."""
        if self.rule is None:
            read_fixed_state(state, self.initial_scale)
            return None
        return read_dynamic_state(state, self.rule)

    def load(self, scale: float, good: int, bad: int) -> None:
        """Set a validated dynamic state (three small fills; no sync)."""
        like = self.scale
        self.state = DynamicState(
            TORCH.scalar(scale, "float32", like),
            TORCH.scalar(good, "int", like),
            TORCH.scalar(bad, "int", like),
        )
        self.stalled = torch.zeros((), dtype=torch.int64, device=self.device)
        self.stall_warned = False

    def set_rule(self, rule: DynamicRule) -> None:
        """Replace the hyperparameters (GradScaler's setters); the state is kept."""
        self.rule = rule

    def set_scale(self, value: torch.Tensor) -> None:
        """Replace the current scale with ``value`` (0-d float32 on ``device``); counters kept."""
        state = cast(DynamicState, self.state)
        self.state = DynamicState(value, state.good_steps, state.nonfinite_steps)


def scale_tensor(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t * scale`` in at least float32: a float16/bfloat16 tensor comes back float32 (so it
    cannot overflow from the cast of the scale), float32 and float64 keep their dtype. One
    multiply kernel (plus a device copy of the scale when ``t`` lives elsewhere), no sync."""
    if scale.device != t.device:
        scale = scale.to(t.device, non_blocking=True)
    if t.dtype in HALF:
        return t.float() * scale
    return t * scale.to(t.dtype)


#: The keys of an enabled ``torch.amp.GradScaler``'s ``state_dict()``.
GRAD_SCALER_KEYS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
)


class GradScalerState(NamedTuple):
    """A ``torch.amp.GradScaler`` checkpoint, checked (see :func:`read_grad_scaler_state`)."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    growth_tracker: int


def is_grad_scaler_state(state: Any) -> bool:
    """Whether ``state`` looks like a ``torch.amp.GradScaler`` state dict (its keys), including
    the empty dict a disabled GradScaler writes."""
    return isinstance(state, dict) and (state == {} or set(GRAD_SCALER_KEYS) <= set(state))


def read_grad_scaler_state(state: Any) -> GradScalerState:
    """Check a ``torch.amp.GradScaler`` state dict; nothing is loaded here.

    Raises:
      ValueError: the empty state of a disabled GradScaler (torch's own raises RuntimeError),
        a missing key, or a value torch could not have written (a scale that is not finite and
        > 0, a negative tracker, factors out of range), naming the key.
    """
    if state == {}:
        raise ValueError(
            "the GradScaler state is empty: it was saved from a disabled GradScaler "
            "(enabled=False), which has no loss-scale state to load; start from this object's "
            "own initial scale instead, or save the state from an enabled GradScaler"
        )
    if not isinstance(state, dict):
        raise ValueError(f"a GradScaler state must be a dict, got {state!r}")
    for key in GRAD_SCALER_KEYS:
        if key not in state:
            raise ValueError(f"GradScaler state is missing key {key!r}")

    def number(key: str) -> float:
        value = state[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"state[{key!r}] must be a number, got {value!r}")
        return float(value)

    scale = number("scale")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"state['scale'] must be finite and > 0, got {state['scale']!r}")
    growth, backoff = number("growth_factor"), number("backoff_factor")
    interval, tracker = number("growth_interval"), number("_growth_tracker")
    if interval != int(interval) or interval < 1:
        raise ValueError(f"state['growth_interval'] must be an int >= 1, got {interval!r}")
    if tracker != int(tracker) or tracker < 0:
        raise ValueError(f"state['_growth_tracker'] must be an int >= 0, got {tracker!r}")
    return GradScalerState(scale, growth, backoff, int(interval), int(tracker))
