"""``TORCH_CUDA_ARCH_LIST`` for DeepSpeed's JIT op builder, set from the visible devices."""

from __future__ import annotations

import os
import re
import warnings

import torch

__all__ = ["set_cuda_arch_list"]

#: An entry DeepSpeed's op builder parses (``major.minor``, optionally ``+PTX``), and one with
#: an arch-specific suffix (``9.0a``, ``10.0a+PTX``) that it does not.
_PARSED = re.compile(r"^\d+\.\d+(\+PTX)?$")
_SUFFIXED = re.compile(r"^(?P<arch>\d+\.\d+)[a-z](?P<ptx>\+PTX)?$")


def set_cuda_arch_list() -> str | None:
    """Give ``TORCH_CUDA_ARCH_LIST`` a value DeepSpeed's op builder can parse: the compute
    capabilities of the visible CUDA devices (``"9.0"`` on an H100 or H200) when it is unset,
    or the user's value with each arch-specific entry (``9.0a``) written as its base
    (``9.0``); return the value in effect.

    DeepSpeed compiles its CUDA ops (``FusedAdam``, ``FusedLamb``...) on first use and parses
    each entry of the list with ``int()``: Hopper's arch-specific target ``9.0a``, which torch's
    recent CUDA builds accept and some environments set, fails there (``ValueError: invalid
    literal for int() with base 10: '0a'``, DeepSpeed issue #7589); ``9.0`` builds code that
    runs on the same devices. Call it before the first op is built: before
    ``deepspeed.initialize`` when its config names an optimizer DeepSpeed builds, or before
    creating ``FusedAdam`` yourself. :func:`lossscale.deepspeed.install` calls it too (for the
    ops built later).

    A value DeepSpeed parses is never changed. One it does not is rewritten, with a
    ``UserWarning`` naming the old and the new value; an entry it cannot rewrite either is left
    as it is (DeepSpeed then names it). Without a CUDA device and without a value, nothing is
    set.

    Returns:
      The value of ``TORCH_CUDA_ARCH_LIST`` now: the user's, the rewritten one, the devices'
      capabilities (``;``-separated, ascending, each once), or None when it is unset and no
      CUDA device is visible.

    Costs: initializes CUDA (``torch.cuda.get_device_capability``) when it reads the devices;
    no host sync, no allocation.

    Example:
      >>> import os
      >>> from lossscale.deepspeed import set_cuda_arch_list
      >>> os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"  # a value DeepSpeed parses stays
      >>> set_cuda_arch_list()
      '8.0;9.0'
      >>> del os.environ["TORCH_CUDA_ARCH_LIST"]
    """
    current = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if current is not None and current.strip():
        if parses(current):
            return current
        entries = [e.strip() for e in current.replace(" ", ";").split(";") if e.strip()]
        rewritten = ";".join(dict.fromkeys(_base(e) for e in entries))
        warnings.warn(
            f"TORCH_CUDA_ARCH_LIST={current!r} holds an entry DeepSpeed's op builder cannot "
            f"parse (it reads major.minor[+PTX] with int(); DeepSpeed issue #7589): set to "
            f"{rewritten!r}",
            UserWarning,
            stacklevel=2,
        )
        os.environ["TORCH_CUDA_ARCH_LIST"] = rewritten
        return rewritten
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    found = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    value = ";".join(f"{major}.{minor}" for major, minor in sorted(found))
    os.environ["TORCH_CUDA_ARCH_LIST"] = value
    return value


def _base(entry: str) -> str:
    """``entry`` without its arch-specific suffix (``9.0a`` -> ``9.0``), else unchanged."""
    m = _SUFFIXED.match(entry)
    return f"{m['arch']}{m['ptx'] or ''}" if m else entry


def parses(value: str) -> bool:
    """Whether DeepSpeed's op builder parses every entry of ``value`` (``;`` or blank
    separated ``major.minor[+PTX]``)."""
    entries = value.replace(" ", ";").split(";")
    return all(_PARSED.match(e.strip()) for e in entries if e.strip())
