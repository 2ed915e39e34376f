"""``GradScaler``: a drop-in for ``torch.amp.GradScaler`` on lossscale's engine and rule.

Frameworks (Lightning, Accelerate and the HF Trainer, timm) drive a scaler through
``scale / unscale_ / step / update / state_dict / load_state_dict``; this class has that
interface, with torch's parameters and meaning, over :mod:`lossscale.torch._engine` (the same
unscale/check kernels, cross-rank agreement and state as ``LossScaleOptimizer``) and the one
rule, :func:`lossscale.core.dynamic_update`, with torch's separate growth and back-off factors.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.amp.grad_scaler import OptState

from lossscale.core import _validation as v
from lossscale.core._settings import scale_settings
from lossscale.core._stall import DEFAULT_STALL_STEPS, stall_alarm
from lossscale.torch import _engine as engine
from lossscale.torch._compat import TorchSurface
from lossscale.torch._persistence import SCALER_NAMES as _NAMES
from lossscale.torch._scaler_checkpoints import ScalerCheckpoints
from lossscale.torch._state import DisabledScale, DynamicScale, applied_now
from lossscale.torch._step import Step


def _fresh_optimizer_state() -> dict[str, Any]:
    """One optimizer's place in the current iteration, in torch's layout (code written for
    ``torch.amp.GradScaler`` reads ``"stage"`` and ``"found_inf_per_device"``): ``"stage"`` is
    torch's own ``OptState``; ``"found_inf_per_device"`` maps the scale's device to the
    optimizer's own non-finite flag on this rank (one entry: every gradient device's flag is
    combined there); ``"found_agreed"`` is that flag agreed over the process group (None: no
    group), and after ``step`` the flag the step was decided on; ``"found_host"`` is the
    decision as ``step`` read it on the host (None: not read)."""
    return {
        "stage": OptState.READY,
        "found_inf_per_device": {},
        "found_agreed": None,
        "found_host": None,
    }


class GradScaler(ScalerCheckpoints, TorchSurface):
    """A drop-in for ``torch.amp.GradScaler``: the same constructor, methods and checkpoints,
    on lossscale's rule.

    Use it wherever ``torch.amp.GradScaler`` goes: a hand-written loop, or a framework that
    takes a scaler (Lightning's ``MixedPrecision(..., scaler=)``, ``accelerator.scaler``,
    timm's ``NativeScaler``; see the Frameworks page)::

        scaler = lossscale.torch.GradScaler()          # was: torch.amp.GradScaler()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)                     # optional: before clipping
        scaler.step(optimizer)                         # skipped if a gradient is inf/NaN
        scaler.update()

    For example (on the CPU), an overflowing step is skipped and halves the scale:

    >>> import torch
    >>> from lossscale.torch import GradScaler
    >>> w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    >>> opt = torch.optim.SGD([w], lr=0.5)
    >>> scaler = GradScaler("cpu", init_scale=1024.0)
    >>> scaler.scale((w**2).sum()).backward()       # grads are 1024 * [2, 4]
    >>> scaler.step(opt); scaler.update()             # unscaled: [2, 4]
    >>> w.tolist(), scaler.get_scale()
    ([0.0, 0.0], 1024.0)
    >>> w.grad = torch.tensor([float("inf"), 1.0])   # an overflow
    >>> scaler.step(opt) is None; scaler.update()
    True
    >>> w.tolist(), scaler.get_scale(), int(scaler.skipped_steps)
    ([0.0, 0.0], 512.0, 1)

    The scale follows :func:`lossscale.core.dynamic_update` with ``multiplier=growth_factor``
    and ``backoff_factor``: in ordinary runs the same trajectory as ``torch.amp.GradScaler``
    (bit for bit whenever the factors are exact in float32, as 2 and 0.5 are), except that it
    never drops below ``min_loss_scale`` (default 1.0; torch's can reach 0.0 and stay there)
    and never grows past ``max_loss_scale``. Other differences from torch's class: bad
    arguments raise ``TypeError``/``ValueError`` (torch raises ``AssertionError`` or accepts
    them), the state is created eagerly on ``device`` (so ``load_state_dict`` works at once),
    a float16 ``scale(loss)`` comes back float32 (torch's overflows to inf at 65536), and
    ``last_step_applied`` / ``skipped_steps`` report skips without a sync.

    Host syncs per iteration: one per ``step()`` (reading its skip decision, as torch's for
    ordinary optimizers), fused optimizers included, so that frameworks see every skipped step;
    none for fused optimizers (``fused=True`` Adam, AdamW, SGD, ...) on a GPU with
    ``device_side_skip=True``, which receive ``grad_scale`` and ``found_inf`` and skip on the
    device; none in ``scale``, ``unscale_`` and ``update()``. A skipped ``step()`` does not
    call the optimizer's ``step``: parameters and optimizer state are untouched, and ``.grad``
    holds the unscaled gradients (with their non-finite entries), as with torch's; a skipped
    device-side fused step leaves them scaled (the kernel unscales as it applies), as with
    torch's. A fused optimizer decided on the host is unscaled in the check and stepped as an
    ordinary one (see :func:`~lossscale.torch._engine.device_decides`).

    Device work per iteration: the check kernel (one per (device, dtype) group); the rule runs
    on the host after the step's read of the flag, or on the device after device-side fused
    steps (about six tiny kernels). torch's private members that code written for its scaler
    reads are here too, with torch's meaning (:class:`~lossscale.torch._compat.TorchSurface`).

    Args:
      device: where the scale lives: ``"cuda"`` (the default), ``"cpu"``, ... With
        ``"cuda"`` and no CUDA, the scaler disables itself with a warning (as torch's). The
        state moves to the device of the first tensor ``scale()`` sees if that differs (e.g.
        ``cuda:1``) and no step was taken yet.
      init_scale: the initial scale: finite, > 0, at most ``max_loss_scale``.
      growth_factor: greater than 1; the scale is multiplied by it after ``growth_interval``
        consecutive finite iterations.
      backoff_factor: in (0, 1); the scale is multiplied by it on an overflow.
      growth_interval: int ≥ 1.
      enabled: bool. False: every method is a pass-through (``scale`` returns its input,
        ``step`` calls ``optimizer.step``), no tensors, checks or syncs; ``state_dict()`` is
        ``{}``.
      min_loss_scale: the floor of back-offs (keyword-only; default 1.0, TensorFlow's floor).
      max_loss_scale: growth beyond it is refused (default: the largest float32).
      hysteresis: back off on the ``hysteresis``-th overflow since the last change (default 1:
        at once, as torch's).
      hysteresis_refill: when that allowance refills: ``"on_backoff"`` (default), ``"on_growth"``
        or ``"on_finite_step"`` (see :class:`lossscale.core.DynamicRule`).
      stall_steps, on_stall: the stall alarm (see :func:`lossscale.core.stall_alarm`): after
        ``stall_steps`` consecutive skipped iterations at ``min_loss_scale`` (default 1000),
        warn once or raise; None turns it off. Checked with the count read in the step's own
        sync (no extra one), or where the scale is read on the host (``get_scale``,
        ``state_dict``) after fused steps.
      process_group: the ``torch.distributed`` group whose ranks must agree (default: the
        default group when torch.distributed is initialised). Each optimizer's non-finite flag
        is ``MAX``-all-reduced in ``unscale_`` (or ``step``), before any rank applies a step, so
        every rank skips together and holds the same scale.
      device_side_skip: bool (default False). True: fused optimizers on a GPU skip in their
        kernel with no host sync, and their ``step`` is called on skipped steps too, so
        frameworks that watch ``optimizer.step`` (Accelerate's ``step_was_skipped``, hence the
        HF Trainer's scheduler) cannot see the skip; read ``last_step_applied`` instead. No
        effect on the CPU or on unfused optimizers.

    Raises:
      TypeError / ValueError: an argument of the wrong type or out of range, naming it.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = v.FLOAT32_MAX,
        hysteresis: int = 1,
        hysteresis_refill: str = "on_backoff",
        stall_steps: int | None = DEFAULT_STALL_STEPS,
        on_stall: str = "warn",
        process_group: Any = None,
        device_side_skip: bool = False,
    ) -> None:
        v.boolean("enabled", enabled)
        v.boolean("device_side_skip", device_side_skip)
        self._check_factor_order(growth_factor, backoff_factor)
        if not isinstance(device, str | torch.device):
            raise TypeError(f"device must be a str or torch.device, got {device!r}")
        try:
            place = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device={device!r} is not a device: {error}") from None
        settings = scale_settings(
            True,
            init_scale,
            growth_interval,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            hysteresis_refill=hysteresis_refill,
            multiplier=growth_factor,
            backoff_factor=v.real("backoff_factor", backoff_factor),  # torch's: a number
            names=_NAMES,
        )
        rule, scale = settings.rule, settings.initial_scale
        assert rule is not None  # dynamic=True
        alarm = stall_alarm(stall_steps, on_stall)
        engine.check_process_group(process_group)

        self._device = place.type  # torch's GradScaler keeps the device type string
        self._enabled = enabled
        if enabled and place.type == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                f"lossscale.torch.{type(self).__name__} is enabled, but CUDA is not available. "
                "Disabling.",
                UserWarning,
                stacklevel=2,
            )
            self._enabled = False
        self._rule = rule
        self._init_scale = scale
        self._process_group = process_group
        self._device_skip = device_side_skip
        self._stepped = False  # any step/unscale_/update since construction (pins the device)
        self._steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, Step] = (
            weakref.WeakKeyDictionary()
        )
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(
            _fresh_optimizer_state
        )
        self._ls: DynamicScale | DisabledScale = DisabledScale(torch.device("cpu"))
        if self._enabled:
            self._ls = DynamicScale(rule, scale, place, alarm, type(self).__name__)

    #: The constructor's positional order, named in the error for swapped factors.
    _SIGNATURE = (
        "GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)"
    )
    _ORDER = "growth_factor before backoff_factor (torch.amp.GradScaler's order)"
    _OTHER = "ShardedGradScaler"

    @classmethod
    def _check_factor_order(cls, growth_factor: Any, backoff_factor: Any) -> None:
        """A ValueError naming the argument order when the factors look swapped (growth in
        (0, 1), back-off > 1): the other scaler's positional order."""
        numbers = v.is_real_number(growth_factor) and v.is_real_number(backoff_factor)
        if numbers and 0 < growth_factor < 1 < backoff_factor:
            raise ValueError(
                f"growth_factor={growth_factor!r} and backoff_factor={backoff_factor!r} look "
                f"swapped: {cls._SIGNATURE} takes {cls._ORDER}, the reverse of "
                f"{cls._OTHER}'s; pass them by keyword (growth_factor > 1, 0 < backoff_factor "
                "< 1)"
            )

    # -- lossscale's own --------------------------------------------------------------------
    @property
    def last_step_applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last ``update()``'s iteration applied its steps (every
        optimizer's gradients finite). No sync. Always True when disabled."""
        return self._ls.applied

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-d int64 tensor: iterations (``update()`` calls) that found a non-finite gradient
        and skipped. No sync. Always 0 when disabled."""
        return self._ls.skipped

    def read_last_step_applied(self) -> bool:
        """:attr:`last_step_applied` as a Python bool: free after an iteration whose decisions
        were read on the host (the default); one host sync after a fused optimizer's
        device-side step on a GPU (``device_side_skip=True``). True when disabled."""
        return applied_now(self._ls)

    def current_loss_scale(self) -> torch.Tensor:
        """The scale ``scale()`` multiplies by now: the 0-d float32 tensor itself, on the
        scaler's device (no sync, no copy: read it before the next ``update()``); a new 0-d 1.0
        when disabled. With :meth:`read_last_step_applied`, what
        :class:`lossscale.torch.ScaleReader` reads."""
        return self._ls.scale

    def step_scheduler(self, scheduler: Any) -> bool:
        """Step an LR ``scheduler`` (anything with ``step()``) only if the last iteration's
        steps were applied; return whether it stepped. Call it after ``update()``, where you
        would call ``scheduler.step()``; the same method as ``LossScaleOptimizer``'s.

        Keeps schedules from advancing on skipped steps. Costs what
        :meth:`read_last_step_applied` costs (nothing by default). Disabled: always steps.
        """
        applied = self.read_last_step_applied()
        if applied:
            scheduler.step()
        return applied

    @property
    def process_group(self) -> Any:
        """The group given to the constructor."""
        return self._process_group

    # -- torch.amp.GradScaler's interface ---------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor, or a list/tuple/dict of them, nested) by the scale.

        Returns new tensors (float16/bfloat16 ones as float32, see the class docstring); the
        same structure for containers. Disabled: ``outputs`` unchanged. One multiply kernel
        per tensor, no sync.

        Raises:
          TypeError: ``outputs`` holds something that is not a tensor.
        """
        ls = self._ls
        if isinstance(ls, DisabledScale):
            return outputs

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                moves = value.device != ls.device and value.device.type == ls.device.type
                if moves and not self._stepped:
                    ls.move_to(value.device)  # e.g. cuda:1 in a DDP process
                return engine.scale_tensor(value, ls.scale)
            if isinstance(value, Mapping):
                return type(value)({k: apply(x) for k, x in value.items()})  # type: ignore[call-arg]
            if isinstance(value, list | tuple):
                items = [apply(x) for x in value]
                if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
                    return type(value)(*items)
                return type(value)(items)
            raise TypeError(
                f"outputs must be a tensor or a (nested) list, tuple or dict of tensors, got "
                f"{value!r}"
            )

        return apply(outputs)

    def _state_of(self, optimizer: Any) -> dict[str, Any]:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        return self._per_optimizer_states[id(optimizer)]

    def _step_of(self, optimizer: torch.optim.Optimizer) -> Step:
        step = self._steps.get(optimizer)
        if step is None:
            where = type(self).__name__
            step = Step(optimizer, self._ls, self._process_group, self._device_skip, where)
            self._steps[optimizer] = step
        return step

    #: Whether an optimizer none of whose parameters has a gradient is checked as finite (and
    #: still takes part in the agreement) instead of raising: ``ShardedGradScaler``'s, as
    #: torch's, for ranks that hold no shard of an optimizer's parameters.
    _checks_without_gradients = False

    def _record_check(self, optimizer: torch.optim.Optimizer, step: Step, found: Any) -> None:
        """Agree on ``found`` across ranks and record it as the optimizer's
        ``found_inf_per_device``.

        Raises:
          RuntimeError: none of ``optimizer``'s parameters has a gradient (unless
            :attr:`_checks_without_gradients`).
        """
        if not step.grads.any_grad and not self._checks_without_gradients:
            raise RuntimeError(
                "No inf checks were recorded for this optimizer: none of its parameters has a "
                "gradient. Call scaler.scale(loss).backward() before scaler.step(optimizer) "
                "(or unscale_)."
            )
        self._stepped = True
        state = self._per_optimizer_states[id(optimizer)]
        readable, state["found_agreed"] = self._agree_found(step, found)
        state["found_inf_per_device"] = {step.ls.device: readable}

    def _agree_found(self, step: Step, found: torch.Tensor) -> tuple[Any, Any]:
        """The flag ``_found_inf_per_device`` shows and the flag agreed over the process group
        (None: no group). ``GradScaler``: this rank's own flag (torch's ``GradScaler``'s
        meaning), the agreement a ``MAX`` all-reduce of a copy."""
        agree = step.agreement_group() is not None
        return found, step.agree(found.clone()) if agree else None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and check them (e.g. before
        ``clip_grad_norm_``); ``step`` then reuses the check.

        Once per optimizer per iteration: a second call before ``update()`` raises, as torch's
        does, so gradients are never unscaled twice. With a process group the non-finite flag
        is all-reduced here. One fused kernel per (device, dtype) group; no sync. Disabled: a
        no-op.

        Raises:
          RuntimeError: called twice for ``optimizer`` before ``update()``, or after ``step``;
            no parameter of ``optimizer`` has a gradient.
        """
        if isinstance(self._ls, DisabledScale):
            return
        state = self._state_of(optimizer)
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        step = self._step_of(optimizer)
        with torch.no_grad():
            self._record_check(optimizer, step, step.check(unscale=True))
        state["stage"] = OptState.UNSCALED

    def _found(self, state: dict[str, Any]) -> torch.Tensor:
        """The optimizer's decision flag: ``found_inf_per_device`` as it holds it now (read at
        use: code written for torch's scaler may all-reduce those tensors in place before
        ``step``), combined with the agreed flag (one ``clamp``: the maximum of both, at most
        1.0, so a user's ``SUM`` of flags still reads as a skip in a fused kernel)."""
        ls = self._ls
        founds: list[torch.Tensor] = list(state["found_inf_per_device"].values())
        found = founds[0].to(ls.device, non_blocking=True)
        for other in founds[1:]:
            found = torch.maximum(found, other.to(ls.device, non_blocking=True))
        agreed = state.get("found_agreed")
        if agreed is not None:
            found = torch.clamp(found, min=agreed, max=engine.one(ls.device))
        return found

    def _decision(self, state: dict[str, Any]) -> torch.Tensor:
        """The flag ``step`` decided on (kept as ``"found_agreed"``), else :meth:`_found`."""
        if state["stage"] is OptState.STEPPED and state["found_agreed"] is not None:
            return cast(torch.Tensor, state["found_agreed"])
        return self._found(state)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` did), check, and call ``optimizer.step(*args,
        **kwargs)`` only if every gradient is finite; return its result, or None when skipped.

        One host sync reads the decision, for every optimizer by default, so a skipped step
        never calls ``optimizer.step`` (what Accelerate, the HF Trainer and timm watch). With
        ``device_side_skip=True``, fused optimizers (``_step_supports_amp_scaling``) on a GPU
        are always stepped, with ``optimizer.grad_scale`` (the scale, when not unscaled yet)
        and ``optimizer.found_inf`` set for the call: their kernel unscales and skips on the
        device (no sync; their ``.grad`` stays scaled unless ``unscale_`` ran, as with
        torch's). Disabled: ``optimizer.step(*args, **kwargs)``.

        Raises:
          RuntimeError: a ``closure`` keyword (not supported, as torch's), a second ``step``
            for ``optimizer`` before ``update()``, or no gradient on any of its parameters.
        """
        if isinstance(self._ls, DisabledScale):
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._state_of(optimizer)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        step = self._step_of(optimizer)
        unscaled = True
        if state["stage"] is OptState.READY:
            with torch.no_grad():
                found, unscaled = step.prepare()
                self._record_check(optimizer, step, found)
        state["found_agreed"] = found = self._found(state)  # the decision, for update()
        result, applied = step.apply(found, unscaled, *args, **kwargs)
        state["found_host"] = None if applied is None else not applied
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: advance the scale by the rule with every optimizer's check (an
        overflow in any of them backs off once), or set ``new_scale``.

        ``new_scale``: a number or a one-element float tensor, finite, > 0 and at most
        ``max_loss_scale`` (a tensor is read: one host sync); the growth counter is kept, as
        torch's. No sync otherwise: when every checked optimizer's decision was read on the host
        (the default), the rule runs on the host with no device work (one fill when the scale
        changes); after a device-side fused step (``device_side_skip=True`` on a GPU) it runs
        on the device in about six tiny kernels. Disabled: a no-op.

        Raises:
          RuntimeError: no optimizer was checked (``step``/``unscale_``) in this iteration.
          TypeError / ValueError: a bad ``new_scale``; nothing changes.
        """
        ls = self._ls
        if isinstance(ls, DisabledScale):
            return
        if new_scale is not None:
            ls.set_scale(self._new_scale(new_scale))
            self._per_optimizer_states.clear()
            return
        checked = [s for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        if not checked:
            raise RuntimeError(
                "GradScaler.update() found no checked gradients in this iteration: call "
                "scaler.step(optimizer) (or unscale_) after scaler.scale(loss).backward()"
            )
        if all(s["found_host"] is not None for s in checked):
            # every decision was read on the host: the rule runs there (no device work)
            ls.record_host(not any(s["found_host"] for s in checked))
            ls.check_stall()
        else:
            founds = [self._decision(s) for s in checked]
            found = founds[0]
            for other in founds[1:]:
                found = torch.maximum(found, other)
            ls.record_device(found)
        self._stepped = True
        self._per_optimizer_states.clear()

    def _new_scale(self, new_scale: Any) -> float:
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or not new_scale.is_floating_point():
                raise TypeError(
                    f"new_scale must be a number or a one-element float tensor, got {new_scale!r}"
                )
            value = float(new_scale.detach().reshape(()).item())
        else:
            value = v.real("new_scale", new_scale)
        return v.scale_at_most("new_scale", value, self._rule.max_loss_scale, "max_loss_scale")

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync on a GPU); 1.0 when disabled. Also
        runs the stall alarm's check."""
        ls = self._ls
        return 1.0 if isinstance(ls, DisabledScale) else ls.read()[0]

    def is_enabled(self) -> bool:
        """Whether the scaler is enabled (False also when ``device="cuda"`` had no CUDA)."""
        return self._enabled
