"""``LossScaleOptimizer`` for any ``torch.optim`` optimizer: TensorFlow's API over the core rule.

The loss-scale state is a :class:`lossscale.DynamicLossScale` (or :class:`FixedLossScale`)
whose arrays live on the parameters' device as torch tensors from construction on (eager, so
``load_state_dict`` works before the first step). Every scale update calls the one rule,
:func:`lossscale.core.dynamic_update`.
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch

from lossscale.core._backends import torch_namespace
from lossscale.core._validation import FLOAT32_MAX
from lossscale.stateful._loss_scale import DynamicLossScale, optimizer_loss_scale

_TORCH = torch_namespace()
_HALF = (torch.float16, torch.bfloat16)
_GRAD_SCALER_KEYS = frozenset(
    {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
)
# Inner optimizers already wrapped (weak: an optimizer that dies is forgotten).
_WRAPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _is_dtensor(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (FSDP2, tensor parallel); looked up only if torch imported
    ``torch.distributed.tensor`` already (a DTensor cannot exist otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def _local(g: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage, so in-place ops write through), else ``g``."""
    return cast(torch.Tensor, cast(Any, g)._local_tensor) if _is_dtensor(g) else g


class _GradGroups:
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

    def refresh(self, param_groups: Sequence[dict[str, Any]]) -> None:
        key = tuple((id(g["params"]), len(g["params"])) for g in param_groups)
        if key == self.key:
            return
        by_place: dict[tuple[torch.device, torch.dtype, bool], list[torch.nn.Parameter]] = {}
        for group in param_groups:
            for p in group["params"]:
                by_place.setdefault((p.device, p.dtype, _is_dtensor(p)), []).append(p)
        self.key = key
        self.groups = list(by_place.values())
        self.sparse = [False] * len(self.groups)
        self.upcast = [False] * len(self.groups)
        self.dtensor = [place[2] for place in by_place]


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


def _resolve_group(process_group: Any) -> Any:
    """The process group to all-reduce the non-finite flag over, or None for no reduction.

    An explicit group is used as given; ``None`` means the default group when
    torch.distributed is initialised (checked at each step, so initialising it after building
    the optimizer works), else no reduction.
    """
    if process_group is not None:
        return process_group
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _all_reduce_max(found: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """MAX all-reduce of ``found`` in place over each distinct group (in order); no-op for
    none. One collective per group, asynchronous on the device for NCCL (no host sync)."""
    seen: list[Any] = []
    for group in groups:
        if group is None or any(group is s for s in seen):
            continue
        seen.append(group)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
    return found


def _clone_state(value: Any) -> Any:
    """A copy of an optimizer state value: tensors cloned, lists/tuples/dicts copied through."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_clone_state(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone_state(v) for k, v in value.items()}
    return value


class _StepRecord:
    """What the steps did so far (and a pending ``unscale_()``).

    Kept on a plain object rather than as attributes of the optimizer: torch.compile (dynamo,
    torch 2.13) silently drops attribute assignments made on a ``torch.optim.Optimizer``
    instance inside compiled code, while those on a plain object are replayed.
    """

    def __init__(self, device: torch.device) -> None:
        self.applied = torch.ones((), dtype=torch.bool, device=device)
        self.applied_host: bool | None = None
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.unscaled_found: torch.Tensor | None = None  # set by unscale_() until step()


class LossScaleOptimizer(torch.optim.Optimizer):
    """Wrap a ``torch.optim`` optimizer with dynamic (or fixed) loss scaling.

    TensorFlow's ``tf.keras.mixed_precision.LossScaleOptimizer`` for PyTorch. It shares the
    inner optimizer's ``param_groups``, ``state`` and ``defaults``, so LR schedulers,
    ``clip_grad_norm_`` and checkpoint code see the same objects.

    A training step::

        opt = LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        opt.get_scaled_loss(loss).backward()   # or opt.minimize(loss)
        opt.step()                             # unscale, check, apply or skip, update the scale
        opt.zero_grad()

    For example, a finite step applies and an overflowing one is skipped and halves the scale:

    >>> import torch
    >>> from lossscale.torch import LossScaleOptimizer
    >>> w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    >>> opt = LossScaleOptimizer(torch.optim.SGD([w], lr=0.5), initial_scale=1024.0)
    >>> opt.get_scaled_loss((w**2).sum()).backward()    # grads are 1024 * [2, 4]
    >>> opt.step()                                       # unscaled: [2, 4]
    >>> w.tolist(), bool(opt.last_step_applied), float(opt.loss_scale)
    ([0.0, 0.0], True, 1024.0)
    >>> opt.zero_grad()
    >>> w.grad = torch.tensor([float("inf"), 1.0])        # an overflow
    >>> opt.step()
    >>> w.tolist(), bool(opt.last_step_applied), float(opt.loss_scale), int(opt.skipped_steps)
    ([0.0, 0.0], False, 512.0, 1)

    ``step()``: one fused unscale + non-finite check per (device, dtype) group
    (``torch._amp_foreach_non_finite_check_and_unscale_``), then the inner step when every
    gradient is finite, then the scale update (:func:`lossscale.core.dynamic_update`).
    Host syncs per step: **one** (reading the skip decision) for ordinary optimizers; **zero**
    for fused optimizers (``fused=True`` Adam, AdamW, SGD, Adagrad), which receive the
    unscaled gradients with ``found_inf`` and skip on the device.

    A skipped step leaves parameters and every inner state tensor (momenta, moments, ``step``
    counts) bit-identical; ``last_step_applied`` and ``skipped_steps`` say what happened.

    Args:
      optimizer: the ``torch.optim.Optimizer`` to wrap (not a LossScaleOptimizer, and not one
        already wrapped).
      dynamic: bool; False gives a fixed scale (``initial_scale`` required), which never skips,
        as TensorFlow: non-finite gradients are applied.
      initial_scale: the starting scale; default 2**15 when dynamic.
      dynamic_growth_steps: consecutive finite steps before the scale doubles; default 2000;
        must be None when not dynamic.
      min_loss_scale, max_loss_scale, hysteresis: the :class:`lossscale.DynamicLossScale`
        extensions (dynamic only).
      process_group: the ``torch.distributed`` group whose ranks must agree (data-parallel
        replicas, FSDP2 shards). ``None`` (the default): the default group whenever
        torch.distributed is initialised at ``step()`` time, else none. Each dynamic step
        all-reduces the non-finite flag with ``MAX`` over it, once (all device/dtype groups
        together), before the skip decision and the scale update, so every rank applies or
        skips together and holds the same scale. Pass a one-rank group to opt out. The flag
        lives on the parameters' device, so the group's backend must support it (gloo for
        CPU, NCCL for CUDA). With NCCL the collective adds no host sync; with gloo on CPU it
        blocks until every rank has checked its gradients.

    Raises:
      TypeError: ``optimizer`` not an optimizer or a LossScaleOptimizer; ``dynamic`` not a
        bool; ``process_group`` neither None nor a ``torch.distributed.ProcessGroup``.
      ValueError: ``optimizer`` already wrapped; ``dynamic=False`` without ``initial_scale`` or
        with ``dynamic_growth_steps``; any value out of range. A constructor that fails leaves
        the inner optimizer unmarked (TensorFlow marks it).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        *,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = FLOAT32_MAX,
        hysteresis: int = 1,
        process_group: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f'"optimizer" must be an instance of torch.optim.Optimizer, got {optimizer!r}'
            )
        if not isinstance(dynamic, bool):
            raise TypeError(f'"dynamic" must be a bool, got {dynamic!r}')
        if isinstance(optimizer, LossScaleOptimizer):
            raise TypeError(
                f"LossScaleOptimizer cannot wrap another LossScaleOptimizer, got {optimizer!r}"
            )
        if process_group is not None and not (
            torch.distributed.is_available()
            and isinstance(process_group, torch.distributed.ProcessGroup)
        ):
            raise TypeError(
                '"process_group" must be None or a torch.distributed.ProcessGroup, got '
                f"{process_group!r}"
            )
        if optimizer in _WRAPPED:
            raise ValueError(
                '"optimizer" is already wrapped by a LossScaleOptimizer; an optimizer can only '
                "be wrapped by a single LossScaleOptimizer"
            )
        loss_scale = optimizer_loss_scale(
            dynamic,
            initial_scale,
            dynamic_growth_steps,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
        )

        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not params:
            raise ValueError(f"optimizer {optimizer!r} has no parameters")
        # Optimizer.__init__ sets up hooks and profiling; then share the inner containers.
        super().__init__(params, dict(optimizer.defaults))
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.defaults = optimizer.defaults

        device = params[0].device
        self._inner = optimizer
        self._loss_scale = loss_scale
        self._device = device
        if isinstance(loss_scale, DynamicLossScale):
            loss_scale._move_to(_TORCH, torch.empty((), device=device))
            self._fixed_scale: torch.Tensor | None = None
        else:
            self._fixed_scale = torch.full(
                (), loss_scale.get_config()["loss_scale_value"], dtype=torch.float32, device=device
            )
        self._rec = _StepRecord(device)
        self._groups = _GradGroups()
        self._process_group = process_group
        _WRAPPED.add(optimizer)

    # -- TensorFlow's attributes ------------------------------------------------------------
    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale is dynamic."""
        return isinstance(self._loss_scale, DynamicLossScale)

    @property
    def initial_scale(self) -> float:
        """The initial loss scale, a Python float (never the current one)."""
        if isinstance(self._loss_scale, DynamicLossScale):
            return self._loss_scale.initial_loss_scale
        return float(self._loss_scale.get_config()["loss_scale_value"])

    @property
    def dynamic_growth_steps(self) -> int | None:
        """Finite steps before the scale grows; None when not dynamic."""
        if isinstance(self._loss_scale, DynamicLossScale):
            return self._loss_scale.increment_period
        return None

    @property
    def dynamic_counter(self) -> int | None:
        """Consecutive finite steps counted toward the next growth (Python int); None when not
        dynamic. Reading it syncs with the device (a GPU ``.item()``)."""
        if isinstance(self._loss_scale, DynamicLossScale):
            return self._loss_scale.num_good_steps
        return None

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current scale: a 0-d float32 tensor on the parameters' device (no sync, no copy).

        Read-only; it is replaced, never modified, by ``step()``, so a reference taken before a
        step keeps the old value.
        """
        if self._fixed_scale is not None:
            return self._fixed_scale
        return cast(torch.Tensor, cast(DynamicLossScale, self._loss_scale).state.loss_scale)

    @property
    def process_group(self) -> Any:
        """The group given to the constructor (None: the default group when torch.distributed
        is initialised at ``step()`` time)."""
        return self._process_group

    @property
    def last_step_applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last ``step()`` applied the update (no sync)."""
        return self._rec.applied

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-d int64 tensor: how many ``step()`` calls were skipped so far (no sync)."""
        return self._rec.skipped

    # -- scaling ----------------------------------------------------------------------------
    def get_scaled_loss(self, loss: Any) -> Any:
        """``loss * loss_scale``, computed in at least float32.

        A float16/bfloat16 loss comes back float32 (so it cannot overflow to inf from the cast
        of the scale, as TensorFlow's does); float32 stays float32, float64 stays float64. A
        callable returns a callable that scales its result when called. One multiply kernel,
        no sync.

        Raises:
          TypeError: ``loss`` is neither a floating tensor nor a callable.
        """
        if callable(loss) and not isinstance(loss, torch.Tensor):
            fn = loss
            return lambda: self.get_scaled_loss(fn())
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise TypeError(
                f"loss must be a floating-point torch.Tensor or a callable, got {loss!r}"
            )
        scale = self.loss_scale
        if scale.device != loss.device:
            scale = scale.to(loss.device, non_blocking=True)
        if loss.dtype in _HALF:
            return loss.float() * scale
        return loss * scale.to(loss.dtype)

    def _inv_scale(self) -> torch.Tensor:
        # float32 reciprocal, as TensorFlow's 1.0 / loss_scale
        return torch.reciprocal(self.loss_scale)

    def get_unscaled_gradients(self, grads: Iterable[torch.Tensor | None]) -> list[Any]:
        """New tensors ``g / loss_scale`` in each gradient's dtype; ``None`` entries kept.

        Multiplies by the float32 reciprocal (TensorFlow's rule); float16/bfloat16 gradients
        are computed in float32 and cast back. The inputs are not modified. One kernel per
        gradient, no sync.
        """
        inv = self._inv_scale()
        out: list[Any] = []
        for g in grads:
            if g is None:
                out.append(None)
                continue
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"gradients must be tensors or None, got {g!r}")
            inv_g = inv if inv.device == g.device else inv.to(g.device, non_blocking=True)
            if g.dtype in _HALF:
                out.append((g.float() * inv_g).to(g.dtype))
            else:
                out.append(g * inv_g.to(g.dtype))
        return out

    # -- the step ----------------------------------------------------------------------------
    def _fused(self) -> bool:
        return bool(getattr(self._inner, "_step_supports_amp_scaling", False))

    def _grad_lists(self) -> list[tuple[int, list[torch.Tensor]]]:
        """This step's gradients per (device, dtype) group that has any, with the group's index
        in ``self._groups`` (whose per-group flags are read and set by that index)."""
        self._groups.refresh(self.param_groups)
        lists = []
        for index, (params, dtensor) in enumerate(
            zip(self._groups.groups, self._groups.dtensor, strict=True)
        ):
            grads = [p.grad for p in params if p.grad is not None]
            if dtensor:  # this rank's shards
                grads = [cast(Any, g)._local_tensor for g in grads]
            if grads:
                lists.append((index, grads))
        return lists

    @staticmethod
    def _dense_views(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sparse grads replaced by their values (half ones coalesced first, so duplicate
        entries cannot overflow later in the optimizer's own coalesce)."""
        out = []
        for g in grads:
            if g.is_sparse:
                if g.dtype in _HALF and not g.is_coalesced():
                    g.copy_(g.coalesce())
                out.append(g._values())
            else:
                out.append(g)
        return out

    def _check_and_unscale(self, inv_scale: torch.Tensor | None) -> torch.Tensor:
        """Fused unscale (when ``inv_scale`` is given) + non-finite check of all gradients.

        Returns a 0-d float32 tensor on the state's device: 1.0 if a gradient is non-finite,
        else 0.0 (exactly: fused optimizers skip only when ``found_inf == 1`` and subtract it
        from their ``step`` counts).
        One fused kernel per (device, dtype) group; no sync.
        """
        found = torch.zeros((), dtype=torch.float32, device=self._device)
        for index, grads in self._grad_lists():
            sparse = self._groups.sparse[index]
            tensors = self._dense_views(grads) if sparse else grads
            device = tensors[0].device
            found_d = found if device == self._device else torch.zeros((), device=device)
            inv = torch.ones((), device=device) if inv_scale is None else inv_scale
            if inv.device != device:
                inv = inv.to(device, non_blocking=True)
            if self._groups.upcast[index]:
                _check_and_unscale_in_float32(tensors, found_d, inv)
            else:
                try:
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_d, inv)
                except NotImplementedError:
                    if not sparse and any(g.is_sparse for g in grads):
                        self._groups.sparse[index] = True  # remember: sparse grads by values
                        tensors = self._dense_views(grads)
                        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_d, inv)
                    elif tensors[0].dtype in _HALF:
                        # bfloat16 on CUDA (pytorch#127176), where GradScaler fails
                        self._groups.upcast[index] = True
                        _check_and_unscale_in_float32(tensors, found_d, inv)
                    else:
                        raise
            if found_d is not found:
                # maximum, not a sum: fused optimizers skip only on found_inf == 1.0 exactly
                found = torch.maximum(found, found_d.to(self._device, non_blocking=True))
        return found

    def unscale_(self) -> None:
        """Unscale the gradients in place now, e.g. before ``clip_grad_norm_``.

        Idempotent until the next ``step()``: a second call does nothing, so gradients are
        never unscaled twice. ``step()`` then reuses this check. One fused kernel per
        (device, dtype) group; no sync.
        """
        if self._rec.unscaled_found is None:
            self._rec.unscaled_found = self._unscale_all()

    def _unscale_all(self) -> torch.Tensor:
        found = self._check_and_unscale(self._inv_scale())
        if isinstance(self._loss_scale, DynamicLossScale) and (
            self._loss_scale._scale_may_drop_below_one
        ):
            # A scale below 1 multiplies: a finite scaled float16 gradient can overflow.
            found = torch.maximum(found, self._check_and_unscale(None))
        return found

    def _prepare(self) -> torch.Tensor:
        """First half of a step: unscale and check (unless ``unscale_()`` already did). Returns
        the found-non-finite flag (0-d float32 on the state's device).

        Fused optimizers get the gradients unscaled too, with ``found_inf`` and no
        ``grad_scale``: their skip needs a check pass over the gradients anyway, and on CPU the
        fused unscale kernel is the fastest such pass (faster than any read-only reduction
        measured: ``_foreach_norm``, ``_foreach_max``, ``aminmax``), so the unscale is free and
        ``.grad`` ends up the same on every path.
        """
        if self._rec.unscaled_found is not None:
            return self._rec.unscaled_found
        return self._unscale_all()

    def _group(self) -> Any:
        """The group the flag is reduced over this step; None when there is nothing to agree on
        (a fixed scale never skips)."""
        if not isinstance(self._loss_scale, DynamicLossScale):
            return None
        return _resolve_group(self._process_group)

    def _finish(self, found: torch.Tensor) -> None:
        """Second half: apply or skip the inner step, then record it and update the scale."""
        dynamic = isinstance(self._loss_scale, DynamicLossScale)
        if self._fused():
            inner = cast(Any, self._inner)
            inner.found_inf = found if dynamic else None  # grads are already unscaled
            try:
                self._inner.step()
            finally:
                del inner.found_inf
            self._record(found == 0 if dynamic else None, None)
        elif not dynamic:
            self._inner.step()
            self._record(None, True)
        else:
            should_apply = found == 0
            applied = bool(should_apply.item())  # the one host sync of an unfused step
            if applied:
                self._inner.step()
            self._record(should_apply, applied)

    def _record(self, should_apply: torch.Tensor | None, applied_host: bool | None) -> None:
        """Record the outcome of a step and advance the scale (``None``: a fixed scale, which
        always applies)."""
        self._rec.unscaled_found = None
        self._rec.applied_host = applied_host
        if should_apply is None:
            self._rec.applied = torch.ones((), dtype=torch.bool, device=self._device)
            return
        self._rec.applied = should_apply
        self._rec.skipped = self._rec.skipped + (~should_apply).to(torch.int64)
        cast(DynamicLossScale, self._loss_scale)._advance(should_apply)

    @torch.no_grad()
    def _step_no_closure(self) -> None:
        self._finish(_all_reduce_max(self._prepare(), [self._group()]))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale the gradients, check them, apply or skip the inner step, update the scale.

        Under torch.distributed (see ``process_group``) the non-finite flag is MAX-all-reduced
        once before the decision, so all ranks apply or skip together.

        Without a closure: gradients must come from a backward pass of
        ``get_scaled_loss(loss)`` (or ``minimize``); returns None.

        With a closure (LBFGS, or any optimizer): the closure computes the loss, calls
        ``self.get_scaled_loss(loss).backward()`` and returns the loss. Each evaluation's
        gradients are unscaled in place before the inner optimizer sees them. The closure is
        evaluated once first to decide the step (a host sync); on a non-finite result the step
        is skipped. Parameters and inner state are snapshotted before the inner step and
        restored if a later evaluation (an LBFGS line search) turns non-finite. Returns what
        the closure returned on its first evaluation.

        ``.grad`` after ``step()``, on every path (unfused or fused, applied or skipped):
        unscaled, in place (a skipped step's gradients keep their non-finite entries).
        """
        if closure is None:
            self._step_no_closure()
            return None
        return self._step_with_closure(closure)

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        found_total = torch.zeros((), device=self._device)

        def evaluate() -> Any:
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                found_total.add_(self._unscale_all())
            return loss

        self._rec.unscaled_found = None
        first_loss = evaluate()
        if not self.dynamic:
            self._inner.step(lambda: first_loss)
            self._record(None, True)
            return first_loss
        group = [self._group()]
        if bool(_all_reduce_max(found_total, group).item()):  # the decision: one host sync
            self._record(torch.zeros((), dtype=torch.bool, device=self._device), False)
            return first_loss
        snapshot = self._snapshot()
        evaluations = [0]

        def replay() -> Any:
            evaluations[0] += 1
            return first_loss if evaluations[0] == 1 else evaluate()

        self._inner.step(replay)
        with torch.no_grad():
            applied = not bool(_all_reduce_max(found_total, group).item())
            if not applied:  # a later evaluation (line search) overflowed: undo the step
                self._restore(snapshot)
            self._record(torch.full((), applied, dtype=torch.bool, device=self._device), applied)
        return first_loss

    def _snapshot(self) -> dict[str, Any]:
        params = [p.detach().clone() for g in self.param_groups for p in g["params"]]
        # Containers are copied too: LBFGS keeps lists of tensors (old_dirs, al) that it
        # appends to and assigns into in place.
        state = {p: {k: _clone_state(v) for k, v in s.items()} for p, s in self.state.items()}
        return {"params": params, "state": state}

    def _restore(self, snapshot: dict[str, Any]) -> None:
        flat = [p for g in self.param_groups for p in g["params"]]
        for p, saved in zip(flat, snapshot["params"], strict=True):
            p.copy_(saved)
        self.state.clear()
        self.state.update(snapshot["state"])

    def minimize(self, loss: Any) -> Any:
        """Scaled backward of ``loss`` (a tensor or a zero-argument callable), then ``step()``.

        TensorFlow's ``minimize``. Gradients are not zeroed first (torch convention: they
        accumulate until ``zero_grad()``). Returns the unscaled loss tensor.
        """
        value = loss() if callable(loss) and not isinstance(loss, torch.Tensor) else loss
        self.get_scaled_loss(value).backward()
        self.step()
        return value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer (shared, so this optimizer sees it too)."""
        if not hasattr(self, "_inner"):  # called by Optimizer.__init__ before sharing
            super().add_param_group(param_group)
            return
        self._inner.add_param_group(param_group)

    def step_scheduler(self, scheduler: Any) -> bool:
        """Step an LR ``scheduler`` only if the last ``step()`` was applied; return whether.

        Keeps schedules from advancing on skipped steps. Free after an unfused step (which
        already read the decision); one host sync after a fused one.
        """
        applied = self._rec.applied_host
        if applied is None:
            applied = bool(self._rec.applied.item())
        if applied:
            scheduler.step()
        return applied

    # -- diagnostics -------------------------------------------------------------------------
    def nonfinite_gradients(self, module: torch.nn.Module | None = None) -> list[tuple[str, float]]:
        """``(name, max |grad|)`` of every parameter whose gradient holds NaN or inf now.

        Call it after a skipped step to see which parameters overflowed. Names come from
        ``module.named_parameters()`` when given, else ``param_groups[i][j]``. Costs nothing
        unless called; when called, one reduction per gradient and one host sync per
        parameter. For DTensor (FSDP2) gradients only this rank's shards are read (no
        collective): call it on every rank to see where an overflow came from.
        """
        names = {}
        if module is not None:
            names = {id(p): n for n, p in module.named_parameters()}
        report = []
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                g = _local(g)  # a DTensor: this rank's shard (no collective)
                values = g._values() if g.is_sparse else g
                if values.numel() == 0:
                    continue
                m = float(values.detach().abs().max().float().item())
                if not math.isfinite(m):
                    report.append((names.get(id(p), f"param_groups[{i}][{j}]"), m))
        return report

    # -- checkpoints and config --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``'loss_scale'`` (the loss scale's
        ``state_dict()``) and ``'skipped_steps'``. Reads the scale and counters: a host sync
        on a GPU."""
        sd = self._inner.state_dict()
        sd["loss_scale"] = self._loss_scale.state_dict()
        sd["skipped_steps"] = int(self._rec.skipped.item())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by :meth:`state_dict` (also before the first step), a plain
        ``torch.optim`` state dict (the loss scale is kept), or a ``torch.amp.GradScaler``
        state dict (only the loss scale is loaded: its ``scale`` and ``_growth_tracker``).

        Raises ``ValueError`` naming the key for a malformed loss-scale state; then nothing
        changes (the loss-scale part is checked before anything is loaded).
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {state_dict!r}")
        if set(state_dict) >= _GRAD_SCALER_KEYS:
            self._load_grad_scaler(state_dict)
            return
        rest = dict(state_dict)
        ls_state = rest.pop("loss_scale", None)
        skipped = rest.pop("skipped_steps", None)
        if ls_state is not None:
            twin = type(self._loss_scale).from_config(self._loss_scale.get_config())
            twin.load_state_dict(ls_state)  # validation only, on the host
        if skipped is not None and (
            isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0
        ):
            raise ValueError(f"state_dict['skipped_steps'] must be an int >= 0, got {skipped!r}")
        self._inner.load_state_dict(rest)
        # torch's load_state_dict replaces the inner optimizer's param_groups and state
        # objects: share the new ones.
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state
        if ls_state is not None:
            self._loss_scale.load_state_dict(ls_state)
        if skipped is not None:
            self._rec.skipped = torch.full((), skipped, dtype=torch.int64, device=self._device)

    def _load_grad_scaler(self, sd: dict[str, Any]) -> None:
        if not isinstance(self._loss_scale, DynamicLossScale):
            raise ValueError(
                "a GradScaler state can only be loaded into a dynamic LossScaleOptimizer"
            )
        if sd["growth_factor"] != 2.0 or sd["backoff_factor"] != 0.5:
            warnings.warn(
                f"GradScaler state has growth_factor={sd['growth_factor']!r} and "
                f"backoff_factor={sd['backoff_factor']!r}; this optimizer keeps its multiplier "
                f"2.0 (TensorFlow's)",
                UserWarning,
                stacklevel=3,
            )
        if sd["growth_interval"] != self._loss_scale.increment_period:
            warnings.warn(
                f"GradScaler state has growth_interval={sd['growth_interval']!r}; this "
                f"optimizer keeps dynamic_growth_steps={self._loss_scale.increment_period}",
                UserWarning,
                stacklevel=3,
            )
        tracker = int(sd["_growth_tracker"])
        self._loss_scale.load_state_dict(
            {
                "version": 1,
                "class_name": "DynamicLossScale",
                "current_loss_scale": float(sd["scale"]),
                "num_good_steps": min(tracker, self._loss_scale.increment_period - 1),
                "num_nonfinite_steps": 0,
            }
        )

    def get_config(self) -> dict[str, Any]:
        """TensorFlow's keys: ``inner_optimizer`` (``{'class_name', 'config'}`` with the inner
        optimizer's defaults), ``dynamic``, ``initial_scale``, ``dynamic_growth_steps``; the
        extensions only when not at their defaults."""
        config: dict[str, Any] = {
            "inner_optimizer": {
                "class_name": type(self._inner).__name__,
                "config": dict(self._inner.defaults),
            },
            "dynamic": self.dynamic,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }
        if isinstance(self._loss_scale, DynamicLossScale):
            extra = self._loss_scale.get_config()
            for key in ("min_loss_scale", "max_loss_scale", "hysteresis"):
                if key in extra:
                    config[key] = extra[key]
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], params: Iterable[Any]) -> LossScaleOptimizer:
        """Build from :meth:`get_config`'s dict over ``params`` (torch optimizers need them).

        The inner class is looked up in ``torch.optim`` by ``class_name``.
        """
        config = dict(config)
        inner = _inner_from_config(config.pop("inner_optimizer"), params)
        return cls(inner, **config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r}, dynamic={self.dynamic})"


def _inner_from_config(inner_cfg: dict[str, Any], params: Iterable[Any]) -> torch.optim.Optimizer:
    """The inner optimizer of a :meth:`LossScaleOptimizer.get_config` dict, over ``params``."""
    inner_cls = getattr(torch.optim, inner_cfg["class_name"], None)
    if not (isinstance(inner_cls, type) and issubclass(inner_cls, torch.optim.Optimizer)):
        raise ValueError(f"unknown torch.optim optimizer {inner_cfg['class_name']!r}")
    return inner_cls(params, **inner_cfg["config"])


def step_together(*optimizers: LossScaleOptimizer) -> torch.Tensor:
    """Step several LossScaleOptimizers (a GAN's) so that they all apply or all skip.

    Each unscales and checks its own gradients; if any of them found a non-finite gradient,
    every one skips and backs off. Under torch.distributed the combined flag is all-reduced
    once per distinct process group of the optimizers, so "any" spans all ranks too. Returns
    the shared ``should_apply`` (0-d bool tensor). Host syncs: one per unfused optimizer, none
    for fused ones.

    >>> import torch
    >>> from lossscale.torch import LossScaleOptimizer, step_together
    >>> g, d = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    >>> g_opt = LossScaleOptimizer(torch.optim.SGD([g], lr=0.1), initial_scale=8.0)
    >>> d_opt = LossScaleOptimizer(torch.optim.SGD([d], lr=0.1), initial_scale=8.0)
    >>> g.grad, d.grad = torch.full((2,), 8.0), torch.tensor([8.0, float("nan")])
    >>> bool(step_together(g_opt, d_opt))        # d overflowed: both skip
    False
    >>> g.tolist(), float(g_opt.loss_scale), float(d_opt.loss_scale)
    ([1.0, 1.0], 4.0, 4.0)
    """
    if not optimizers or not all(isinstance(o, LossScaleOptimizer) for o in optimizers):
        raise TypeError("step_together takes one or more LossScaleOptimizer instances")
    with torch.no_grad():
        founds = [o._prepare() for o in optimizers]
        device = founds[0].device
        # amax, not a sum: each flag is 0.0 or 1.0 and fused optimizers skip only on 1.0
        total = torch.stack([f.to(device, non_blocking=True) for f in founds]).amax()
        _all_reduce_max(total, [o._group() for o in optimizers])
        for o in optimizers:
            o._finish(total.to(o._device, non_blocking=True))
            # What torch's LR schedulers check for their "lr_scheduler.step() before
            # optimizer.step()" warning: this counts as a step of each optimizer.
            o._opt_called = True  # type: ignore[attr-defined]
    return total == 0
