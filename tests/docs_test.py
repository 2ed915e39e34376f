"""The documentation site: ``mkdocs build --strict`` passes and every Python example runs.

Each page's ```` ```python ```` blocks run in order in one fresh interpreter per page, sharing
one namespace (a later block may use what an earlier one defined). A block that cannot run on a
CPU in a single process is preceded by ``<!-- skip: reason -->``; such blocks are counted and
kept rare. Tracebacks point at the Markdown file and line.

A page shows what its code prints: a ```` ```text ```` block whose nearest fenced block above is
a Python block that runs is that block's output, and must equal what the block prints
(trailing spaces and blank lines aside). Such pages run a second time as on another CPU (one
thread, torch's generic kernels, no float16 instructions), up to their last printed block: what
a page shows, every machine prints. Pages that use DeepSpeed run as on a CPU without float16
instructions (AVX512-FP16, AMX), where DeepSpeed refuses ``fp16`` unless the page lifts that.

The README is the front door: each of its blocks also runs alone in a fresh interpreter (a
reader copies one block, not the page), none may be skipped, its relative links resolve, and it
stays short.

On the site's pages every block a reader sees either stands alone or says so: a Python block
binds every name it reads (its imports included; checked statically, so that a copied block
cannot end in ``NameError``), or its first line is a comment starting ``# Continues`` (the page's
earlier blocks define the rest, named there) or ``# Excerpt``. A block included from a file
(``--8<-- "file:section"``) is introduced as an excerpt, with a link to the whole file shown on
the same page.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import difflib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lossscale import _extras as extras
from lossscale._testing import NO_FLOAT16_CPU_ENV

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
#: Pages outside the site whose examples run too (paths relative to docs/).
OTHER_PAGES = ["../README.md", "../CONTRIBUTING.md"]

README = ROOT / "README.md"
#: The README's length limit, in lines: what a newcomer reads top to bottom.
README_MAX_LINES = 200
#: Markdown files outside docs/ whose relative links must resolve (mkdocs checks the site's).
LINKED_FILES = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"]

#: At most this many blocks may be skipped, over all pages (each needs a reason).
#: The fifth: timm needs torchvision here (its recipe runs in frameworks_timm_test); the sixth
#: and seventh: the HF Trainer's and Lightning's DeepSpeed recipes (one DeepSpeed plugin per
#: process; Lightning's strategy is CUDA-only), run or tested in the DeepSpeed tests. The
#: eighth: OpenRLHF's strategy (OpenRLHF does not install on a CPU).
MAX_SKIPPED = 8


def optional_modules() -> tuple[str, ...]:
    """Modules a page may need; a page whose examples import a missing one is skipped (each
    engine adapter's engine among them, from ``lossscale._extras.ADAPTERS``)."""
    engines = dict.fromkeys(adapter.framework for adapter in extras.ADAPTERS)
    return (
        "torch",
        "jax",
        "optax",
        "flax",
        "orbax",
        "tensorflow",
        "keras",
        "lightning",
        "accelerate",
        "transformers",
        "matplotlib",
        *engines,
    )


def api_pages() -> dict[str, str]:
    """The API reference page of each public module."""
    return {
        "lossscale": "api/lossscale",
        "lossscale.core": "api/core",
        "lossscale.numerics": "api/numerics",
        "lossscale.torch": "api/torch",
        "lossscale.torch.experimental": "api/torch",
        "lossscale.torch.lightning": "api/torch",
        "lossscale.jax": "api/jax",
        "lossscale.keras": "api/keras",
        "lossscale.keras.experimental": "api/keras",
        **{a.package: a.api_page.removesuffix(".md") for a in extras.ADAPTERS},
        "lossscale.deepspeed.hf": "api/deepspeed",
        "lossscale.deepspeed.lightning": "api/deepspeed",
        "lossscale.accelerate.hf": "api/accelerate",
    }


def nav_mismatches(nav: object) -> list[str]:
    """The engine adapters whose API page (titled ``lossscale.<name>``) or guide (titled as in
    the table) is missing from mkdocs.yml's ``nav``, or whose page file does not exist."""

    def titled(node: object) -> list[tuple[str, object]]:
        if isinstance(node, list):
            return [pair for item in node for pair in titled(item)]
        if isinstance(node, dict):
            return [(k, v) for k, v in node.items()] + titled(list(node.values()))
        return []

    pairs = titled(nav)
    wrong = []
    for adapter in extras.ADAPTERS:
        for title, page in (
            (adapter.package, adapter.api_page),
            (adapter.title, adapter.docs_page),
        ):
            if (title, page) not in pairs:
                wrong.append(f"nav lacks {title}: {page}")
            if not (ROOT / "docs" / page).is_file():
                wrong.append(f"docs/{page} does not exist")
    return wrong


OPTIONAL_MODULES = optional_modules()
API_PAGES = api_pages()

#: Extra environment of a page's run: DeepSpeed's page runs as on a CPU without float16
#: instructions, as its readers' CPUs may be (the page lifts DeepSpeed's refusal in one line).
#: The float16 RL page: transformers imports DeepSpeed (installed here) when it builds a trainer,
#: and DeepSpeed prints its accelerator detection to stdout unless told the accelerator.
PAGE_ENV: dict[str, dict[str, str]] = {
    "deepspeed.md": NO_FLOAT16_CPU_ENV,
    "rl.md": {"DS_ACCELERATOR": "cpu"},
}
#: "Another CPU": one thread, torch's generic (non-vectorised) kernels, MKL and oneDNN limited to
#: AVX2. Pages with printed outputs run once more there and must print the same.
ANOTHER_CPU_ENV = {
    "OMP_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    **NO_FLOAT16_CPU_ENV,
}
#: The languages of a block that shows what the Python block above it printed.
OUTPUT_LANGUAGES = ("text",)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>\S.*?)\s*-->\s*$")
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.MULTILINE)
_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")

# Runs in the subprocess: the blocks arrive as JSON on stdin. Each is compiled with its
# Markdown file name and padded to its line, so tracebacks show the page's own lines. What each
# block prints is also written, as a JSON list, to the file named by the first argument.
_RUNNER = """
import contextlib, io, json, sys
namespace = {"__name__": "__main__"}
printed = []
for block in json.load(sys.stdin):
    source = "\\n" * (block["line"] - 1) + block["code"]
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            exec(compile(source, block["file"], "exec"), namespace)
    finally:
        sys.stdout.write(buffer.getvalue())
        sys.stdout.flush()
    printed.append(buffer.getvalue())
with open(sys.argv[1], "w", encoding="utf-8") as out:
    json.dump(printed, out)
"""


@dataclass(frozen=True)
class Block:
    """One fenced ``python`` block of a page."""

    file: str  # the page's path, for tracebacks
    line: int  # line number (1-based) of the block's first code line
    code: str  # dedented
    skip: str | None  # the reason given in a preceding <!-- skip: ... --> comment
    output: str | None = None  # the ```text block after it: what it prints
    output_line: int = 0  # line number of the output block's first line


def public_names(module: str) -> list[str]:
    """The names in ``module``'s ``__all__`` (read from its source) except its submodules and
    ``__version__``."""
    path = ROOT / "src" / Path(*module.split("."))
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(source.read_text(encoding="utf-8"))
    names: list[str] = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and any(
            isinstance(t, ast.Name) and t.id == "__all__"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    )
    return [
        name
        for name in names
        if name != "__version__"
        and not (path / name).is_dir()
        and not (path / f"{name}.py").is_file()
    ]


def extract_blocks(text: str, file: str = "<page>") -> list[Block]:
    """The ```` ```python ```` blocks of Markdown ``text`` (also indented ones, in tabs or
    admonitions), in order, each with the output block that follows it, if any (a
    ```` ```text ```` block whose nearest fenced block above is that Python block)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    previous = ""  # the last non-blank line before the current one
    prints: int | None = None  # the index of the Python block an output block would belong to
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            if lines[i].strip():
                previous = lines[i]
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].split(maxsplit=1)[0] if opening["info"].strip() else ""
        end = i + 1
        while end < len(lines):
            closing = lines[end].strip()
            if closing.startswith(fence) and set(closing) == {fence[0]}:
                break
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip()
            for line in lines[i + 1 : end]
        ]
        if language in ("python", "py"):
            skip = _SKIP.match(previous)
            blocks.append(
                Block(file, i + 2, textwrap.dedent("\n".join(body)) + "\n", skip and skip["reason"])
            )
            prints = len(blocks) - 1
        elif language in OUTPUT_LANGUAGES and prints is not None:
            shown = textwrap.dedent("\n".join(body)) + "\n"
            blocks[prints] = dataclasses.replace(blocks[prints], output=shown, output_line=i + 2)
            prints = None
        else:
            prints = None
        previous = lines[end] if end < len(lines) else ""
        i = end + 1
    return blocks


def page_blocks(page: str) -> list[Block]:
    path = DOCS / page
    return extract_blocks(path.read_text(encoding="utf-8"), str(path))


def test_extract_blocks() -> None:
    text = textwrap.dedent(
        """\
        # Title

        ```python
        a = 1
        ```

        ```bash
        echo not python
        ```

        === "Tab"

            ```python title="in a tab"
            def f():
                return a
            ```

        <!-- skip: needs two processes -->
        ```python
        raise SystemExit(1)
        ```
        """
    )
    blocks = extract_blocks(text)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (4, "a = 1\n", None),
        (14, "def f():\n    return a\n", None),
        (20, "raise SystemExit(1)\n", "needs two processes"),
    ]


def test_pages_have_examples_and_few_skips() -> None:
    blocks = [block for page in PAGES + OTHER_PAGES for block in page_blocks(page)]
    skipped = [f"{b.file}:{b.line}: {b.skip}" for b in blocks if b.skip]
    assert len(blocks) >= 20, [page for page in PAGES]
    assert len(skipped) <= MAX_SKIPPED, skipped


def test_every_page_is_in_the_nav() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in pages(item)]
        if isinstance(node, dict):
            return [page for value in node.values() for page in pages(value)]
        return []

    nav = pages(config["nav"])
    assert sorted(nav) == PAGES
    assert len(set(nav)) == len(nav)
    assert not nav_mismatches(config["nav"])  # every engine adapter, from the table


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    pytest.importorskip("matplotlib")  # the build-time figure
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    figure = site / "img" / "scale_trajectory.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    how = (site / "how-it-works" / "index.html").read_text(encoding="utf-8")
    assert "img/scale_trajectory.png" in how
    assert "<!-- demo:table -->" not in how  # the hook put the run's numbers there
    # The API reference is generated from the docstrings: an entry for every public name.
    for module, page in API_PAGES.items():
        html = (site / page / "index.html").read_text(encoding="utf-8")
        for name in public_names(module):
            assert f'id="{module}.{name}"' in html, (page, f"{module}.{name}")
        # The docs' griffe extension turned the reST roles into links or code.
        assert not re.search(r":(class|func|meth|mod|attr):`", html), page
        # ... and every >>> session into code (the hook fails the build otherwise; issue 19)
        assert "<blockquote>" not in html, page
    torch_page = (site / "api" / "torch" / "index.html").read_text(encoding="utf-8")
    assert torch_page.count('<span class="gp">&gt;&gt;&gt; </span>') > 20


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_names_rendering_traps() -> None:
    hooks = _load("_hooks")
    quoted = "<p>For example:</p><blockquote><blockquote><blockquote><p>import torch</p>"
    assert hooks.rendering_traps(quoted) == [
        "nested blockquotes (a '>>>' session read as Markdown quotes)"
    ]
    assert hooks.rendering_traps("<p>&gt;&gt;&gt; x = 1</p>") == [
        "a '>>>' example rendered as text, not code"
    ]
    code = (
        '<pre><code><span class="gp">&gt;&gt;&gt; </span>x</code></pre><blockquote>ok</blockquote>'
    )
    assert hooks.rendering_traps(code) == []


def test_sessions_outside_examples_sections_are_fenced() -> None:
    pytest.importorskip("griffe")
    rewrite = _load("_griffe_docstrings")._fence_sessions
    doc = [
        "A class.",
        "",
        "For example, a step:",
        "",
        ">>> x = 1",
        ">>> x + 1",
        "2",
        "",
        "Examples:",
        "  >>> y = 2",
    ]
    out = rewrite(doc)
    assert out[4:10] == ["", "```pycon", ">>> x = 1", ">>> x + 1", "2", "```"]
    assert out[-1] == "  >>> y = 2"  # griffe renders the Examples section itself


def run_page(page: str, another_cpu: bool = False) -> tuple[str, str]:
    """Run the examples of ``page`` in a fresh interpreter: ``('skipped', reason)``,
    ``('failed', output)`` or ``('passed', '')``. ``another_cpu``: in :data:`ANOTHER_CPU_ENV`,
    up to the page's last block with a printed output."""
    blocks = [block for block in page_blocks(page) if block.skip is None]
    env = dict(PAGE_ENV.get(page, {}))
    if another_cpu:
        shown = [i for i, block in enumerate(blocks) if block.output is not None]
        blocks = blocks[: shown[-1] + 1] if shown else []
        env.update(ANOTHER_CPU_ENV)
    imported = {name for block in blocks for name in _IMPORT.findall(block.code)}
    for name in sorted(imported.intersection(OPTIONAL_MODULES)):
        if importlib.util.find_spec(name) is None:
            return "skipped", f"{page} needs {name}, which is not installed"
    return _run_blocks(blocks, env)


def _shown(text: str) -> list[str]:
    """``text`` as a page shows it: lines without trailing spaces, no blank lines around."""
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def printed_differences(blocks: list[Block], printed: list[str]) -> list[str]:
    """For each block with an output block, a diff of what the page shows against what the
    block printed, where they differ."""
    differences = []
    for block, out in zip(blocks, printed, strict=True):
        if block.output is None or _shown(out) == _shown(block.output):
            continue
        diff = difflib.unified_diff(
            _shown(block.output),
            _shown(out),
            f"{block.file}:{block.output_line} (the page shows)",
            f"{block.file}:{block.line} (the block printed)",
            lineterm="",
        )
        differences.append("\n".join(diff))
    return differences


def _run_blocks(blocks: list[Block], extra_env: dict[str, str] | None = None) -> tuple[str, str]:
    """Run ``blocks`` in order in a fresh interpreter (``src`` first on its path, a temporary
    working folder: examples that write files write them there, ``extra_env`` added to the
    environment), and compare what each printed with its output block: ``('failed', output)``
    or ``('passed', '')``."""
    env = {**os.environ, "MPLBACKEND": "Agg", **(extra_env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as record:
        printed_file = Path(record) / "printed.json"
        result = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(printed_file)],
            input=json.dumps([dataclasses.asdict(block) for block in blocks]),
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            return "failed", result.stdout + result.stderr
        printed = json.loads(printed_file.read_text(encoding="utf-8"))
    differences = printed_differences(blocks, printed)
    if differences:
        where = f" (environment {extra_env})" if extra_env else ""
        return "failed", f"printed outputs differ from the page{where}:\n" + "\n\n".join(
            differences
        )
    return "passed", ""


#: The pages with examples to run.
EXAMPLE_PAGES = [
    page for page in PAGES + OTHER_PAGES if any(b.skip is None for b in page_blocks(page))
]
#: The pages that show what their blocks print.
OUTPUT_PAGES = [
    page
    for page in PAGES + OTHER_PAGES
    if any(b.skip is None and b.output is not None for b in page_blocks(page))
]
#: The key prefix of a page's run on "another CPU" (:data:`ANOTHER_CPU_ENV`).
ANOTHER_CPU = "another-cpu:"


def run_key(key: str) -> tuple[str, str]:
    """A page's examples in order (``key`` is the page, or ``another-cpu:<page>``), or one
    README block alone (``key`` is ``README.md:<line>``)."""
    if key.startswith("README.md:"):
        line = int(key.rpartition(":")[2])
        return run_alone(next(block for block in readme_blocks() if block.line == line))
    if key.startswith(ANOTHER_CPU):
        return run_page(key.removeprefix(ANOTHER_CPU), another_cpu=True)
    return run_page(key)


# autouse: the runs start with this module's first test, so they overlap the mkdocs build.
@pytest.fixture(scope="module", autouse=True)
def page_run(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[[str], tuple[str, str]]]:
    """``page_run(key)``: the result of :func:`run_key`. The runs of all selected pages and
    README blocks start together on a small pool: each is one process, which spends most of its
    time importing torch or jax and compiling."""
    selected = []
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        name = getattr(item, "originalname", None)
        if params and name == "test_page_examples_run":
            selected.append(params["page"])
        elif params and name == "test_page_prints_the_same_on_another_cpu":
            selected.append(ANOTHER_CPU + params["page"])
        elif params and name == "test_each_readme_block_runs_alone":
            selected.append(f"README.md:{params['block'].line}")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # xdist spreads the pages over its workers
        selected = []
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        runs = {key: pool.submit(run_key, key) for key in selected}

        def result(key: str) -> tuple[str, str]:
            if key not in runs:
                runs[key] = pool.submit(run_key, key)
            return runs[key].result()

        yield result
        for run in runs.values():
            run.cancel()


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_page_examples_run(page: str, page_run: Callable[[str], tuple[str, str]]) -> None:
    """Every block runs, and prints what the page shows after it."""
    status, detail = page_run(page)
    if status == "skipped":
        pytest.skip(detail)
    assert status == "passed", detail


@pytest.mark.parametrize("page", OUTPUT_PAGES)
def test_page_prints_the_same_on_another_cpu(
    page: str, page_run: Callable[[str], tuple[str, str]]
) -> None:
    """What a page shows does not depend on the machine: the same outputs with one thread,
    torch's generic kernels and no float16 instructions."""
    status, detail = page_run(ANOTHER_CPU + page)
    if status == "skipped":
        pytest.skip(detail)
    assert status == "passed", detail


def test_output_blocks_belong_to_the_python_block_above() -> None:
    text = textwrap.dedent(
        """\
        ```text
        not an output: no Python block above
        ```

        ```python
        print("a")
        ```

        It prints:

        ```text
        a
        ```

        ```python
        print("b")
        ```

        ```bash
        echo b
        ```

        ```text
        not an output: a bash block above
        ```
        """
    )
    blocks = extract_blocks(text)
    assert [(b.output, b.output_line) for b in blocks] == [("a\n", 12), (None, 0)]
    assert printed_differences(blocks, ["a  \n\n", "b\n"]) == []
    (diff,) = printed_differences(blocks, ["A\n", "b\n"])
    assert "-a" in diff and "+A" in diff and "<page>:12 (the page shows)" in diff


def readme_blocks() -> list[Block]:
    return extract_blocks(README.read_text(encoding="utf-8"), str(README))


def test_readme_is_short_and_starts_with_install() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    for extra in ("torch", "jax", "keras"):
        assert f'pip install "lossscale[{extra}]"' in text, extra
    assert "bash scripts/dev.sh demo" in text and "bash scripts/dev.sh test" in text
    assert len(readme_blocks()) >= 5


def links(path: Path) -> list[str]:
    """The link targets of Markdown file ``path``, fenced code left out."""
    text = path.read_text(encoding="utf-8")
    prose = re.sub(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[ \t]*$", "", text, flags=re.M | re.S)
    return _LINK.findall(prose)


def test_links_extracts_targets() -> None:
    path = ROOT / "README.md"
    assert all(isinstance(target, str) and target for target in links(path))
    assert _LINK.findall('[a](docs/a.md) [`b`](b.md "title") [c](c.md#top)') == [
        "docs/a.md",
        "b.md",
        "c.md#top",
    ]


@pytest.mark.parametrize("name", LINKED_FILES)
def test_relative_links_resolve(name: str) -> None:
    path = ROOT / name
    targets = links(path)
    if name == "README.md":
        assert len(targets) >= 10  # the docs pages are links, not code spans
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # an address or an anchor on the same page
        resolved = (path.parent / target.split("#", 1)[0]).resolve()
        assert resolved.exists(), f"{name}: {target}"
        assert ROOT in resolved.parents, f"{name}: {target} leaves the repository"


def run_alone(block: Block) -> tuple[str, str]:
    """Run one block in a fresh interpreter, as a reader who copied only it would."""
    for name in sorted(set(_IMPORT.findall(block.code)).intersection(OPTIONAL_MODULES)):
        if importlib.util.find_spec(name) is None:
            return "skipped", f"{block.file}:{block.line} needs {name}, which is not installed"
    return _run_blocks([block])


@pytest.mark.parametrize("block", readme_blocks(), ids=lambda block: f"line{block.line}")
def test_each_readme_block_runs_alone(
    block: Block, page_run: Callable[[str], tuple[str, str]]
) -> None:
    assert block.skip is None, f"README blocks are never skipped: {block.skip}"
    status, detail = page_run(f"README.md:{block.line}")
    if status == "skipped":
        pytest.skip(detail)
    assert status == "passed", detail


#: The project's own process, not the library: issue numbers and the benchmarks' and the
#: engine's internal names. The README and the CHANGELOG speak to users in the library's terms.
_INTERNAL = re.compile(r"\bissues? #?\d+|\banchors?\b|\bhomes?\b", re.IGNORECASE)


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_front_door_speaks_in_the_library_s_terms(name: str) -> None:
    text = (ROOT / name).read_text(encoding="utf-8")
    assert not _INTERNAL.findall(text), _INTERNAL.findall(text)


def test_changelog_entries_are_short() -> None:
    lines = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
    assert lines[:3] == ["# Changelog", "", "## Unreleased"]
    entries: list[list[str]] = []
    for line in lines:
        if line.startswith("- "):
            entries.append([line])
        elif line.startswith("  ") and entries:
            entries[-1].append(line)
    assert entries
    long = [entry[0] for entry in entries if len(entry) > 2]
    assert not long, f"CHANGELOG entries take one or two lines: {long}"


# -- blocks a reader copies: each stands alone, or says that it does not -----------------------
#: The first line of a block that does not stand alone: it says so, and names what it needs.
_NOT_ALONE = re.compile(r"^# (Continues|Excerpt)\b")
_INCLUDE = re.compile(r'^\s*--8<--\s+"(?P<file>[^":]+)(?::(?P<section>[^"]+))?"\s*$')


def free_names(code: str) -> list[str]:
    """The names ``code`` reads but never binds (imports, assignments, definitions, arguments,
    ``except ... as``, comprehension targets) and that are not builtins: what a block copied
    alone would lack. Scopes are not told apart (a name bound anywhere counts as bound)."""
    bound = set(dir(builtins))
    read: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(read - bound)


def test_free_names() -> None:
    code = textwrap.dedent(
        """\
        import numpy as np
        from a.b import c as d

        def f(x, *rest, key=None):
            return [y for y in rest if y] + [x, key, np, d, print, later]

        try:
            pass
        except ValueError as error:
            print(error, model)
        """
    )
    assert free_names(code) == ["later", "model"]


@pytest.mark.parametrize("page", PAGES + OTHER_PAGES)
def test_every_block_stands_alone_or_says_it_continues(page: str) -> None:
    lonely = [
        f"{block.file}:{block.line} uses {names}"
        for block in page_blocks(page)
        if (names := free_names(block.code)) and not _NOT_ALONE.match(block.code)
    ]
    assert not lonely, (
        "add the imports, or begin the block with '# Continues the blocks above: ... come from "
        f"there.' (or '# Excerpt ...'): {lonely}"
    )


def included_excerpts(text: str) -> list[tuple[int, str, str | None, str]]:
    """``(line, file, section, the prose line before the block)`` for each block of Markdown
    ``text`` whose body includes a file (``--8<-- "file"`` or ``"file:section"``)."""
    found = []
    lines = text.splitlines()
    previous = ""
    for i, line in enumerate(lines):
        include = _INCLUDE.match(line)
        if include is not None:
            found.append((i + 1, include["file"], include["section"], previous))
        elif line.strip() and not _FENCE.match(line):
            previous = line
    return found


def test_included_excerpts_say_so_and_the_page_shows_the_whole_file() -> None:
    pages = {page: (DOCS / page).read_text(encoding="utf-8") for page in PAGES}
    checked = 0
    for page, text in pages.items():
        includes = included_excerpts(text)
        whole = {file for _, file, section, _ in includes if section is None}
        for line, file, section, before in includes:
            if section is None:
                continue
            checked += 1
            where = f"{page}:{line} ({file}:{section})"
            assert "excerpt" in before.lower() and "](#" in before, where
            assert file in whole, f"{where}: the page does not show the whole file"
    assert checked >= 5  # docs/sharded.md's recipes
