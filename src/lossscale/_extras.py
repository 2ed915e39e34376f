"""Importing a front end's framework, with the extra that installs it named when it is missing."""

from __future__ import annotations

import importlib


def require(front_end: str, what: str, extra: str, *modules: str) -> None:
    """Import ``modules``; when one of them is not installed, raise ``ModuleNotFoundError`` (an
    ``ImportError``) saying ``lossscale.<front_end> needs <what>: pip install
    "lossscale[<extra>]"``. Any other import failure comes through unchanged."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as missing:
            if missing.name != name:
                raise
            raise ModuleNotFoundError(
                f'lossscale.{front_end} needs {what}: pip install "lossscale[{extra}]"',
                name=name,
            ) from missing
