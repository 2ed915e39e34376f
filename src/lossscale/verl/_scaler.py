"""The scaler verl's FSDP engine builds: lossscale's ``ShardedGradScaler``, also an instance of
torch's (verl's tests check ``isinstance(engine.scaler, ShardedGradScaler)``), and how it is
built from verl's arguments and the environment."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import sharded_grad_scaler as torch_sharded

from lossscale.torch import ShardedGradScaler as LossscaleShardedGradScaler
from lossscale.verl import _settings

__all__ = ["ShardedGradScaler", "scaler_factory"]


class _Absent:
    """A class attribute that reads as missing (``AttributeError``), so that a private helper
    of torch's scaler, which works on torch's own state, is not inherited."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        raise AttributeError(f"lossscale.verl.ShardedGradScaler has no {self._name!r}")


class ShardedGradScaler(  # type: ignore[misc,override]  # both bases define torch's interface
    LossscaleShardedGradScaler, torch_sharded.ShardedGradScaler
):
    """:class:`lossscale.torch.ShardedGradScaler`, and an instance of
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` too.

    Every method, the constructor (torch's positional order, then lossscale's keyword-only
    settings), the checkpoints and the behaviour on a skipped step are lossscale's: torch's
    class is a base only for ``isinstance``. Its constructor never runs, and the private
    helpers it has and lossscale's class lacks (``_unscale_grads_``, ``_maybe_opt_step``, ...)
    read as missing here, as on lossscale's class.

    >>> import torch
    >>> from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as Torch
    >>> from lossscale.verl import ShardedGradScaler
    >>> scaler = ShardedGradScaler("cpu", growth_interval=400)
    >>> isinstance(scaler, Torch), scaler.get_growth_interval(), hasattr(scaler, "_unscale_grads_")
    (True, 400, False)
    """


def _hide_torch_internals() -> None:
    own = {name for klass in LossscaleShardedGradScaler.__mro__ for name in vars(klass)}
    for klass in torch_sharded.ShardedGradScaler.__mro__[:-1]:
        for name, value in vars(klass).items():
            if name not in own and callable(value) and not name.startswith("__"):
                absent = _Absent()
                absent.__set_name__(ShardedGradScaler, name)
                setattr(ShardedGradScaler, name, absent)
                own.add(name)


_hide_torch_internals()

#: torch's ``ShardedGradScaler`` constructor, whose arguments verl passes.
_TORCH_SIGNATURE = inspect.signature(torch_sharded.ShardedGradScaler.__init__)


def scaler_factory(settings: _settings.Settings, device: str) -> Callable[..., ShardedGradScaler]:
    """A stand-in for torch's ``ShardedGradScaler`` class while verl builds its engine: called
    with torch's arguments (verl 0.9 passes ``growth_interval=400``), it returns a
    :class:`ShardedGradScaler` with those arguments, the environment's settings over them
    (``settings.scaler``), and ``device`` when verl names none (torch's default, ``"cuda"``,
    disables the scaler on any other device).

    The returned callable raises ``TypeError`` for arguments torch's constructor would refuse,
    and ``ValueError`` naming the environment variable whose value the scaler refuses.
    """

    def build(*args: Any, **kwargs: Any) -> ShardedGradScaler:
        bound = _TORCH_SIGNATURE.bind(None, *args, **kwargs).arguments
        bound.pop("self")
        bound.setdefault("device", device)
        return checked(settings, **bound)

    return build


def checked(settings: _settings.Settings, **arguments: Any) -> ShardedGradScaler:
    """A :class:`ShardedGradScaler` from ``arguments`` with ``settings.scaler`` over them; a
    ``ValueError`` or ``TypeError`` the constructor raises for a setting from the environment
    is raised again naming its variable (and the value)."""
    merged = {**arguments, **settings.scaler}
    try:
        return ShardedGradScaler(**merged)
    except (TypeError, ValueError) as error:
        message = str(error)
        named = [
            f"{_settings.variable_of(key)}={value!r}"
            for key, value in settings.scaler.items()
            if key in message
        ]
        if not named:
            raise
        raise type(error)(f"{', '.join(named)}: {message}") from None


def verl_device() -> str:
    """verl's device name (``"cuda"``, ``"npu"``, or what its platform says)."""
    from verl.utils.device import get_device_name

    return str(get_device_name())


def is_float16(dtype: Any) -> bool:
    """Whether ``dtype`` is ``torch.float16``."""
    return bool(dtype == torch.float16)
