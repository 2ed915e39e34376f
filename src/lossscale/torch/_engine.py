"""The kernels under lossscale.torch's :class:`~lossscale.torch._step.Step`, each once:

* :class:`GradGroups` and :func:`check_and_unscale`: gradients grouped by (device, dtype), one
  fused unscale + non-finite check per group (``torch._amp_foreach_non_finite_check_and_unscale_``),
  sparse and DTensor (FSDP2) gradients, bfloat16 on CUDA;
* :func:`agree`: the ``MAX`` all-reduce of the non-finite flag across ranks;
* :func:`device_decides`: where a fused optimizer's step is decided;
* :func:`fused_step` and :func:`scale_tensor`: torch's fused-optimizer protocol, the loss scaling.

The non-finite flag of a check is ``found_inf``: a 0-d float32 tensor, exactly 1.0 when a
gradient was not finite and 0.0 otherwise (fused optimizers skip only on 1.0 and subtract it
from their ``step`` counts); the rule takes its complement, ``is_finite = found_inf == 0``.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch

from lossscale.torch._state import DynamicScale, FixedScale

HALF = (torch.float16, torch.bfloat16)
_GRAD = operator.attrgetter("grad")


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
        self.has_big: list[bool] = []  # a CPU group with a parameter of READ_ONLY_MIN elements
        self.any_grad = False  # whether the last grad_lists found a gradient

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
        self.has_big = [
            place[0].type == "cpu" and any(p.numel() >= READ_ONLY_MIN for p in params)
            for place, params in by_place.items()
        ]

    @staticmethod
    def _reject(param_groups: Sequence[dict[str, Any]], params: list[torch.nn.Parameter]) -> None:
        """A TypeError for a parameter of a non-float dtype that has a gradient (one without a
        gradient, e.g. a frozen integer tensor in a param group, is left alone): an integer
        gradient cannot be unscaled (it would be applied ``loss_scale`` times too large, or
        floored to 0)."""
        p = next(p for p in params if p.grad is not None)
        raise TypeError(
            f"{param_name(param_groups, p)} has a gradient of dtype {p.dtype}: only "
            "floating-point (and complex) gradients can be unscaled and checked"
        )

    def float16_trained(self) -> list[torch.nn.Parameter]:
        """The float16 parameters with a gradient, of the groups :meth:`refresh` last saw
        (host work: a look at each float16 parameter's ``.grad``)."""
        return [
            p
            for params in self.groups
            if params and params[0].dtype == torch.float16
            for p in params
            if p.grad is not None
        ]

    def grad_lists(
        self, param_groups: Sequence[dict[str, Any]]
    ) -> list[tuple[int, list[torch.Tensor]]]:
        """This step's gradients per group that has any, with the group's index (whose
        per-group flags are read and set by that index)."""
        self.refresh(param_groups)
        lists = []
        for index, (params, dtensor) in enumerate(zip(self.groups, self.dtensor, strict=True)):
            if torch.compiler.is_compiling():  # dynamo traces no attrgetter
                grads = [p.grad for p in params if p.grad is not None]
            else:  # C-level loops: about half the comprehension's host time
                grads = list(map(_GRAD, params))
                if any(map(operator.is_, grads, itertools.repeat(None))):
                    grads = [g for g in grads if g is not None]
            if dtensor:  # this rank's shards
                grads = [cast(Any, g)._local_tensor for g in grads]
            if grads and self.invalid[index]:
                self._reject(param_groups, params)
            if grads and self.complex[index]:  # float views of the same storage
                grads = [torch.view_as_real(g) for g in grads]
            if grads:
                lists.append((index, grads))
        self.any_grad = bool(lists)
        return lists


def param_name(param_groups: Sequence[dict[str, Any]], p: torch.Tensor) -> str:
    """``p`` as the optimizer knows it: its name where the optimizer was given named
    parameters (``param_groups[i]["param_names"]``), else ``param_groups[i]['params'][j]``."""
    for i, group in enumerate(param_groups):
        for j, q in enumerate(group["params"]):
            if q is p:
                names = group.get("param_names")
                return repr(names[j]) if names else f"param_groups[{i}]['params'][{j}]"
    return "a parameter"


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


_ONES: dict[torch.device, torch.Tensor] = {}

#: On the CPU, a check without unscale (there: the second pass over unscaled gradients when
#: the scale may drop below 1; fused optimizers are stepped as ordinary ones, see
#: :func:`device_decides`) reads gradients of at least this many elements with
#: ``torch.aminmax`` (one read, no write; NaN and both infinities reach its min or max)
#: instead of the fused kernel, which writes every element back: one op per such tensor, so
#: only where the pass, not the dispatch, dominates. Other devices keep the one multi-tensor
#: kernel.
READ_ONLY_MIN = 2**18


def _read_only_found(tensors: list[torch.Tensor]) -> torch.Tensor:
    """1.0 if any element of ``tensors`` is not finite, else 0.0: 0-d float32, reading each
    tensor once (``aminmax``) and writing none. ``len(tensors) + 4`` ops, no sync."""
    bounds = torch.stack([b for t in tensors for b in torch.aminmax(t)])
    return torch.isfinite(bounds).all().logical_not().float()


def one(device: torch.device) -> torch.Tensor:
    """A 0-d float32 1.0 on ``device``, made once per device and never written: the check-only
    kernel's ``inv_scale``, the upper bound of a decision flag."""
    value = _ONES.get(device)
    if value is None:
        value = _ONES[device] = torch.ones((), device=device)
    return value


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
    (device, dtype) group, in place; no sync. Check only, on the CPU: tensors of at least
    :data:`READ_ONLY_MIN` elements are read without a write (:func:`_read_only_found`).
    """
    found = torch.zeros((), dtype=torch.float32, device=device)
    read_only: list[torch.Tensor] = []
    for index, grads in groups.grad_lists(param_groups):
        sparse = groups.sparse[index]
        tensors = _dense_views(grads) if sparse else grads
        if inv_scale is None and groups.has_big[index] and not sparse:
            big = [t for t in tensors if t.numel() >= READ_ONLY_MIN and t.layout is torch.strided]
            if big:
                read_only.append(_read_only_found(big))
                chosen = {id(t) for t in big}
                tensors = [t for t in tensors if id(t) not in chosen]
                if not tensors:
                    continue
        where = tensors[0].device
        found_d = found if where == device else torch.zeros((), device=where)
        inv = one(where) if inv_scale is None else inv_scale
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
    for flag in read_only:
        found = torch.maximum(found, flag.to(device, non_blocking=True))
    return found


def unscale_and_check(
    groups: GradGroups, param_groups: Sequence[dict[str, Any]], ls: FixedScale | DynamicScale
) -> torch.Tensor:
    """Unscale the gradients of ``param_groups`` in place by ``1 / ls.scale`` and check them:
    ``found_inf`` (see the module docstring) on ``ls.device``.

    The fused kernel checks its inputs, the scaled gradients. When the scale may drop below 1
    (``min_loss_scale`` or the initial scale < 1), unscaling multiplies, so a finite scaled
    float16 gradient can overflow: the unscaled gradients are then checked too (a second,
    read-only pass). One fused kernel per (device, dtype) group (two when the scale may drop
    below 1); no sync.
    """
    found = check_and_unscale(groups, param_groups, ls.inv_scale(), ls.device)
    if isinstance(ls, DynamicScale) and ls.may_drop_below_one:
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
    """TypeError unless ``process_group`` is None or a ``torch.distributed.ProcessGroup``;
    ValueError for the placeholder ``dist.new_group`` returns on ranks outside the group."""
    dist = torch.distributed
    outside = type(process_group) is int and process_group == dist.GroupMember.NON_GROUP_MEMBER
    if dist.is_available() and outside:
        raise ValueError(
            f"process_group={process_group!r} is torch.distributed's NON_GROUP_MEMBER: this rank "
            "is not a member of the group. dist.new_group(ranks) returns it on the ranks it "
            "leaves out; build the scaler or optimizer with that group on its member ranks "
            "only, or pass a group that contains this rank (None: the default group)"
        )
    if process_group is not None and not (
        torch.distributed.is_available()
        and isinstance(process_group, torch.distributed.ProcessGroup)
    ):
        raise TypeError(
            '"process_group" must be None or a torch.distributed.ProcessGroup, got '
            f"{process_group!r}"
        )


def agree(found_inf: torch.Tensor, process_groups: Sequence[Any]) -> torch.Tensor:
    """``MAX`` all-reduce of ``found_inf`` in place over each distinct group (in order); no-op
    for none. MAX, never SUM: the flag must stay exactly 0.0 or 1.0 when several ranks
    overflow (fused optimizers skip only on 1.0). One collective per group, asynchronous on
    the device for NCCL (no host sync)."""
    seen: list[Any] = []
    for group in process_groups:
        if group is None or any(group is s for s in seen):
            continue
        seen.append(group)
        torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX, group=group)
    return found_inf


#: Device types whose kernels have finished when they return: a flag there is read on the
#: host without waiting for a device (``.item()`` is a memory read, not a sync).
SYNCHRONOUS_DEVICES = frozenset({"cpu"})


_TORCH_OWN_STEP: dict[type, bool] = {}


def _torch_own_step(cls: type) -> bool:
    """Whether the ``step`` of class ``cls`` is one of torch.optim's (cached per class)."""
    own = _TORCH_OWN_STEP.get(cls)
    if own is None:
        defining = next(c for c in cls.__mro__ if "step" in vars(c))
        own = _TORCH_OWN_STEP[cls] = defining.__module__.startswith("torch.optim.")
    return own


def own_fused_protocol(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` declares torch's fused protocol (``_step_supports_amp_scaling``)
    with a ``step`` of its own, not torch's: such an optimizer (apex's, DeepSpeed's, a user's)
    may rely on receiving ``grad_scale`` / ``found_inf`` and on being called every step, so it
    always gets torch's protocol. torch's own fused classes (``step`` not overridden) may be
    stepped as ordinary ones (:func:`device_decides`). Host work only, cached per class."""
    fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    return fused and not _torch_own_step(type(optimizer))


def device_decides(device: torch.device, device_side_skip: bool) -> bool:
    """Whether a fused optimizer's step is decided on the device (``found_inf`` handed to its
    kernel, which skips there; no host sync, and the optimizer's ``step`` is always called).

    Only when asked for (``device_side_skip=True``) on a device where reading the flag would
    wait for the device (not :data:`SYNCHRONOUS_DEVICES`), and always under ``torch.compile``
    (where a read breaks the graph). Otherwise the fused optimizer is stepped as an ordinary
    one: its gradients are unscaled in the check kernel, the flag is read (the step's one host
    sync, a memory read on the CPU), and a skipped step does not call the optimizer, so a
    framework that watches ``optimizer.step`` (Accelerate, the HF Trainer, timm) sees the skip.

    On the CPU this is also cheaper than the kernel's own unscale: torch's fused CPU kernels
    store each gradient again when given ``grad_scale`` and undo a device-side skip with a
    ``_foreach_sub_`` over every step count. The same weights, bit for bit, whenever the scale
    is a power of two (``g * (1 / s)`` and ``g / s`` then round alike)."""
    if torch.compiler.is_compiling():
        return True
    return device_side_skip and device.type not in SYNCHRONOUS_DEVICES


def fused_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``optimizer.step(*args, **kwargs)`` with ``grad_scale`` and ``found_inf`` set on it for
    this call only (the attributes a fused optimizer reads: its kernel divides the gradients by
    ``grad_scale`` as it applies them, and skips when ``found_inf`` is 1.0); returns the
    step's result."""
    inner = cast(Any, optimizer)
    inner.grad_scale, inner.found_inf = grad_scale, found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del inner.grad_scale, inner.found_inf


def scale_tensor(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t * scale`` in at least float32: a float16/bfloat16 tensor comes back float32 (so it
    cannot overflow from the cast of the scale), float32, float64 and complex keep their dtype,
    and an integer or bool tensor comes back float32 (torch's type promotion, as
    ``torch.amp.GradScaler.scale``; never the scale cast to the integer dtype). One multiply
    kernel (plus a device copy of the scale when ``t`` lives elsewhere), no sync."""
    if scale.device != t.device:
        scale = scale.to(t.device, non_blocking=True)
    if t.dtype in HALF:
        return t.float() * scale
    if not (t.is_floating_point() or t.is_complex()):
        return t * scale  # promotes to float32
    return t * scale.to(t.dtype)
