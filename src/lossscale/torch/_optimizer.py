"""``LossScaleOptimizer`` for any ``torch.optim`` optimizer: TensorFlow's API over the engine.

Closures and ``step_together`` live in :mod:`lossscale.torch._closure`, checkpoints and configs
in :mod:`lossscale.torch._persistence`.

The loss-scale state is an engine :class:`~lossscale.torch._engine.ScaleState` whose tensors live
on the parameters' device from construction on (eager, so ``load_state_dict`` works before the
first step). Every scale update calls the one rule, :func:`lossscale.core.dynamic_update`.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch

from lossscale.core._settings import (
    scale_settings,
)
from lossscale.core._stall import DEFAULT_STALL_STEPS, stall_alarm
from lossscale.core._validation import FLOAT32_MAX
from lossscale.torch import _closure, _persistence
from lossscale.torch import _engine as engine

# Inner optimizers already wrapped (weak: an optimizer that dies is forgotten).
_WRAPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class _Pending:
    """A pending ``unscale_()`` result, kept on a plain object rather than as an attribute of
    the optimizer: torch.compile (dynamo, torch 2.13) silently drops attribute assignments made
    on a ``torch.optim.Optimizer`` instance inside compiled code, while those on a plain object
    are replayed. (The engine's :class:`ScaleState` is such a plain object too.)"""

    def __init__(self) -> None:
        self.unscaled_found: torch.Tensor | None = None
        self.scaled = False  # a scaled loss (or a read of loss_scale) since the last step
        self.warned_unscaled = False


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
    Host syncs per step: **one** (reading the skip decision), after which the rule runs on the
    host; a skipped step does not call the inner ``step``. **Zero** for fused optimizers
    (``fused=True`` Adam, AdamW, SGD, Adagrad) on a GPU with ``device_side_skip=True``: they
    receive the scale (``grad_scale``) and ``found_inf``, unscale in their kernel and skip on
    the device (see :func:`~lossscale.torch._engine.device_decides`).

    A skipped step leaves parameters and every inner state tensor (momenta, moments, ``step``
    counts) bit-identical; ``last_step_applied`` and ``skipped_steps`` say what happened.

    Args:
      inner_optimizer: the ``torch.optim.Optimizer`` to wrap (not a LossScaleOptimizer, and not
        one already wrapped); TensorFlow's name, so ``LossScaleOptimizer(inner_optimizer=sgd)``
        works as in TensorFlow.
      dynamic: bool; False gives a fixed scale (``initial_scale`` required), which never skips,
        as TensorFlow: non-finite gradients are applied.
      initial_scale: the starting scale; default 2**15 when dynamic.
      dynamic_growth_steps: consecutive finite steps before the scale doubles; default 2000;
        must be None when not dynamic.
      min_loss_scale, max_loss_scale, hysteresis: the :class:`lossscale.DynamicLossScale`
        extensions (dynamic only).
      stall_steps, on_stall: the stall alarm (dynamic only; see
        :func:`lossscale.core.stall_alarm`): after ``stall_steps`` consecutive skipped steps at
        ``min_loss_scale`` (default 1000), warn once or raise; ``stall_steps=None`` turns it
        off. After an unfused step the count is on the host already (no sync); after fused
        steps (no sync) it is checked where the state is read on the host anyway
        (``dynamic_counter``, ``state_dict()``).
      enabled: bool (keyword-only). False: this optimizer is the inner optimizer exactly, the
        ``GradScaler(enabled=use_amp)`` idiom: ``get_scaled_loss`` returns the loss itself,
        ``step()`` is the inner step (closure and return value passed through), no
        loss-scale tensors, checks or host syncs; ``loss_scale`` reads 1, ``state_dict()`` is
        the inner optimizer's (an enabled optimizer loading it keeps its own scale).
      process_group: the ``torch.distributed`` group whose ranks must agree (data-parallel
        replicas, FSDP2 shards). ``None`` (the default): the default group whenever
        torch.distributed is initialised at ``step()`` time, else none. Each dynamic step
        all-reduces the non-finite flag with ``MAX`` over it, once (all device/dtype groups
        together), before the skip decision and the scale update, so every rank applies or
        skips together and holds the same scale. Pass a one-rank group to opt out. The flag
        lives on the parameters' device, so the group's backend must support it (gloo for
        CPU, NCCL for CUDA). With NCCL the collective adds no host sync; with gloo on CPU it
        blocks until every rank has checked its gradients.

      device_side_skip: bool (keyword-only, default False). True: a fused optimizer on a GPU
        skips in its kernel, with no host sync per step; its ``step`` is then called on skipped
        steps too, so code that watches ``step`` calls cannot see the skip (read
        ``last_step_applied``; :meth:`step_scheduler` then syncs). No effect on the CPU, where
        reading the flag costs no sync, or on unfused optimizers.

    Raises:
      TypeError: ``inner_optimizer`` not an optimizer or a LossScaleOptimizer; ``dynamic``
        not a bool; ``process_group`` neither None nor a ``torch.distributed.ProcessGroup``.
      ValueError: ``inner_optimizer`` already wrapped; ``dynamic=False`` without
        ``initial_scale`` or with ``dynamic_growth_steps``; any value out of range. A
        constructor that fails leaves the inner optimizer unmarked (TensorFlow marks it).
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        *,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = FLOAT32_MAX,
        hysteresis: int = 1,
        stall_steps: int | None = DEFAULT_STALL_STEPS,
        on_stall: str = "warn",
        process_group: Any = None,
        enabled: bool = True,
        device_side_skip: bool = False,
    ) -> None:
        optimizer = inner_optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            what = "torch.optim.Optimizer"
            raise TypeError(f'"inner_optimizer" must be an instance of {what}, got {optimizer!r}')
        settings = scale_settings(
            dynamic,
            initial_scale,
            dynamic_growth_steps,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
        )
        if isinstance(optimizer, LossScaleOptimizer):
            raise TypeError(
                f"LossScaleOptimizer cannot wrap another LossScaleOptimizer, got {optimizer!r}"
            )
        alarm = stall_alarm(stall_steps, on_stall)
        engine.check_process_group(process_group)
        if not isinstance(enabled, bool):
            raise TypeError(f'"enabled" must be a bool, got {enabled!r}')
        if not isinstance(device_side_skip, bool):
            raise TypeError(f'"device_side_skip" must be a bool, got {device_side_skip!r}')
        if optimizer in _WRAPPED:
            raise ValueError(
                '"inner_optimizer" is already wrapped by a LossScaleOptimizer; an optimizer can '
                "only be wrapped by a single LossScaleOptimizer"
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
        self._device = device
        self._settings = settings
        self._alarm = alarm
        # disabled: no loss-scale tensors at all (U2)
        self._ls: engine.ScaleState | None = (
            engine.ScaleState(settings, device, alarm, type(self).__name__) if enabled else None
        )
        self._pending = _Pending()
        self._groups = engine.GradGroups()
        self._process_group = process_group
        self._device_skip = device_side_skip
        _WRAPPED.add(optimizer)

    # -- TensorFlow's attributes ------------------------------------------------------------
    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale is dynamic (as configured, also when disabled)."""
        return self._settings.dynamic

    @property
    def initial_scale(self) -> float:
        """The initial loss scale, a Python float (never the current one)."""
        return self._settings.initial_scale

    @property
    def dynamic_growth_steps(self) -> int | None:
        """Finite steps before the scale grows; None when not dynamic."""
        rule = self._settings.rule
        return None if rule is None else rule.increment_period

    @property
    def enabled(self) -> bool:
        """Whether loss scaling is on. Disabled (``enabled=False``), this optimizer is its inner
        optimizer exactly: no scaling, no checks, no syncs, ``loss_scale`` 1."""
        return self._ls is not None

    @property
    def dynamic_counter(self) -> int | None:
        """Consecutive finite steps counted toward the next growth (Python int); None when not
        dynamic. Reading it syncs with the device (a GPU ``.item()``), and runs the stall
        alarm's check."""
        if not self.dynamic:
            return None
        if self._ls is None:
            return 0
        return self._ls.read(stacklevel=2)[1]  # free after ordinary steps

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current scale: a 0-d float32 tensor on the parameters' device (no sync).

        Read-only; later steps never modify it, so a reference taken before a step keeps the
        old value (no copy after ordinary steps; after a fused optimizer's step, whose scale
        update runs in place on the device, each read is a copy: one tiny kernel). Reading it
        counts as scaling the loss by hand for the unscaled-gradients warning of :meth:`step`
        (``(loss * opt.loss_scale).backward()``).
        """
        self._pending.scaled = True
        if self._ls is None:
            return torch.ones((), device=self._device)  # disabled: a new 0-d tensor per read
        return self._ls.scale_snapshot()

    @property
    def process_group(self) -> Any:
        """The group given to the constructor (None: the default group when torch.distributed
        is initialised at ``step()`` time)."""
        return self._process_group

    @property
    def last_step_applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last ``step()`` applied the update (no sync)."""
        if self._ls is None:
            return torch.ones((), dtype=torch.bool, device=self._device)
        return self._ls.applied

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-d int64 tensor: how many ``step()`` calls were skipped so far (no sync)."""
        if self._ls is None:
            return torch.zeros((), dtype=torch.int64, device=self._device)
        return self._ls.skipped

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
        self._pending.scaled = True
        if self._ls is None:
            return loss  # disabled: the loss itself
        return engine.scale_tensor(loss, self._ls.scale)

    def get_unscaled_gradients(self, grads: Iterable[torch.Tensor | None]) -> list[Any]:
        """New tensors ``g / loss_scale`` in each gradient's dtype; ``None`` entries kept.

        Multiplies by the float32 reciprocal (TensorFlow's rule); float16/bfloat16 gradients
        are computed in float32 and cast back; complex ones keep their dtype. The inputs are not
        modified. One kernel per gradient, no sync.

        Raises:
          TypeError: ``grads`` a single tensor (not a list of them); an entry that is
            neither ``None`` nor a floating-point or complex tensor
            (an integer or bool gradient cannot be unscaled: TensorFlow's cast of the
            reciprocal to it gives 0), named by its index. Checked before any kernel runs.
        """
        if isinstance(grads, torch.Tensor):  # iterating it would unscale its rows
            raise TypeError(
                "grads must be a list (or other iterable) of gradients, got a single tensor; "
                "pass [grad]"
            )
        grads = list(grads)
        for i, g in enumerate(grads):
            if g is not None and not (
                isinstance(g, torch.Tensor) and (g.is_floating_point() or g.is_complex())
            ):
                what = f"dtype {g.dtype}" if isinstance(g, torch.Tensor) else repr(g)
                raise TypeError(
                    f"grads[{i}]: gradients must be floating-point (or complex) tensors or "
                    f"None, got {what}"
                )
        if self._ls is None:
            return grads  # disabled: the gradients themselves
        inv = self._ls.inv_scale()  # float32 reciprocal, as TensorFlow's 1.0 / loss_scale
        out: list[Any] = []
        for g in grads:
            if g is None:
                out.append(None)
                continue
            inv_g = inv if inv.device == g.device else inv.to(g.device, non_blocking=True)
            if g.dtype in engine.HALF:
                out.append((g.float() * inv_g).to(g.dtype))
            else:
                out.append(g * inv_g.to(g.dtype))
        return out

    # -- the step ----------------------------------------------------------------------------
    def _fused(self) -> bool:
        return bool(getattr(self._inner, "_step_supports_amp_scaling", False))

    def unscale_(self) -> None:
        """Unscale the gradients in place now, e.g. before ``clip_grad_norm_``.

        Idempotent until the next ``step()``: a second call does nothing, so gradients are
        never unscaled twice. ``step()`` then reuses this check. One fused kernel per
        (device, dtype) group; no sync.
        """
        if self._ls is not None and self._pending.unscaled_found is None:
            self._pending.unscaled_found = self._unscale_all()

    def _unscale_all(self) -> torch.Tensor:
        ls = cast(engine.ScaleState, self._ls)
        return engine.unscale_and_check(self._groups, self.param_groups, ls)

    def _prepare(self) -> tuple[torch.Tensor, bool]:
        """First half of a step: check the gradients, and unscale them unless a fused
        optimizer will (``unscale_()`` may have done both already). Returns the found-non-finite
        flag (0-d float32 on the state's device) and whether the gradients are unscaled.

        A fused optimizer with a dynamic scale gets the scale as ``grad_scale`` and unscales
        in its own kernel, as under torch's GradScaler: the check is then the loss scaling's
        only pass over the gradients (a skipped step leaves ``.grad`` scaled).
        Not when the scale may drop below 1 (unscaling then multiplies, and a finite scaled
        float16 gradient could overflow inside the kernel, unchecked): those are unscaled and
        checked here.
        """
        if self._pending.unscaled_found is not None:
            return self._pending.unscaled_found, True
        ls = cast(engine.ScaleState, self._ls)
        if self._on_device() and not ls.may_drop_below_one:
            return engine.check_and_unscale(self._groups, self.param_groups, None, ls.device), False
        return self._unscale_all(), True

    def _on_device(self) -> bool:
        """Whether this step is decided on the device: a fused optimizer with a dynamic scale,
        off the CPU, when asked for (:func:`~lossscale.torch._engine.device_decides`)."""
        ls = cast(engine.ScaleState, self._ls)
        return self._fused() and ls.dynamic and engine.device_decides(ls.device, self._device_skip)

    def _group(self) -> Any:
        """The group the flag is reduced over this step; None when there is nothing to agree on
        (a fixed scale never skips)."""
        if self._ls is None or not self._ls.dynamic:
            return None
        return engine.resolve_group(self._process_group)

    def _finish(self, found: torch.Tensor, unscaled: bool = True) -> None:
        """Second half: apply or skip the inner step, then record it and update the scale.
        ``unscaled``: whether the gradients are unscaled (else the fused optimizer gets the
        scale as ``grad_scale``)."""
        ls = cast(engine.ScaleState, self._ls)
        self._pending.unscaled_found = None
        if not ls.dynamic:  # a fixed scale: unscaled already, never skips
            self._inner.step()
            ls.record_fixed()
            return
        if self._on_device():
            engine.fused_step(self._inner, None if unscaled else ls.scale, found)
            ls.record_device(found)  # no sync: the decision stays on the device
            return
        applied = not found.item()  # the step's one host sync (a read on the CPU)
        if applied:
            self._inner.step()
        ls.record_host(applied)  # the rule on the host: no device work
        ls.check_stall(stacklevel=6)  # _finish, _step_no_closure, no_grad, step, hooks, user

    def _check_scaled(self) -> None:
        """Warn once when this step's gradients cannot have come from a scaled loss: the step
        would divide unscaled gradients by the scale (a framework calling ``backward()`` on
        the plain loss). Host work only (a Python flag), no device work."""
        pending = self._pending
        if not pending.scaled and not pending.warned_unscaled:
            pending.warned_unscaled = True
            warnings.warn(
                f"{type(self).__name__}.step(): no scaled loss since the last step (no "
                "get_scaled_loss, minimize or scaled closure), yet step() divides the gradients "
                "by the loss scale, so this update is that many times too small. If a framework "
                "calls backward() for you (Lightning, Accelerate, the HF Trainer, timm), give it "
                "lossscale.torch.GradScaler as its scaler and pass it the plain optimizer. If "
                "you scale the loss yourself, multiply it by opt.loss_scale (reading it counts "
                "as scaling).",
                UserWarning,
                stacklevel=4,
            )
        pending.scaled = False

    @torch.no_grad()
    def _step_no_closure(self) -> None:
        self._check_scaled()
        found, unscaled = self._prepare()
        self._finish(engine.agree(found, [self._group()]), unscaled)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale the gradients, check them, apply or skip the inner step, update the scale.

        Under torch.distributed (see ``process_group``) the non-finite flag is MAX-all-reduced
        once before the decision, so all ranks apply or skip together.

        Without a closure: gradients must come from a backward pass of
        ``get_scaled_loss(loss)`` (or ``minimize``, or ``(loss * opt.loss_scale).backward()``);
        returns None. When none of these happened since the last step, the gradients are
        unscaled and the step would make a far too small update: it warns once (a
        ``UserWarning`` naming the fix: frameworks that call ``backward()`` themselves take
        :class:`lossscale.torch.GradScaler`). Gradient accumulation over several scaled
        backward passes is one scaled step.

        With a closure (LBFGS, or any optimizer): the closure computes the loss, calls
        ``self.get_scaled_loss(loss).backward()`` and returns the loss. Each evaluation's
        gradients are unscaled in place before the inner optimizer sees them. The closure is
        evaluated once first to decide the step (a host sync); on a non-finite result the step
        is skipped. Parameters and inner state are snapshotted before the inner step and
        restored if a later evaluation (an LBFGS line search) turns non-finite. Returns what
        the closure returned on its first evaluation.

        ``.grad`` after ``step()`` (applied or skipped; a skipped step's gradients keep their
        non-finite entries): unscaled in place for ordinary optimizers, for closures, for
        any optimizer on the CPU, and whenever ``unscale_()`` ran first. On a GPU a fused
        optimizer with a dynamic scale gets the scale (``grad_scale``) and unscales ``.grad``
        in its own kernel as it applies the step, so a *skipped* fused step leaves ``.grad``
        scaled, as under torch's GradScaler: the loss scaling then never writes the gradients
        itself. Call ``unscale_()`` before ``step()`` for unscaled gradients (to clip them,
        say). Device work: one fused check kernel per (device, dtype) group; then the rule on
        the host (after the step's one read of the flag) or, for fused optimizers on a GPU
        (no sync), in about 6 tiny kernels on the device.
        """
        if self._ls is None:
            return self._inner.step(closure)  # disabled: the inner step exactly
        if closure is None:
            self._step_no_closure()
            return None
        return _closure.step_with_closure(self, closure)

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

        Keeps schedules from advancing on skipped steps. Free after a step whose decision
        was read on the host (unfused, or on the CPU); one host sync after a fused step on a
        GPU.
        """
        if self._ls is None:
            scheduler.step()
            return True
        applied = self._ls.applied_host
        if applied is None:
            applied = bool(self._ls.applied.item())
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
                g = engine.local(g)  # a DTensor: this rank's shard (no collective)
                values = g._values() if g.is_sparse else g
                if values.numel() == 0:
                    continue
                m = float(values.detach().abs().max().float().item())
                if not math.isfinite(m):
                    report.append((names.get(id(p), f"param_groups[{i}][{j}]"), m))
        return report

    # -- checkpoints and config (lossscale.torch._persistence) --------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``'loss_scale'`` (the loss scale's
        ``state_dict()``) and ``'skipped_steps'``. Reads the scale and counters: free after
        ordinary steps (the host holds them), a host sync on a GPU after fused ones."""
        return _persistence.state_dict(self._inner, self._ls)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by :meth:`state_dict` (also before the first step), a plain
        ``torch.optim`` state dict (the loss scale is kept), or a ``torch.amp.GradScaler``
        state dict (only the loss scale is loaded: its ``scale`` and ``_growth_tracker``).

        Raises ``ValueError`` naming the key for a malformed loss-scale state (or the empty
        state of a disabled GradScaler); then nothing changes (the loss-scale part is checked
        before anything is loaded). Disabled (``enabled=False``), the loss-scale entries and
        GradScaler states are ignored and the inner optimizer's state is loaded. No sync.
        """
        rest = _persistence.load_state_dict(self._ls, state_dict)
        if rest is None:  # a GradScaler state: the loss scale only
            return
        self._inner.load_state_dict(rest.inner)
        # torch's load_state_dict replaces the inner optimizer's param_groups and state
        # objects: share the new ones.
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state
        rest.load_scale()

    def get_config(self) -> dict[str, Any]:
        """TensorFlow's keys: ``inner_optimizer`` (``{'class_name', 'config'}`` with the inner
        optimizer's defaults), ``dynamic``, ``initial_scale``, ``dynamic_growth_steps``; the
        extensions (and ``stall_steps``/``on_stall``, ``enabled``) only when not at their
        defaults."""
        return _persistence.config(self._inner, self._settings, self._alarm, self._ls is not None)

    @classmethod
    def from_config(cls, config: dict[str, Any], params: Iterable[Any]) -> LossScaleOptimizer:
        """Build from :meth:`get_config`'s dict over ``params`` (torch optimizers need them).

        The inner class is looked up in ``torch.optim`` by ``class_name``. A TensorFlow ≤ 2.3
        config (``{'optimizer': ..., 'loss_scale': ...}``) is converted as TensorFlow 2.4+ does
        (:func:`lossscale.core.upgrade_optimizer_config`).
        """
        inner, kwargs = _persistence.from_config(config, params)
        return cls(inner, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r}, dynamic={self.dynamic})"
