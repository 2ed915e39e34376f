"""The float16 plan as a JSON file: written by :meth:`lossscale.torch.Float16Plan.save`
(:meth:`lossscale.torch.Float16Audit.save`), read by :func:`lossscale.torch.load_plan`.

The file (format version 1) is one JSON object::

    {"format": "lossscale.float16-plan", "version": 1,
     "mode": "autocast", "float32_modules": ["model.layers.1.mlp.down_proj"],
     "scale_range": [8.0, 131072.0], "initial_scale": 16384.0, "underflow": 0.001,
     "reason": "", "verified": true, "modules": 33,
     "findings": [{"module": ..., "phase": ..., "op": ..., "amax": ..., "intrinsic": ...,
                   "scale": ..., "fixable": ..., "note": ...}, ...],
     "lossscale": "0.x", "torch": "2.13.0"}

``amax`` is a number or the string ``"inf"``; ``scale_range`` and ``initial_scale`` are null
when no loss scale fits.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from lossscale._version import __version__
from lossscale.torch._audit.finding import Finding
from lossscale.torch._audit.handle import MODES

__all__ = ["FORMAT", "VERSION", "read", "write"]

#: The ``"format"`` entry of a plan file.
FORMAT = "lossscale.float16-plan"
#: The newest plan-file version this lossscale reads and the one it writes.
VERSION = 1
_FINDING_FIELDS = Finding._fields


def write(fields: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a plan's ``fields`` (``Float16Plan._asdict()``) to ``path`` as JSON, replacing a
    file there (through a temporary file beside it); TypeError for a ``path`` that is not a
    ``str`` or ``os.PathLike``."""
    target = _path(path)
    text = json.dumps(_to_json(fields), indent=1)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, target)


def _path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def _finding_json(f: Finding) -> dict[str, Any]:
    return {**f._asdict(), "amax": "inf" if math.isinf(f.amax) else f.amax}


def _to_json(plan: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "mode": plan["mode"],
        "float32_modules": list(plan["float32_modules"]),
        "scale_range": None if plan["scale_range"] is None else list(plan["scale_range"]),
        "initial_scale": plan["initial_scale"],
        "underflow": plan["underflow"],
        "reason": plan["reason"],
        "verified": plan["verified"],
        "modules": plan["modules"],
        "findings": [_finding_json(f) for f in plan["findings"]],
        **plan["versions"],
    }


def _bad(path: Path, why: str) -> ValueError:
    return ValueError(f"{str(path)!r} is not a lossscale float16 plan: {why}")


def _positive(path: Path, key: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < math.inf:
        raise _bad(path, f"{key!r} must be a positive finite number, got {x!r}")
    return float(x)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fields of the plan in the file at ``path`` (``Float16Plan``'s, its findings as
    :class:`~lossscale.torch.Finding` s); raises as :func:`lossscale.torch.load_plan` says."""
    source = _path(path)
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _bad(source, f"not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _bad(source, f'no "format": "{FORMAT}" entry')
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _bad(source, f"'version' must be a positive int, got {version!r}")
    if version > VERSION:
        raise ValueError(
            f"{str(source)!r} is a float16 plan of format version {version}; this lossscale "
            f"({__version__}) reads versions up to {VERSION}: upgrade lossscale"
        )
    try:
        mode, names = data["mode"], data["float32_modules"]
        scale_range, initial, underflow = (
            data["scale_range"],
            data["initial_scale"],
            data["underflow"],
        )
        reason, verified, modules, rows = (
            data["reason"],
            data["verified"],
            data["modules"],
            data["findings"],
        )
    except KeyError as missing:
        raise _bad(source, f"the entry {missing.args[0]!r} is missing") from None
    if mode not in MODES:
        raise _bad(source, f"'mode' must be one of {MODES}, got {mode!r}")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _bad(source, f"'float32_modules' must be a list of names, got {names!r}")
    if scale_range is not None:
        if not isinstance(scale_range, list) or len(scale_range) != 2:
            raise _bad(source, f"'scale_range' must be [low, high] or null, got {scale_range!r}")
        low, high = (_positive(source, "scale_range", x) for x in scale_range)
        if low > high:
            raise _bad(source, f"'scale_range' must have low <= high, got {scale_range!r}")
        scale_range = (low, high)
    if initial is not None:
        initial = _positive(source, "initial_scale", initial)
    if not isinstance(reason, str) or not (verified is None or isinstance(verified, bool)):
        raise _bad(source, "'reason' must be a string and 'verified' a bool or null")
    if isinstance(modules, bool) or not isinstance(modules, int) or modules < 0:
        raise _bad(source, f"'modules' must be a count, got {modules!r}")
    if isinstance(underflow, bool) or not isinstance(underflow, (int, float)):
        raise _bad(source, f"'underflow' must be a number, got {underflow!r}")
    if not isinstance(rows, list):
        raise _bad(source, f"'findings' must be a list, got {type(rows).__name__}")
    findings = []
    for row in rows:
        if not isinstance(row, dict) or set(row) != set(_FINDING_FIELDS):
            raise _bad(source, f"a finding must have the entries {_FINDING_FIELDS}, got {row!r}")
        amax = math.inf if row["amax"] == "inf" else row["amax"]
        if isinstance(amax, bool) or not isinstance(amax, (int, float)):
            raise _bad(source, f"a finding's 'amax' must be a number or \"inf\", got {amax!r}")
        findings.append(Finding(**{**row, "amax": float(amax)}))
    versions = {k: str(data[k]) for k in ("lossscale", "torch") if k in data}
    return dict(
        mode=mode,
        float32_modules=tuple(names),
        scale_range=scale_range,
        initial_scale=initial,
        underflow=float(underflow),
        reason=reason,
        verified=verified,
        modules=modules,
        findings=tuple(findings),
        versions=versions,
    )
