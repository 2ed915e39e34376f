"""The runnable scripts in ``examples/``: each one runs in CI in its quick mode.

* :func:`test_example_runs` runs every example listed in :data:`EXAMPLES` with ``--quick`` in a
  fresh interpreter (``sys.executable``, from the repository root) and checks its exit status
  (each example exits nonzero when its training did not work) and its key output lines. An
  example whose libraries are not installed is skipped with a reason.
* :func:`test_every_example_is_covered` fails for a ``.py`` file under ``examples/`` that is
  neither in :data:`EXAMPLES` nor run elsewhere: such an example declares, on a line of its
  module docstring, ``CI: run by <path of a test file>``, and that test file must exist and
  name the example's file (e.g. ``examples/distributed_torch.py``, run with torchrun by a torch
  test).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lossscale._testing import NO_FLOAT16_CPU_ENV

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = ROOT / "examples"
TIMEOUT_S = 120
#: The opt-out line of an example run by another test: ``CI: run by <path>.py`` at the start
#: of a docstring line, maybe followed by more words (how it is run).
RUN_BY = re.compile(r"^\s*CI: run by (?P<path>[^\s()]+\.py)\b", re.MULTILINE)


@dataclass(frozen=True)
class Example:
    """An example run here: the modules it needs, and regexes its stdout must match."""

    requires: tuple[str, ...]
    expect: tuple[str, ...]
    #: Extra environment: the DeepSpeed example runs as on a CPU without float16 instructions
    #: (AVX512-FP16, AMX), where DeepSpeed refuses fp16 unless the example lifts that.
    env: tuple[tuple[str, str], ...] = ()


EXAMPLES: dict[str, Example] = {
    "torch_cnn_fp16.py": Example(
        requires=("torch",),
        expect=(  # the example checks the numbers itself; these lines hold on CPU and CUDA
            r"autocast float16, 25 steps of 4 micro-batches",
            r"injected overflow at step 5: skipped=True, parameters unchanged=True, "
            r"scale \d+ -> \d+",
            r"non-finite gradients at step 5: \[\('0\.weight', ",
            r"skipped steps [1-9]\d*\n",
            r"scheduler steps \d+ \(of 25 optimizer steps\)",
            r"final loss [0-9.]+ \(initial [0-9.]+\)",
        ),
    ),
    "flax_optax_mlp.py": Example(
        requires=("jax", "optax", "flax"),
        expect=(
            r"float16 compute, 100 steps, initial scale 2\*\*24",
            r"float16 overflows backed the scale off from 2\*\*24 to 2\*\*\d+ in the first "
            r"[1-9]\d* steps",
            r"injected overflow at step 40: skipped=True, parameters unchanged=True, "
            r"scale halved=True",
            r"skipped steps [1-9]\d*\n",
            r"final loss [0-9.]+ \(initial [0-9.]+\)",
        ),
    ),
    "deepspeed_fp16_rl.py": Example(
        requires=("torch", "deepspeed"),
        expect=(
            r"ZeRO-2 fp16, 2 ranks, 12 PPO steps, overflow injected at step 4",
            r"skipped steps 1 \(at \[4\]\), scale 65536\.0",  # hysteresis 2 absorbed it
            r"LR schedule steps 11 of 12; ranks agree: True",
        ),
        env=tuple(NO_FLOAT16_CPU_ENV.items()),
    ),
    "numpy_demo.py": Example(
        requires=(),
        expect=(
            r"lossscale demo: .* 100 SGD steps",
            r"\nDynamicLossScale ",
            r"check: final loss \S+ with loss scaling, \S+ without",
        ),
    ),
}


def example_files() -> list[Path]:
    """Every ``.py`` file under ``examples/`` (nested ones included)."""
    return sorted(p for p in EXAMPLES_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def docstring(path: Path) -> str:
    """The module docstring of a Python file (without importing it); empty if none."""
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def run_by(doc: str) -> str | None:
    """The test file named by a ``CI: run by <path>`` line of the docstring ``doc``, if any."""
    match = RUN_BY.search(doc)
    return match["path"] if match else None


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name: str) -> None:
    example = EXAMPLES[name]
    for module in example.requires:
        pytest.importorskip(module)
    script = EXAMPLES_DIR / name
    proc = subprocess.run(
        [sys.executable, str(script.relative_to(ROOT)), "--quick"],
        cwd=ROOT,
        env={**os.environ, **dict(example.env)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    report = f"exit status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    lines = proc.stdout.rstrip().splitlines()
    assert lines and lines[-1] == "OK", report
    for pattern in example.expect:
        assert re.search(pattern, proc.stdout), f"no match for {pattern!r}\n{report}"


def test_every_example_is_covered() -> None:
    files = example_files()
    assert files, f"no examples found in {EXAMPLES_DIR}"
    names = {str(p.relative_to(EXAMPLES_DIR)) for p in files}
    assert not set(EXAMPLES) - names, f"listed but missing: {sorted(set(EXAMPLES) - names)}"
    uncovered = []
    for path in files:
        name = str(path.relative_to(EXAMPLES_DIR))
        runner = run_by(docstring(path))
        if name in EXAMPLES:
            assert runner is None, f"{name} is run here and declares 'CI: run by {runner}'"
            continue
        if runner is None:
            uncovered.append(name)
            continue
        test_file = ROOT / runner
        assert test_file.is_file(), f"{name}: 'CI: run by {runner}': no such file"
        assert path.name in test_file.read_text(encoding="utf-8"), (
            f"{name}: 'CI: run by {runner}', but {runner} does not mention {path.name}"
        )
    assert not uncovered, (
        f"examples run by no test: {uncovered}; add them to EXAMPLES in {Path(__file__).name} "
        "or declare 'CI: run by <test file>' in their module docstring"
    )


def test_examples_have_docstring_and_main_guard() -> None:
    for path in example_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        command = f"examples/{path.relative_to(EXAMPLES_DIR)}"
        assert command in (ast.get_docstring(tree) or ""), (
            f"{path.name}: the module docstring says how to run {command}"
        )
        guards = [
            node
            for node in tree.body
            if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)
        ]
        assert guards, f'{path.name}: no `if __name__ == "__main__":` guard'


def test_run_by_marker() -> None:
    path = "src/lossscale/torch/_distributed_test.py"
    assert run_by(f"Run it.\n\nCI: run by {path}\n") == path
    assert run_by(f"Run it.\n\nCI: run by {path} (under torchrun, 2 ranks, --quick).") == path
    assert run_by("CI: run by tests/x_test.py.") == "tests/x_test.py"
    assert run_by("Not run by CI: run by hand") is None
    assert run_by("Not CI: run by tests/x_test.py") is None


def load_example(name: str) -> Any:
    """Import an example as a module (without running its ``main``)."""
    spec = importlib.util.spec_from_file_location(f"example_{name[:-3]}", EXAMPLES_DIR / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "cli"),
    [
        ([], ["demo"]),  # exactly `python -m lossscale demo`
        (["--quick"], ["demo", "--steps", "100"]),
        (["--quick", "--steps", "7"], ["demo", "--steps", "7"]),
        (
            ["--seed", "3", "--plot", "out.png", "--no-progress"],
            ["demo", "--seed", "3", "--plot", "out.png", "--no-progress"],
        ),
    ],
)
def test_numpy_demo_passes_the_cli_arguments(
    argv: list[str], cli: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lossscale.demo

    module = load_example("numpy_demo.py")
    calls: list[list[str]] = []
    runs: list[dict[str, Any]] = []
    real_run = lossscale.demo.run

    def fake_main(args: list[str]) -> int:
        calls.append(list(args))
        return 0

    def short_run(**kwargs: Any) -> Any:
        runs.append(kwargs)
        return real_run(scaled=kwargs["scaled"], steps=60, seed=kwargs["seed"])

    monkeypatch.setattr(lossscale.demo, "main", fake_main)
    monkeypatch.setattr(lossscale.demo, "run", short_run)
    module.main(argv)
    assert calls == [cli]
    steps = cli[cli.index("--steps") + 1] if "--steps" in cli else None
    seed = int(cli[cli.index("--seed") + 1]) if "--seed" in cli else 0
    for kwargs in runs:  # the check trains what the demo trained
        assert kwargs.get("seed") == seed
        assert kwargs.get("steps") == (None if steps is None else int(steps))


def test_numpy_demo_fails_when_scaling_does_not_help(monkeypatch: pytest.MonkeyPatch) -> None:
    import lossscale.demo

    module = load_example("numpy_demo.py")
    result = SimpleNamespace(final_loss=1.0, initial_loss=2.0, skipped=0)
    monkeypatch.setattr(lossscale.demo, "main", lambda args: 0)
    monkeypatch.setattr(lossscale.demo, "run", lambda **kwargs: result)
    with pytest.raises(SystemExit, match="FAILED"):
        module.main(["--quick"])


def test_numpy_demo_exits_with_the_cli_status(monkeypatch: pytest.MonkeyPatch) -> None:
    import lossscale.demo

    module = load_example("numpy_demo.py")
    monkeypatch.setattr(lossscale.demo, "main", lambda args: 2)
    with pytest.raises(SystemExit) as exc:
        module.main(["--steps", "0"])
    assert exc.value.code == 2
