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
from lossscale.core._checkpoint import read_dynamic_state, scale_state_dict
from lossscale.core._rule import dynamic_rule
from lossscale.core._settings import ScaleSettings
from lossscale.core._stall import DEFAULT_STALL_STEPS, stall_alarm
from lossscale.torch import _engine as engine

#: Argument names of the core rule, as this class calls them.
_NAMES = {"increment_period": "growth_interval", "multiplier": "growth_factor"}
#: The extra key of this class's state dict (torch's GradScaler ignores it when loading).
_OWN_KEY = "lossscale"


def _fresh_optimizer_state() -> dict[str, Any]:
    """One optimizer's place in the current iteration, in torch's layout (code written for
    ``torch.amp.GradScaler`` reads ``"stage"`` and ``"found_inf_per_device"``): ``"stage"`` is
    torch's own ``OptState``; ``"found_inf_per_device"`` maps the scale's device to the
    optimizer's agreed non-finite flag (one entry: every gradient device's flag is combined
    there); ``"found_host"`` is that flag as ``step`` read it on the host (None: not read)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}, "found_host": None}


class GradScaler:
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

    Device work per iteration: the check kernel (one per (device, dtype) group) and the flag's
    allocation; the rule then runs on the host after the step's read of the flag (the scale is
    refilled only when it changes). After device-side fused steps the rule stays on the device:
    torch's update kernel, the floor and four ops for the skipped and stall counts. Measured
    side by side with torch's in ``_opcount_test.py``: 4 ops + 1 sync / 10 ops + 0 syncs
    (torch's: 10 + 1 / 10 + 0), and 4 ops for fused optimizers on the CPU.

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
        stall_steps: int | None = DEFAULT_STALL_STEPS,
        on_stall: str = "warn",
        process_group: Any = None,
        device_side_skip: bool = False,
    ) -> None:
        v.boolean("enabled", enabled)
        v.boolean("device_side_skip", device_side_skip)
        if not isinstance(device, str | torch.device):
            raise TypeError(f"device must be a str or torch.device, got {device!r}")
        try:
            place = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device={device!r} is not a device: {error}") from None
        rule = dynamic_rule(
            growth_interval,
            growth_factor,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            backoff_factor=backoff_factor,
            names=_NAMES,
        )
        scale = v.positive_float32("init_scale", init_scale)
        if v.as_float32(scale) > v.as_float32(rule.max_loss_scale):
            raise ValueError(f"init_scale={init_scale!r} exceeds max_loss_scale={max_loss_scale!r}")
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
        self._ls: engine.ScaleState | None = None
        self._stepped = False  # any step/unscale_/update since construction (pins the device)
        self._groups: weakref.WeakKeyDictionary[torch.optim.Optimizer, engine.GradGroups] = (
            weakref.WeakKeyDictionary()
        )
        self._per_optimizer_states: defaultdict[int, dict[str, Any]] = defaultdict(
            _fresh_optimizer_state
        )
        if self._enabled:
            self._ls = engine.ScaleState(
                ScaleSettings(True, scale, rule), place, alarm, type(self).__name__
            )

    # -- lossscale's own --------------------------------------------------------------------
    @property
    def last_step_applied(self) -> torch.Tensor:
        """0-d bool tensor: whether the last ``update()``'s iteration applied its steps (every
        optimizer's gradients finite). No sync. Always True when disabled."""
        if self._ls is None:
            return torch.ones((), dtype=torch.bool)
        return self._ls.applied

    @property
    def skipped_steps(self) -> torch.Tensor:
        """0-d int64 tensor: iterations (``update()`` calls) that found a non-finite gradient
        and skipped. No sync. Always 0 when disabled."""
        if self._ls is None:
            return torch.zeros((), dtype=torch.int64)
        return self._ls.skipped

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
        if self._ls is None:
            return outputs
        ls = self._ls

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

    def _groups_of(self, optimizer: torch.optim.Optimizer) -> engine.GradGroups:
        groups = self._groups.get(optimizer)
        if groups is None:
            groups = self._groups[optimizer] = engine.GradGroups()
        return groups

    def _check(self, optimizer: torch.optim.Optimizer, unscale: bool) -> torch.Tensor:
        """Check (and unscale) ``optimizer``'s gradients, agreed across ranks; the flag is
        recorded as the optimizer's ``found_inf_per_device``.

        Raises:
          RuntimeError: none of ``optimizer``'s parameters has a gradient.
        """
        ls = cast(engine.ScaleState, self._ls)
        groups = self._groups_of(optimizer)
        if unscale:
            found = engine.unscale_and_check(groups, optimizer.param_groups, ls)
        else:
            found = engine.check_and_unscale(groups, optimizer.param_groups, None, ls.device)
        if not groups.any_grad:
            raise RuntimeError(
                "No inf checks were recorded for this optimizer: none of its parameters has a "
                "gradient. Call scaler.scale(loss).backward() before scaler.step(optimizer) "
                "(or unscale_)."
            )
        self._stepped = True
        found = engine.agree(found, [engine.resolve_group(self._process_group)])
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {ls.device: found}
        return found

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
        if self._ls is None:
            return
        state = self._state_of(optimizer)
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._check(optimizer, unscale=True)
        state["stage"] = OptState.UNSCALED

    def _found(self, state: dict[str, Any]) -> torch.Tensor:
        """The optimizer's flag as ``found_inf_per_device`` holds it now (read at use: code
        written for torch's scaler may all-reduce those tensors in place before ``step``)."""
        ls = cast(engine.ScaleState, self._ls)
        founds: list[torch.Tensor] = list(state["found_inf_per_device"].values())
        found = founds[0].to(ls.device, non_blocking=True)
        for other in founds[1:]:
            found = torch.maximum(found, other.to(ls.device, non_blocking=True))
        return found

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
        if self._ls is None:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._state_of(optimizer)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        ls = self._ls
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and engine.device_decides(ls.device, self._device_skip):
            if state["stage"] is OptState.READY and ls.may_drop_below_one:
                self.unscale_(optimizer)  # a scale < 1 must not be unscaled inside the kernel
            grad_scale = getattr(optimizer, "grad_scale", None)
            if state["stage"] is OptState.READY:
                self._check(optimizer, unscale=False)
                grad_scale = ls.scale if grad_scale is None else ls.scale * grad_scale
            found = self._found(state)
            result = engine.fused_step(optimizer, grad_scale, found, *args, **kwargs)
            state["stage"] = OptState.STEPPED
            return result
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        state["found_host"] = bool(self._found(state).item())  # the one sync
        result = None
        if not state["found_host"]:
            result = optimizer.step(*args, **kwargs)
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
        if self._ls is None:
            return
        ls = self._ls
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
            ls.check_stall(stacklevel=2)
        else:
            found = self._found(checked[0])
            for other in checked[1:]:
                found = torch.maximum(found, self._found(other))
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
        v.positive_float32("new_scale", value)
        if v.as_float32(value) > v.as_float32(self._rule.max_loss_scale):
            raise ValueError(
                f"new_scale={value!r} exceeds max_loss_scale={self._rule.max_loss_scale!r}"
            )
        return value

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync on a GPU); 1.0 when disabled. Also
        runs the stall alarm's check."""
        if self._ls is None:
            return 1.0
        return self._ls.read(stacklevel=2)[0]  # free after ordinary steps

    def _set_rule(self, **change: Any) -> None:
        rule = self._rule
        values = {
            "increment_period": rule.increment_period,
            "multiplier": rule.multiplier,
            "backoff_factor": rule.backoff_factor,
            **change,
        }
        self._rule = dynamic_rule(
            values["increment_period"],
            values["multiplier"],
            min_loss_scale=rule.min_loss_scale,
            max_loss_scale=rule.max_loss_scale,
            hysteresis=rule.hysteresis,
            backoff_factor=values["backoff_factor"],
            names=_NAMES,
        )
        if self._ls is not None:
            self._ls.set_rule(self._rule)

    def get_growth_factor(self) -> float:
        """The growth factor (a Python float)."""
        return self._rule.multiplier

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated: > 1; ValueError otherwise, nothing changes)."""
        self._set_rule(multiplier=new_factor)

    def get_backoff_factor(self) -> float:
        """The back-off factor (a Python float)."""
        return cast(float, self._rule.backoff_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the back-off factor (validated: in (0, 1))."""
        self._set_rule(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval (a Python int)."""
        return self._rule.increment_period

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated: an int ≥ 1). A growth counter at or above the
        new interval grows on the next finite iteration (torch's would never grow again)."""
        self._set_rule(increment_period=new_interval)

    def _get_growth_tracker(self) -> int:
        """The growth counter (torch's private accessor; a host sync on a GPU)."""
        return 0 if self._ls is None else self._ls.good_steps()

    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        """torch's private initialiser, which Accelerate calls after loading a scaler state
        under FSDP2. The state here is created eagerly, so this only moves it to ``dev`` when
        no step was taken yet (no sync)."""
        if self._ls is not None and not self._stepped:
            place = torch.device(dev)
            if place != self._ls.device and place.type == self._ls.device.type:
                self._ls.move_to(place)

    def is_enabled(self) -> bool:
        """Whether the scaler is enabled (False also when ``device="cuda"`` had no CUDA)."""
        return self._enabled

    # -- torch's private surface (compatibility; prefer last_step_applied / skipped_steps) -----
    @property
    def _scale(self) -> torch.Tensor | None:
        """torch's ``_scale``: the current scale, a 0-d float32 tensor on the scaler's device
        (None when disabled). Read-only compatibility surface; no sync."""
        return None if self._ls is None else self._ls.scale

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """torch's ``_growth_tracker``: consecutive finite iterations, a 0-d int32 tensor on
        the scaler's device (None when disabled). Read-only; a new tensor per read after
        host-decided steps (one fill, no sync)."""
        return None if self._ls is None else self._ls.good_steps_tensor()

    def _get_scale_async(self) -> torch.Tensor | None:
        """torch's ``_get_scale_async``: :attr:`_scale` (no sync)."""
        return self._scale

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's ``_found_inf_per_device``: after ``unscale_(optimizer)`` (or
        ``_check_inf_per_device``), ``{device: flag}`` with the optimizer's non-finite flag
        (0-d float32, 1.0 when a gradient was not finite) on the scaler's device; ``{}``
        before. ``step`` reads these very tensors, so an in-place ``MAX`` all-reduce of them
        before ``step`` decides the step (an idempotent second agreement when
        ``process_group`` already agreed). No sync."""
        return cast(dict[Any, torch.Tensor], self._state_of(optimizer)["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's ``_check_inf_per_device``: check ``optimizer``'s gradients without
        unscaling them, record and return :meth:`_found_inf_per_device`. The stage is not
        changed. One check kernel per (device, dtype) group; no sync.

        Raises:
          RuntimeError: disabled (torch's asserts), or no parameter has a gradient.
        """
        if self._ls is None:
            raise RuntimeError("_check_inf_per_device needs an enabled scaler")
        self._state_of(optimizer)
        self._check(optimizer, unscale=False)
        return self._found_inf_per_device(optimizer)

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's keys — ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker`` — so that ``torch.amp.GradScaler.load_state_dict`` reads it, plus
        ``'lossscale'``: the hysteresis counter and ``skipped_steps`` (torch's ignores it).
        ``{}`` when disabled, as torch's. Reads the state: a host sync on a GPU."""
        if self._ls is None:
            return {}
        scale, good, bad, skipped, _ = self._ls.read(stacklevel=2)
        return {
            "scale": scale,
            "growth_factor": self._rule.multiplier,
            "backoff_factor": self._rule.backoff_factor,
            "growth_interval": self._rule.increment_period,
            "_growth_tracker": good,
            _OWN_KEY: {
                "version": 1,
                "nonfinite_steps": bad,
                "skipped_steps": skipped,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by this class or by ``torch.amp.GradScaler``: the scale, the
        growth counter and the three factors (as torch's does); the hysteresis counter and
        ``skipped_steps`` when present. Everything is checked before anything changes.
        Disabled: a no-op (as torch's).

        Raises:
          ValueError: the empty state of a disabled scaler, a missing key or a bad value
            (naming it), or a scale above this scaler's ``max_loss_scale``.
        """
        if self._ls is None:
            return
        sd = engine.read_grad_scaler_state(state_dict)
        rule = dynamic_rule(
            sd.growth_interval,
            sd.growth_factor,
            min_loss_scale=self._rule.min_loss_scale,
            max_loss_scale=self._rule.max_loss_scale,
            hysteresis=self._rule.hysteresis,
            backoff_factor=sd.backoff_factor,
            names={key: f"state_dict[{name!r}]" for key, name in _NAMES.items()},
        )
        own = state_dict.get(_OWN_KEY, {})
        bad, skipped = own.get("nonfinite_steps", 0), own.get("skipped_steps", None)
        good = min(sd.growth_tracker, rule.increment_period - 1)
        scale, good, bad = read_dynamic_state(scale_state_dict(sd.scale, (good, bad)), rule)
        if skipped is not None and (
            isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0
        ):
            raise ValueError(
                f"state_dict['lossscale']['skipped_steps'] must be an int >= 0, got {skipped!r}"
            )
        self._rule = rule
        self._ls.set_rule(rule)
        self._ls.load(scale, good, bad)
        if skipped is not None:
            self._ls.set_skipped(skipped)

    def __getstate__(self) -> dict[str, Any]:
        """Pickling (``copy.deepcopy``, spawning workers): between iterations only, as torch's;
        the per-optimizer gradient groups are rebuilt on the next step."""
        if any(s["found_inf_per_device"] for s in self._per_optimizer_states.values()):
            raise RuntimeError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, "
                "or at the end after scaler.update()."
            )
        state = dict(self.__dict__)
        del state["_groups"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._groups = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={self._device!r}, enabled={self._enabled}, "
            f"growth_factor={self._rule.multiplier}, backoff_factor={self._rule.backoff_factor}, "
            f"growth_interval={self._rule.increment_period}, "
            f"min_loss_scale={self._rule.min_loss_scale})"
        )
