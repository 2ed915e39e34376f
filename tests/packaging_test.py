"""lossscale as a package: the sdist and the wheel build and pass ``twine check --strict``,
the wheel holds the library and nothing else (no tests), installs into a fresh venv with NumPy
only and runs the demo, the metadata is true (no address that does not exist, the Python
versions CI tests), the version has one source, and every extra names what its module needs.

The build runs without isolation (``--no-isolation``: the test environment's setuptools), so
no network is needed for it; the fresh venv installs NumPy from the package index (or pip's
cache), as a user's would.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

import lossscale
from lossscale import _extras

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def extra_modules() -> dict[str, list[str]]:
    """What each extra enables: the modules it must make importable (each engine adapter's
    extra from ``lossscale._extras.ADAPTERS``)."""
    return {
        "torch": ["torch"],
        "jax": ["jax", "optax"],
        "flax": ["flax", "orbax.checkpoint"],
        "plot": ["matplotlib"],
        "tf": ["tensorflow"],
        "keras": ["keras"],
        "bench": ["jmp"],
        "frameworks": ["lightning", "accelerate", "transformers", "trl"],
        "docs": ["mkdocs", "mkdocstrings", "material", "ruff"],
        "test": ["pytest", "hypothesis", "mypy", "build", "twine"],
        **{adapter.extra: list(adapter.imports) for adapter in _extras.ADAPTERS},
    }


def extra_for_module() -> dict[str, str]:
    """The lossscale module each framework extra serves."""
    front_ends = {"lossscale.torch": "torch", "lossscale.jax": "jax", "lossscale.keras": "keras"}
    return front_ends | {adapter.package: adapter.extra for adapter in _extras.ADAPTERS}


def adapter_extra_mismatches(declared: dict[str, list[str]]) -> list[str]:
    """The engine adapters whose extra in pyproject's ``declared`` extras is missing or lists
    other requirements than the adapter table's."""
    return [
        f"[{adapter.extra}] = {declared.get(adapter.extra)}, the table's: {adapter.requirements}"
        for adapter in _extras.ADAPTERS
        if declared.get(adapter.extra) != list(adapter.requirements)
    ]


EXTRA_MODULES = extra_modules()
EXTRA_FOR_MODULE = extra_for_module()
#: The Python versions CI tests (scripts/dev.sh on the CI machine's python3): the classifiers
#: claim these and no others.
CI_PYTHONS = {"3.11"}


def _run(*cmd: str | Path, cwd: Path = ROOT) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_every_extra_is_named_and_installs_what_its_module_needs() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) == set(EXTRA_MODULES)
    for module, extra in EXTRA_FOR_MODULE.items():
        assert extra in extras, module
    elsewhere = {a.extra for a in _extras.ADAPTERS if a.constraints != "constraints.txt"}
    for extra, modules in EXTRA_MODULES.items():
        if extra in elsewhere:  # installed in an environment of its own (scripts/dev.sh)
            continue
        for name in modules:  # the test environment installs every extra (scripts/dev.sh)
            assert importlib.util.find_spec(name) is not None, f"[{extra}] lacks {name}"
    assert not adapter_extra_mismatches(extras)


def test_metadata_and_one_version() -> None:
    project = PYPROJECT["project"]
    assert project["dynamic"] == ["version"] and "version" not in project
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "lossscale._version.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", lossscale.__version__)
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").is_file()
    assert project["readme"] == "README.md"
    # No address until it exists (add [project.urls] with the first one that does).
    assert "urls" not in project
    classifiers = project["classifiers"]
    assert any(c.startswith("Development Status") for c in classifiers)
    assert "Typing :: Typed" in classifiers
    versions = {c.rsplit(" :: ", 1)[1] for c in classifiers if re.search(r":: 3\.\d+$", c)}
    assert versions == CI_PYTHONS
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in CI_PYTHONS
    out = _run(sys.executable, "-m", "lossscale", "--version")
    assert out.strip() == f"lossscale {lossscale.__version__}"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    # no --sdist/--wheel: the sdist, then the wheel built from the unpacked sdist, so a stale
    # ./build folder of the source tree cannot leak into the wheel
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out)
    return out


def test_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    pytest.importorskip("twine")
    files = sorted(dist.iterdir())
    version = lossscale.__version__
    assert [f.name for f in files] == [
        f"lossscale-{version}-py3-none-any.whl",
        f"lossscale-{version}.tar.gz",
    ]
    _run(sys.executable, "-m", "twine", "check", "--strict", *files)


def _library_files() -> set[str]:
    """The library's files in the source tree: its modules without the tests, and py.typed."""
    src = ROOT / "src"
    modules = {
        path.relative_to(src).as_posix()
        for path in (src / "lossscale").rglob("*.py")
        if not (path.name.endswith("_test.py") or path.name in ("conftest.py", "_testing.py"))
    }
    return modules | {"lossscale/py.typed"}


def test_the_wheel_holds_the_library_and_nothing_else(dist: Path) -> None:
    wheel_path = next(dist.glob("*.whl"))
    with zipfile.ZipFile(wheel_path) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"lossscale-{lossscale.__version__}.dist-info/METADATA")
    info = f"lossscale-{lossscale.__version__}.dist-info"
    assert {n for n in names if not n.startswith(f"{info}/")} == _library_files()
    assert {n for n in names if n.startswith(f"{info}/")} == {
        f"{info}/{name}"
        for name in ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")
    } | {f"{info}/licenses/LICENSE"}
    assert "lossscale/_version.py" in names and "lossscale/torch/_scaler.py" in names
    # The long description is the README, as Markdown.
    text = metadata.decode("utf-8")
    header, _, body = text.partition("\n\n")
    assert "Description-Content-Type: text/markdown" in header
    assert "License-Expression: Apache-2.0" in header
    assert "Project-URL" not in header
    assert body.strip() == (ROOT / "README.md").read_text(encoding="utf-8").strip()


def test_the_sdist_keeps_the_tests_beside_the_modules(dist: Path) -> None:
    sdist = next(dist.glob("*.tar.gz"))
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert "src/lossscale/torch/_scaler_test.py" in names
    assert "src/lossscale/torch/conftest.py" in names


def test_the_wheel_runs_the_demo_in_a_fresh_venv_with_numpy_only(
    dist: Path, tmp_path: Path
) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    wheel = next(dist.glob("*.whl"))
    _run(python, "-m", "pip", "install", "--disable-pip-version-check", "-q", wheel)
    frozen = _run(python, "-m", "pip", "freeze")
    installed = {re.split(r"==| @ ", line)[0].lower() for line in frozen.splitlines() if line}
    assert installed == {"lossscale", "numpy"}, installed
    assert _run(python, "-m", "lossscale", "--version").strip().endswith(lossscale.__version__)
    out = _run(python, "-m", "lossscale", "demo", "--steps", "60", cwd=tmp_path)
    assert "DynamicLossScale" in out and "Verdict" in out
    # Without torch, its front end says what to install.
    missing = subprocess.run(
        [python, "-c", "import lossscale.torch"], capture_output=True, text=True, check=False
    )
    assert missing.returncode == 1
    assert 'pip install "lossscale[torch]"' in missing.stderr.splitlines()[-1], missing.stderr
