"""Run every benchmark: ``python -m benchmarks [--quick] [--json PATH] [--only numpy,torch,grpo]``.

Each framework's benchmark runs in its own Python process (``python -m benchmarks.X_bench``), so
one framework's thread pools and allocations cannot disturb another's timings; inside it, every
comparison is one interleaved run (``_timing.interleaved``) and ratios come from that run's
medians (an overhead over a baseline: the median of the differences within each round). A
framework that is not installed is skipped, and the report says so.

Output: one Markdown table per framework on stdout, headed by the machine and the versions,
and closed by the noise verdict ("machine noisy: ratios unreliable" when more than 10% of the
rows had a variant whose interquartile range exceeded 25% of its median); and one JSON file
(default ``benchmarks/results/latest.json``) with every number. ``--from-json PATH`` prints the
tables of a saved file again. ``--quick`` (tiny sizes, few rounds) is what CI runs, only to keep
the benchmarks working: no speed is ever asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

if not __package__:  # run as a file (python benchmarks/NAME.py): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _cli, _machine, _report

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_JSON = os.path.join(HERE, "results", "latest.json")  # git-ignored
#: Each benchmark and the modules it needs besides lossscale.
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",),
    "torch": ("torch",),
    "jax": ("jax", "optax"),
    "torch_dist": ("torch",),
    "grpo": ("torch", "trl"),
    "vllm": ("torch", "vllm"),
}
SCHEMA = 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (CI)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (every benchmark)")
    ap.add_argument(
        "--json", default=DEFAULT_JSON, help="write here (default benchmarks/results/latest.json)"
    )
    ap.add_argument(
        "--only",
        default=",".join(FRAMEWORKS),
        help="comma-separated of: numpy, torch, jax, torch_dist, grpo, vllm",
    )
    ap.add_argument("--from-json", default=None, help="print the tables of a saved file, no run")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(FRAMEWORKS)
    if unknown:
        ap.error(f"--only: unknown {', '.join(sorted(unknown))}")
    return args


def missing_modules(name: str) -> list[str]:
    """The modules the benchmark ``name`` needs that are not installed."""
    return [m for m in FRAMEWORKS[name] if importlib.util.find_spec(m) is None]


def run_benchmark(name: str, quick: bool, rounds: int | None) -> dict[str, Any]:
    """Run ``benchmarks.<name>_bench`` in a new process and return its JSON section.

    Its progress goes to our stderr; its own table (stdout) is dropped, the report renders it.
    Raises ``RuntimeError`` with the exit status when it fails (its traceback went to stderr).
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.json")
        cmd = [sys.executable, "-m", f"benchmarks.{name}_bench", "--json", path]
        cmd += ["--quick"] if quick else []
        cmd += ["--rounds", str(rounds)] if rounds else []
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"exit status {proc.returncode}; its error is in the output above")
        with open(path) as f:
            section: dict[str, Any] = json.load(f)
    return section


def run_all(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every requested benchmark, in order; the whole report as a JSON-ready dict."""
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "command": " ".join(["python -m benchmarks", *argv]),
        "quick": args.quick,
        "machine": _machine.facts(),
        "sections": {},
        "skipped": {},
        "errors": {},
        "elapsed_s": {},
    }
    for name in args.only.split(","):
        missing = missing_modules(name)
        if missing:
            report["skipped"][name] = f"{', '.join(missing)} not installed"
            _cli.progress(f"{name}: skipped ({report['skipped'][name]})")
            continue
        _cli.progress(f"{name}: running")
        t0 = time.perf_counter()
        try:
            report["sections"][name] = run_benchmark(name, args.quick, args.rounds)
        except RuntimeError as e:
            report["errors"][name] = str(e)
        report["elapsed_s"][name] = round(time.perf_counter() - t0, 1)
    torch_section = report["sections"].get("torch")
    report["machine"]["gpu"] = torch_section["config"]["gpu"] if torch_section else None
    report["noise"] = _report.noise(report["sections"], report["machine"])
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print("\n".join(_report.render(json.load(f))))
        return 0
    report = run_all(args, argv)
    _cli.write_json(report, args.json)
    print("\n".join(_report.render(report)))
    shown = os.path.relpath(args.json) if args.json == DEFAULT_JSON else args.json
    print(f"\nJSON: {shown}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
