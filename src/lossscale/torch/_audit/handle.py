"""Running chosen modules of a float16 model in float32: the float16 audit's plan, put on a
model and taken off again (:meth:`lossscale.torch.Float16Audit.apply`)."""

from __future__ import annotations

import difflib
import functools
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from lossscale.torch._audit.watch import upcast

__all__ = ["MODES", "PlanHandle", "check_mode", "find_modules", "keep_float32", "kept_by", "unwrap"]

#: How the audited run uses float16: ``torch.autocast`` over float32 parameters, or a model
#: whose parameters are float16 (``model.half()``, DeepSpeed's fp16 path).
MODES = ("autocast", "half")
_HALF = (torch.float16, torch.bfloat16)
#: The modules a live handle keeps in float32, each with that handle.
_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, PlanHandle] = weakref.WeakKeyDictionary()


def _first_floating(tree: Any) -> torch.Tensor | None:
    for x in tree_flatten(tree)[0]:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x
    return None


def _device_type(module: torch.nn.Module, inputs: Any) -> str:
    for t in (*module.parameters(), *module.buffers()):
        return t.device.type
    x = _first_floating(inputs)
    return "cpu" if x is None else x.device.type


class PlanHandle:
    """A plan put on a model: its modules run in float32 until :meth:`remove`.

    Each kept module runs with autocast disabled on its device and its floating inputs
    (positional and keyword, nested in tuples, lists and dicts) cast to float32. In
    ``"half"`` mode its parameters and buffers are float32 while the handle is live (the same
    ``Parameter`` objects, values exact) and its floating outputs are cast back to the dtype of
    its first floating input (the caller's), or to its parameters' earlier dtype when it has
    none. Parameter names, ``state_dict()`` keys and values, and the module's own hooks are
    unchanged (a forward pre-hook and a forward hook of its own do the work; the hooks a user
    registers see the caller's inputs and outputs). Use it as a context manager, or call
    :meth:`remove`. A copy of the model (``copy.deepcopy``, pickling) keeps running the plan;
    :meth:`remove` takes it off the model it was put on only.

    Example:
      >>> import torch
      >>> from lossscale.torch import audit
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
      >>> with torch.no_grad():
      ...     _ = model[0].weight.fill_(300.0)
      >>> result = audit(model, lambda m, x: m(x).float().sum(), [torch.full((2, 4), 100.0)])
      >>> x = torch.full((2, 4), 100.0)
      >>> with result.apply(model) as plan, torch.autocast("cpu", dtype=torch.float16):
      ...     bool(model(x).isfinite().all()), model[0](x).dtype
      (True, torch.float32)
      >>> plan
      PlanHandle(1 modules in float32, autocast, removed)

    Costs: per kept module and call, the casts of its inputs (and outputs in ``"half"``
    mode); no host sync.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        modules: tuple[str, ...],
        mode: str,
        output_dtype: torch.dtype | None = None,
    ) -> None:
        if output_dtype is not None and (
            not isinstance(output_dtype, torch.dtype) or not output_dtype.is_floating_point
        ):
            raise TypeError(f"output_dtype must be a floating torch.dtype, got {output_dtype!r}")
        self.modules = modules
        self.mode = mode
        self.output_dtype = output_dtype
        self._state = threading.local()
        self._hooks: list[Any] = []
        self._dtypes: list[tuple[torch.Tensor, torch.dtype]] = []
        self._kept: list[torch.nn.Module] = []
        found = dict(zip(find_modules(model, modules), modules, strict=True))  # once each
        if output_dtype is None:
            check_mode(model, mode)
        for module, name in found.items():
            if module in _KEPT:
                raise ValueError(
                    f"module {name!r} is already kept in float32 by another plan: remove that "
                    "handle first"
                )
        for module in found:
            self._keep(module)

    def _keep(self, module: torch.nn.Module) -> None:
        _KEPT[module] = self
        self._kept.append(module)
        own = None
        if self.mode == "half" and self.output_dtype is None:
            own = next((p.dtype for p in module.parameters() if p.dtype in _HALF), None)
            for t in (*module.parameters(), *module.buffers()):
                if t.dtype in _HALF:
                    self._dtypes.append((t, t.dtype))
                    t.data = t.data.float()
                    if t.grad is not None:
                        t.grad = t.grad.float()
        self._hooks.append(
            module.register_forward_pre_hook(self._enter, with_kwargs=True)  # last: user's first
        )
        self._hooks.append(
            module.register_forward_hook(
                functools.partial(self._exit, own), prepend=True, always_call=True
            )
        )

    def _stack(self) -> list[tuple[Any, torch.dtype | None]]:
        if not hasattr(self._state, "stack"):
            self._state.stack = []
        stack: list[tuple[Any, torch.dtype | None]] = self._state.stack
        return stack

    def _enter(self, module: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        x = _first_floating((args, kwargs))
        caller = x.dtype if x is not None and x.dtype in _HALF else None
        off = torch.autocast(_device_type(module, (args, kwargs)), enabled=False)
        off.__enter__()  # type: ignore[no-untyped-call]
        self._stack().append((off, caller))
        return upcast(args), upcast(kwargs)

    def _exit(self, own: torch.dtype | None, module: torch.nn.Module, args: Any, out: Any) -> Any:
        off, caller = self._stack().pop()
        off.__exit__(None, None, None)
        back = self.output_dtype or caller or own
        cast_back = self.mode == "half" or self.output_dtype is not None
        if not cast_back or back is None or out is None:
            return None

        def cast(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                return t.to(back)
            return t

        return tree_map(cast, out)

    def remove(self) -> None:
        """Take the plan off: the hooks go, and in ``"half"`` mode the parameters and buffers
        (and their ``.grad``) return to their earlier dtypes. A second call does nothing."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for t, dtype in self._dtypes:
            t.data = t.data.to(dtype)
            if t.grad is not None:
                t.grad = t.grad.to(dtype)
        self._dtypes.clear()
        for module in self._kept:
            if _KEPT.get(module) is self:
                del _KEPT[module]
        self._kept.clear()

    def __getstate__(self) -> dict[str, Any]:
        # a copy or pickle of the model carries its hooks, bound to a copy of this handle:
        # that copy keeps running the plan on the copied model and takes nothing off
        return {"modules": self.modules, "mode": self.mode, "output_dtype": self.output_dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._state = threading.local()
        self._hooks, self._dtypes, self._kept = [], [], []

    def __enter__(self) -> PlanHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        live = "live" if self._hooks else "removed"
        return f"PlanHandle({len(self.modules)} modules in float32, {self.mode}, {live})"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``DistributedDataParallel``, ``DataParallel``, ``torch.compile``'s
    wrapper and PEFT's ``PeftModel`` and tuner (``LoraModel``: the base model, its adapter
    layers in place), any nesting of them; ``model`` itself otherwise."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    peft = _peft_classes()
    while True:
        inner = getattr(model, "_orig_mod", None)
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            inner = model.module
        elif peft is not None and isinstance(model, peft[0]):
            inner = model.base_model
        elif peft is not None and isinstance(model, peft[1]):
            inner = model.model
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _peft_classes() -> tuple[type, type] | None:
    """``(PeftModel, BaseTuner)`` where PEFT is imported (a PEFT model exists only then),
    else None: PEFT is never imported here."""
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    return PeftModel, BaseTuner


#: What PEFT puts into module names: the prefix of a ``PeftModel``'s base model and the
#: wrapped layer inside an adapter layer (``lora.Linear``).
_PEFT_PREFIXES = ("base_model.model.", "base_model.")
_PEFT_LAYER = "base_layer"


def _canonical(name: str) -> str:
    """``name`` without PEFT's parts: the same for a module of the base model and of the
    PEFT model wrapping it."""
    for prefix in _PEFT_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return ".".join(part for part in name.split(".") if part != _PEFT_LAYER)


def find_modules(model: torch.nn.Module, names: Iterable[str]) -> list[torch.nn.Module]:
    """The modules of ``model`` that a plan's ``names`` name, seeing through the wrappers of
    :func:`unwrap`: a name of the audited model, or the same module's name in the base model
    or the PEFT model around it (PEFT's ``base_model.model.`` prefix and an adapter layer's
    ``base_layer`` left out on both sides; where a name matches none exactly, the outermost
    module of that PEFT-free name, so that a base model's ``down_proj`` is the adapter layer
    around it in the PEFT model, and the PEFT model's ``down_proj.base_layer`` the base
    model's ``down_proj``).

    Raises:
      ValueError: the model has no module of one of the names (the message names the
        closest one it has).
    """
    core = unwrap(model)
    own = dict(core.named_modules())
    canonical: dict[str, torch.nn.Module] = {}
    for name, module in own.items():  # parents first: the outermost module of each name
        canonical.setdefault(_canonical(name), module)
    found = []
    for name in names:
        module = next(
            (own[n] for n in (name, *_stripped(name)) if n in own),
            canonical.get(_canonical(name)),
        )
        if module is None:
            close = difflib.get_close_matches(name, [*own, *canonical], n=1, cutoff=0.0)
            closest = f"; the closest it has is {close[0]!r}" if close else ""
            raise ValueError(
                f"the plan keeps module {name!r}, which the model has not{closest} (the "
                "model's modules are named as in model.named_modules() of the audited model)"
            )
        found.append(module)
    return found


def _stripped(name: str) -> list[str]:
    return [name[len(p) :] for p in _PEFT_PREFIXES if name.startswith(p)]


def check_mode(model: torch.nn.Module, mode: str) -> None:
    """ValueError unless ``model``'s parameters are of ``mode``'s dtype: float32 (or float64)
    for ``"autocast"``, float16 or bfloat16 for ``"half"``, counted by elements over the
    floating parameters (a model without any passes).

    Raises:
      ValueError: the mode is not one of :data:`MODES`, or most of the model's parameter
        elements are of the other kind (naming the mode and the dtype).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    sizes: dict[torch.dtype, int] = {}
    for p in unwrap(model).parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if not sizes:
        return
    dtype = max(sizes, key=lambda d: sizes[d])
    if (mode == "half") == (dtype in _HALF):
        return
    fix = (
        "audit the float16 model with mode='half', or apply the plan to the float32 model "
        "under torch.autocast"
        if mode == "autocast"
        else "apply it to the model after model.half() (or audit the float32 model with "
        "mode='autocast')"
    )
    raise ValueError(
        f"the plan's mode is {mode!r}, but the model's parameters are {dtype} "
        f"({sizes[dtype]:,} of {sum(sizes.values()):,} elements): {fix}"
    )


def kept_by(module: torch.nn.Module) -> PlanHandle | None:
    """The live :class:`PlanHandle` that keeps ``module`` in float32, or None (host work
    only).

    Example:
      >>> import torch
      >>> from lossscale.torch import kept_by, load_plan
      >>> from lossscale.torch._audit.handle import keep_float32
      >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
      >>> with keep_float32(model, ["0"], "autocast") as handle:
      ...     kept_by(model[0]) is handle, kept_by(model[1])
      (True, None)
      >>> kept_by(model[0]) is None
      True
    """
    return _KEPT.get(module)


def keep_float32(
    model: torch.nn.Module,
    modules: Iterable[str],
    mode: str,
    *,
    output_dtype: torch.dtype | None = None,
) -> PlanHandle:
    """Run ``modules`` of ``model`` in float32 (see :class:`PlanHandle`); raises ``TypeError``
    for a model that is not a module or an ``output_dtype`` that is not a floating dtype, and
    ``ValueError`` for a name the model has not or a module another live handle keeps,
    changing nothing."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return PlanHandle(model, tuple(modules), mode, output_dtype)
