"""Facts about the machine and the library versions a benchmark ran on (no framework import)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from typing import Any

PACKAGES = ("lossscale", "numpy", "torch", "jax", "jaxlib", "optax", "jmp")


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has(flag: str) -> bool | None:
    """Whether the CPU reports ``flag`` (e.g. ``avx512_fp16``: float16 arithmetic in hardware;
    without it torch emulates float16 on the CPU). None where /proc/cpuinfo is not there."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split(":", 1)[1].split()
    except OSError:
        pass
    return None


def memory_gib() -> float | None:
    """Total RAM in GiB (Linux only; None elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def usable_cpus() -> int | None:
    """CPUs this process may run on (the affinity mask; ``os.cpu_count()`` elsewhere)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def versions() -> dict[str, str | None]:
    """Installed versions of lossscale and the libraries it is compared with (None: absent)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def facts() -> dict[str, Any]:
    """Everything above, plus the OS, Python and the date (UTC)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "memory_gib": memory_gib(),
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "load_average_at_start": load_average(),
        "versions": versions(),
    }
