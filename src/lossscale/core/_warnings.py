"""Warnings that name the user's line, however deep the library's call chain is."""

from __future__ import annotations

import sys
import warnings

#: Module-name prefixes whose frames a warning passes over: lossscale's own modules, and
#: torch's wrappers around an optimizer's ``step`` (its hooks, ``no_grad``).
_LIBRARY_PREFIXES = ("lossscale.", "torch.")


def _is_library(module: str) -> bool:
    return module.startswith(_LIBRARY_PREFIXES) and not module.endswith(("_test", "conftest"))


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the first frame outside lossscale and
    torch: the user's line that called into the library. Host work only."""
    level = 2  # the caller of this function
    frame = sys._getframe(1)
    while frame.f_back is not None and _is_library(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
