"""What importing ``lossscale.verl`` changes in verl: five methods of ``FSDPEngine``
(``verl/workers/engine/fsdp/transformer_impl.py``), wrapped, and nothing else.

* ``_build_fsdp_module``: while it runs, ``torch.distributed.fsdp.sharded_grad_scaler.
  ShardedGradScaler`` (which verl imports there, at call time) is a factory of
  :class:`lossscale.verl.ShardedGradScaler`: verl's arguments, the environment's settings over
  them, verl's device. Restored when the method returns (or raises); other code in the process
  sees torch's class.
* ``optimizer_step``: notes whether lossscale's scaler applied the step.
* ``lr_scheduler_step``: does not step verl's LR scheduler when none of the optimizer steps
  since its last step was applied (every one was skipped); returns the current LR, as verl does.
* ``save_checkpoint`` / ``load_checkpoint``: the scaler's ``state_dict`` is saved beside verl's
  ``extra_state`` (the LR scheduler and RNG states) as
  ``lossscale_scaler_world_size_{W}_rank_{R}.pt`` in the checkpoint folder, and restored from it,
  when verl saves and loads its extra state (``checkpoint.save_contents`` / ``load_contents``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.fsdp import sharded_grad_scaler as torch_sharded

from lossscale.verl import _plan, _settings
from lossscale.verl._scaler import ShardedGradScaler, checked, scaler_factory, verl_device

#: The verl releases this module patches: 0.9.x.
SUPPORTED = (0, 9)

#: The ``FSDPEngine`` methods wrapped.
METHODS = (
    "_build_fsdp_module",
    "optimizer_step",
    "lr_scheduler_step",
    "save_checkpoint",
    "load_checkpoint",
)

#: The arguments verl 0.9's ``_build_fsdp_module`` gives torch's scaler (checked on import).
VERL_ARGUMENTS = {"growth_interval": 400}

_APPLIED = "_lossscale_step_applied"  # an engine attribute: a step applied since the LR step
_originals: dict[str, Callable[..., Any]] = {}
_log = logging.getLogger("lossscale.verl")


def check_version(version: str) -> None:
    """``ImportError`` unless ``version`` (verl's ``__version__``) is a supported release."""
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    if major_minor != SUPPORTED:
        raise ImportError(
            f"lossscale.verl supports verl {SUPPORTED[0]}.{SUPPORTED[1]}.x, not verl {version}: "
            "it wraps FSDPEngine's _build_fsdp_module, optimizer_step, lr_scheduler_step, "
            "save_checkpoint and load_checkpoint as verl 0.9 writes them "
            '(pip install "verl>=0.9,<0.10")'
        )


def settings(environ: Mapping[str, str] | None = None) -> _settings.Settings:
    """lossscale's settings for verl from ``environ`` (default ``os.environ``), checked: a
    variable that is malformed, or whose value the scaler refuses with verl's other arguments
    (``growth_interval=400``, ``init_scale=2**16`` or the plan's, unless set), raises
    ``ValueError`` naming the variable and its value; so does a ``LOSSSCALE_PLAN`` that is not
    a plan file (:func:`lossscale.torch.load_plan`'s error, after the variable). No host sync;
    reads the plan file when one is named, builds one scaler on the CPU to check.

    Returns:
      :class:`lossscale.verl.Settings`: the scaler's keyword arguments that are set, the plan.

    >>> import lossscale.verl
    >>> lossscale.verl.settings({"LOSSSCALE_GROWTH_INTERVAL": "100", "LOSSSCALE_HYSTERESIS": ""})
    Settings(scaler={'growth_interval': 100}, plan=None)
    >>> lossscale.verl.settings({"LOSSSCALE_INIT_SCALE": "-8"})
    Traceback (most recent call last):
    ValueError: LOSSSCALE_INIT_SCALE=-8.0: init_scale must be finite and > 0, got -8.0
    """
    found = _settings.read(environ)
    arguments: dict[str, Any] = dict(VERL_ARGUMENTS)
    if found.plan is not None:
        initial = _plan.load(found.plan).initial_scale
        if initial is not None:
            arguments["init_scale"] = initial
    checked(found, device="cpu", **arguments)
    return found


def engine_class() -> type:
    """verl's ``FSDPEngine`` (importing its module)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    return FSDPEngine  # type: ignore[no-any-return]


def patch() -> None:
    """Wrap ``FSDPEngine``'s methods (see the module's docstring); a second call does nothing.
    Importing ``lossscale.verl`` calls it.

    >>> import lossscale.verl
    >>> lossscale.verl.unpatch(); lossscale.verl.is_patched()
    False
    >>> lossscale.verl.patch(); lossscale.verl.is_patched()
    True

    Raises:
      ImportError: verl is not 0.9.x, or ``FSDPEngine`` lacks a method it wraps.
      ValueError: an environment variable of lossscale's is malformed or out of range
        (naming it); nothing is patched then.
    """
    import verl

    check_version(str(getattr(verl, "__version__", "unknown")))
    settings()  # fail at import, in every worker
    if _originals:
        return
    engine = engine_class()
    missing = [name for name in METHODS if not callable(getattr(engine, name, None))]
    if missing:
        raise ImportError(f"lossscale.verl: verl's FSDPEngine has no {', '.join(missing)}")
    wrappers: dict[str, Callable[..., Any]] = {
        "_build_fsdp_module": _build_fsdp_module,
        "optimizer_step": _optimizer_step,
        "lr_scheduler_step": _lr_scheduler_step,
        "save_checkpoint": _save_checkpoint,
        "load_checkpoint": _load_checkpoint,
    }
    for name in METHODS:
        original = engine.__dict__[name]
        _originals[name] = original
        setattr(engine, name, functools.wraps(original)(wrappers[name]))


def unpatch() -> None:
    """Put verl's own methods back (engines built before keep the scaler they were given);
    :func:`patch` wraps them again.

    >>> import lossscale.verl
    >>> lossscale.verl.unpatch(); lossscale.verl.is_patched()
    False
    >>> lossscale.verl.patch()
    """
    engine = engine_class()
    for name, original in _originals.items():
        setattr(engine, name, original)
    _originals.clear()


def is_patched() -> bool:
    """Whether ``FSDPEngine``'s methods are lossscale's wrappers.

    >>> import lossscale.verl
    >>> lossscale.verl.is_patched()
    True
    """
    return bool(_originals)


@contextlib.contextmanager
def _torch_scaler_is(factory: Callable[..., Any]) -> Iterator[None]:
    saved = torch_sharded.ShardedGradScaler
    torch_sharded.ShardedGradScaler = factory  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch_sharded.ShardedGradScaler = saved  # type: ignore[misc]


def _ours(engine: Any) -> ShardedGradScaler | None:
    scaler = getattr(engine, "scaler", None)
    if isinstance(scaler, ShardedGradScaler) and scaler.is_enabled():
        return scaler
    return None


def _build_fsdp_module(self: Any, module: torch.nn.Module) -> Any:
    found = _settings.read()
    plan = _plan.for_engine(self, found.plan)
    if plan is not None and plan.initial_scale is not None and "init_scale" not in found.scaler:
        found = found._replace(scaler={**found.scaler, "init_scale": plan.initial_scale})
    with _torch_scaler_is(scaler_factory(found, verl_device())), _plan.sharded(self, module, plan):
        return _originals["_build_fsdp_module"](self, module)


def _optimizer_step(self: Any) -> Any:
    result = _originals["optimizer_step"](self)
    scaler = _ours(self)
    if scaler is not None and scaler.read_last_step_applied():
        setattr(self, _APPLIED, True)
    return result


def _lr_scheduler_step(self: Any) -> Any:
    scaler = _ours(self)
    if scaler is not None and not self.__dict__.pop(_APPLIED, False):
        _log.info("lossscale.verl: every optimizer step since the last LR step was skipped")
        return self.lr_scheduler.get_last_lr()[0]  # verl's return value: the LR, not stepped
    self.__dict__.pop(_APPLIED, None)
    return _originals["lr_scheduler_step"](self)


def checkpoint_file(local_path: str, world_size: int, rank: int) -> str:
    """Where lossscale's scaler state lies in a verl checkpoint folder (one file per rank, as
    verl's ``extra_state``).

    >>> import lossscale.verl
    >>> lossscale.verl.checkpoint_file("ckpt/global_step_10/actor", 8, 3)
    'ckpt/global_step_10/actor/lossscale_scaler_world_size_8_rank_3.pt'
    """
    return os.path.join(local_path, f"lossscale_scaler_world_size_{world_size}_rank_{rank}.pt")


def _here(local_path: str) -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return checkpoint_file(local_path, size, rank)


def _save_checkpoint(self: Any, local_path: str | None, *args: Any, **kwargs: Any) -> Any:
    result = _originals["save_checkpoint"](self, local_path, *args, **kwargs)
    scaler = _ours(self)
    if scaler is not None and local_path is not None and self.checkpoint_manager.should_save_extra:
        torch.save(scaler.state_dict(), _here(local_path))
    return result


def _load_checkpoint(self: Any, local_path: str | None, *args: Any, **kwargs: Any) -> Any:
    result = _originals["load_checkpoint"](self, local_path, *args, **kwargs)
    scaler = _ours(self)
    if scaler is None or local_path is None or not self.checkpoint_manager.should_load_extra:
        return result
    path = _here(local_path)
    if os.path.exists(path):
        scaler.load_state_dict(torch.load(path, weights_only=True))
    else:
        warnings.warn(
            f"lossscale.verl: {path} does not exist (a checkpoint saved without lossscale.verl): "
            f"the loss scale starts at {scaler.get_scale()}",
            UserWarning,
            stacklevel=2,
        )
    return result
