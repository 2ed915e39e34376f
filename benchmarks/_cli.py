"""The command line shared by the per-framework benchmarks (``python -m benchmarks.X_bench``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any


def parser(doc: str | None) -> argparse.ArgumentParser:
    """``--quick``, ``--rounds`` and ``--json``; a benchmark adds its own options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (CI)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per comparison")
    ap.add_argument("--json", default=None, help="write the section (JSON) here")
    return ap


def write_json(data: dict[str, Any], path: str) -> None:
    """Write ``data`` to ``path`` (creating its folder), with NaN/inf refused."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")


def finish(
    section: dict[str, Any], json_path: str | None, render: Callable[[dict[str, Any]], list[str]]
) -> int:
    """Print the section's table, write its JSON when asked; the exit status."""
    print("\n".join(render(section)))
    if json_path:
        write_json(section, json_path)
    return 0


def progress(message: str) -> None:
    """One progress line on stderr (stdout carries the table)."""
    print(message, file=sys.stderr, flush=True)
