"""``LossScaleOptimizer`` for any ``torch.optim`` optimizer: TensorFlow's API over one
:class:`~lossscale.torch._step.Step`.

The loss scale (:mod:`lossscale.torch._state`) lives on the parameters' device from
construction on (eager, so ``load_state_dict`` works before the first step); checkpoints and
configs are :mod:`lossscale.torch._persistence`'s.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lossscale.core import _validation as v
from lossscale.core._settings import scale_settings
from lossscale.core._stall import DEFAULT_STALL_STEPS, stall_alarm
from lossscale.core._validation import FLOAT32_MAX
from lossscale.torch import _engine as engine
from lossscale.torch import _gradients, _persistence
from lossscale.torch._state import DisabledScale, DynamicScale, applied_now, scale_state
from lossscale.torch._step import Step
from lossscale.torch._step import step_together as _step_together

# Inner optimizers already wrapped (weak: an optimizer that dies is forgotten).
_WRAPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


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

    A skipped step leaves parameters and every inner state tensor (momenta, moments, ``step``
    counts) bit-identical; ``last_step_applied`` and ``skipped_steps`` say what happened.
    Host syncs and device work: see :meth:`step`.

    Args:
      inner_optimizer: the ``torch.optim.Optimizer`` to wrap (not a LossScaleOptimizer, and not
        one already wrapped); TensorFlow's name, so ``LossScaleOptimizer(inner_optimizer=sgd)``
        works as in TensorFlow.
      dynamic: bool; False gives a fixed scale (``initial_scale`` required), which never skips,
        as TensorFlow: non-finite gradients are applied.
      initial_scale: the starting scale; default 2**15 when dynamic.
      dynamic_growth_steps: consecutive finite steps before the scale doubles; default 2000;
        must be None when not dynamic.
      min_loss_scale, max_loss_scale, hysteresis, hysteresis_refill: the
        :class:`lossscale.DynamicLossScale` extensions (dynamic only).
      stall_steps, on_stall: the stall alarm (dynamic only; see
        :func:`lossscale.core.stall_alarm`): after ``stall_steps`` consecutive skipped steps at
        ``min_loss_scale`` (default 1000), warn once or raise; ``stall_steps=None`` turns it
        off. After a host-decided step the count is on the host already (no sync); after
        device-side steps (no sync) it is checked where the state is read on the host anyway
        (``dynamic_counter``, ``state_dict()``).
      enabled: bool (keyword-only). False: this optimizer is the inner optimizer exactly, the
        ``GradScaler(enabled=use_amp)`` idiom: ``get_scaled_loss`` returns the loss itself,
        ``step()`` is the inner step (closure and return value passed through), no
        loss-scale tensors, checks or host syncs; ``loss_scale`` reads 1, ``state_dict()`` is
        the inner optimizer's (an enabled optimizer loading it keeps its own scale).
      process_group: the ``torch.distributed`` group whose ranks must agree (replicas,
        shards, pipeline stages). ``None`` (the default): the default group whenever
        torch.distributed is initialised at ``step()`` time, else none. Each dynamic step
        all-reduces the non-finite flag with ``MAX`` over it once, before the decision, so
        every rank applies or skips together. A one-rank group opts out. The group's backend
        must support the parameters' device (gloo: CPU, NCCL: CUDA, no host sync there).
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
        hysteresis_refill: str = "on_backoff",
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
            hysteresis_refill=hysteresis_refill,
        )
        if isinstance(optimizer, LossScaleOptimizer):
            raise TypeError(
                f"LossScaleOptimizer cannot wrap another LossScaleOptimizer, got {optimizer!r}"
            )
        alarm = stall_alarm(stall_steps, on_stall)
        engine.check_process_group(process_group)
        if not isinstance(enabled, bool):
            raise TypeError(f'"enabled" must be a bool, got {enabled!r}')
        v.boolean("device_side_skip", device_side_skip)
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
        where = type(self).__name__
        # disabled: no loss-scale tensors at all
        self._ls = scale_state(settings, device, alarm, where, enabled)
        # a plain object, not attributes of this Optimizer: torch.compile (dynamo, torch 2.13)
        # drops attribute writes on a torch.optim.Optimizer inside compiled code
        self._step = Step(optimizer, self._ls, process_group, device_side_skip, where)
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
        return not isinstance(self._ls, DisabledScale)

    @property
    def dynamic_counter(self) -> int | None:
        """Consecutive finite steps counted toward the next growth (Python int); None when not
        dynamic. Reading it syncs with the device (a GPU ``.item()``), and runs the stall
        alarm's check."""
        ls = self._ls
        if not self.dynamic:
            return None
        return ls.read()[1] if isinstance(ls, DynamicScale) else 0  # free after host steps

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current scale: a 0-d float32 tensor on the parameters' device (no sync).

        Read-only; later steps never modify it, so a reference taken before a step keeps the
        old value (no copy after ordinary steps; after a fused optimizer's step, whose scale
        update runs in place on the device, each read is a copy: one tiny kernel). Reading it
        counts as scaling the loss by hand for the unscaled-gradients warning of :meth:`step`
        (``(loss * opt.loss_scale).backward()``).
        """
        self._step.scaled = True
        return self._ls.scale_snapshot()  # disabled: a new 0-d 1.0 per read

    @property
    def process_group(self) -> Any:
        """The group given to the constructor (None: the default group when torch.distributed
        is initialised at ``step()`` time)."""
        return self._process_group

    @property
    def last_step_applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last ``step()`` applied the update (no sync)."""
        return self._ls.applied

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-d int64 tensor: how many ``step()`` calls were skipped so far (no sync)."""
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
        self._step.scaled = True
        if isinstance(self._ls, DisabledScale):
            return loss
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
        return _gradients.unscaled_copies(grads, self._ls)

    # -- the step ----------------------------------------------------------------------------
    def unscale_(self) -> None:
        """Unscale the gradients in place now, e.g. before ``clip_grad_norm_``.

        Idempotent until the next ``step()``: a second call does nothing, so gradients are
        never unscaled twice. ``step()`` then reuses this check. One fused kernel per
        (device, dtype) group; no sync. Disabled: a no-op.
        """
        step = self._step
        if not isinstance(self._ls, DisabledScale) and step.unscaled_found is None:
            with torch.no_grad():
                step.unscaled_found = step.check(unscale=True)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Unscale the gradients, check them, apply or skip the inner step, update the scale.

        Without a closure: gradients come from ``get_scaled_loss(loss).backward()`` (or
        ``minimize``, or ``(loss * opt.loss_scale).backward()``; several such passes
        accumulate into one step); returns None. When none of these happened since the last
        step, it warns once (a ``UserWarning`` naming the fix).

        With a closure (LBFGS, or any optimizer): the closure computes the loss, calls
        ``self.get_scaled_loss(loss).backward()`` and returns the loss. Each evaluation's
        gradients are unscaled in place before the inner optimizer sees them. The closure is
        evaluated once first to decide the step (a host sync); on a non-finite result the step
        is skipped. Parameters and inner state are snapshotted before the inner step and
        restored if a later evaluation (an LBFGS line search) turns non-finite. Returns what
        the closure returned on its first evaluation.

        Host syncs per step: **one** (reading the decision), after which the rule runs on the
        host and a skipped step does not call the inner ``step``; **zero** for a fused
        optimizer (``fused=True`` Adam, AdamW, SGD, Adagrad) on a GPU with
        ``device_side_skip=True``, which gets ``grad_scale`` and ``found_inf`` and skips in
        its kernel (:func:`~lossscale.torch._engine.device_decides`).

        ``.grad`` after ``step()``: unscaled in place (a skipped step's keep their non-finite
        entries), except after a skipped device-side step, whose fused kernel unscales only as
        it applies (``.grad`` stays scaled, as under torch's GradScaler; call ``unscale_()``
        first to clip). Device work: one check kernel per (device, dtype) group; the rule on
        the host, or after a device-side step in about 6 tiny kernels on the device.
        """
        return self._step.run(closure)

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

        Keeps schedules from advancing on skipped steps. Costs what
        :meth:`read_last_step_applied` costs.
        """
        applied = self.read_last_step_applied()
        if applied:
            scheduler.step()
        return applied

    def read_last_step_applied(self) -> bool:
        """:attr:`last_step_applied` as a Python bool: free after a step whose decision was
        read on the host (every step by default); one host sync after a fused optimizer's
        device-side step on a GPU (``device_side_skip=True``). True when disabled."""
        return applied_now(self._ls)

    def current_loss_scale(self) -> torch.Tensor:
        """The scale now, as :attr:`loss_scale` but for reading, not for scaling a loss by
        hand: the 0-d float32 tensor itself (no sync, no copy: read it before the next step),
        a new 0-d 1.0 when disabled. With :meth:`read_last_step_applied`, what
        :class:`lossscale.torch.ScaleReader` reads."""
        return self._ls.scale

    # -- diagnostics -------------------------------------------------------------------------
    def nonfinite_gradients(self, module: torch.nn.Module | None = None) -> list[tuple[str, float]]:
        """``(name, max |grad|)`` of every parameter whose gradient holds NaN or inf now.

        Call it after a skipped step to see which parameters overflowed. Names come from
        ``module.named_parameters()`` when given, else ``param_groups[i][j]``. Costs nothing
        unless called; when called, one reduction per gradient and one host sync per
        parameter. For DTensor (FSDP2) gradients only this rank's shards are read (no
        collective): call it on every rank to see where an overflow came from.
        """
        return _gradients.nonfinite_report(self.param_groups, module)

    # -- checkpoints and config (lossscale.torch._persistence) --------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``'loss_scale'`` (the loss scale's
        ``state_dict()``) and ``'skipped_steps'``. Reads the scale and counters: free after
        ordinary steps (the host holds them), a host sync on a GPU after fused ones."""
        return _persistence.optimizer_state_dict(self._inner, self._ls)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by :meth:`state_dict` (also before the first step), a plain
        ``torch.optim`` state dict (the loss scale is kept), or a ``torch.amp.GradScaler``
        state dict (only the loss scale is loaded: its ``scale`` and ``_growth_tracker``).

        Raises ``ValueError`` naming the key for a malformed loss-scale state (or the empty
        state of a disabled GradScaler), or for a dict that is neither a GradScaler state nor
        an optimizer state (no ``'state'`` / ``'param_groups'``); then nothing changes (the
        loss-scale part is checked before anything is loaded). Disabled (``enabled=False``),
        the loss-scale entries and GradScaler states are ignored and the inner optimizer's
        state is loaded. No sync.
        """
        rest = _persistence.split_optimizer_state(self._ls, state_dict)
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
        extra = {} if self.enabled else {"enabled": False}
        if self._device_skip:
            extra["device_side_skip"] = True
        return _persistence.optimizer_config(self._inner, self._settings, self._alarm, extra)

    @classmethod
    def from_config(cls, config: dict[str, Any], params: Iterable[Any]) -> LossScaleOptimizer:
        """Build from :meth:`get_config`'s dict over ``params`` (torch optimizers need them).

        The inner class is looked up in ``torch.optim`` by ``class_name``. A TensorFlow ≤ 2.3
        config (``{'optimizer': ..., 'loss_scale': ...}``) is converted as TensorFlow 2.4+ does
        (:func:`lossscale.core.upgrade_optimizer_config`).
        """
        inner, kwargs = _persistence.optimizer_from_config(config, params)
        return cls(inner, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickling and ``copy.deepcopy``: the whole optimizer (inner optimizer, loss-scale
        state, step records), where ``torch.optim.Optimizer`` keeps only its containers."""
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        inner = self._inner  # the copy shares the copied inner optimizer's containers
        self.param_groups, self.state, self.defaults = (
            inner.param_groups,
            inner.state,
            inner.defaults,
        )
        _WRAPPED.add(inner)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r}, dynamic={self.dynamic})"


def step_together(*optimizers: LossScaleOptimizer) -> torch.Tensor:
    """Step several LossScaleOptimizers (a GAN's) so that they all apply or all skip.

    Each unscales and checks its own gradients; if any of them found a non-finite gradient,
    every one skips and backs off. Under torch.distributed the combined flag is all-reduced
    once per distinct process group of the optimizers, so "any" spans all ranks too. Returns
    the shared ``should_apply`` (0-d bool tensor). Host syncs: one per optimizer decided on the
    host, none for fused ones decided on the device.

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
    enabled = [o for o in optimizers if o.enabled]
    for o in optimizers:
        if not o.enabled:  # disabled: their inner step, nothing to agree on
            o._inner.step()
    if not enabled:
        return torch.ones((), dtype=torch.bool, device=optimizers[0]._device)
    should_apply = _step_together([o._step for o in enabled])
    for o in enabled:
        # what torch's LR schedulers check for their "lr_scheduler.step() before
        # optimizer.step()" warning: this counts as a step of each optimizer
        o._opt_called = True  # type: ignore[attr-defined]
    return should_apply
