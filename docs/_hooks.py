"""MkDocs hooks: the figure and numbers of "How loss scaling works", from a run of the demo.

At every build, ``lossscale.demo.run`` trains the demo network twice (float16, NumPy; with and
without ``DynamicLossScale``), so the figure and the table always come from the current code:

* ``on_files`` adds the figure to the site as a generated file, ``img/scale_trajectory.png``
  (nothing is written into ``docs/``);
* ``on_page_markdown`` replaces ``<!-- demo:table -->`` on that page with the run's numbers.

``on_post_page`` fails the build on a rendering trap: a ``>>>`` example rendered as text (a
docstring session Markdown read as nested blockquotes, which ``mkdocs build --strict`` does not
report by itself), and ``on_config`` fails it when the formatter mkdocstrings needs for
signatures (ruff or black) is missing, so that a local build renders as CI's does.

Takes about 3 s (two runs of 400 steps and one matplotlib figure, Agg backend).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

FIGURE = "img/scale_trajectory.png"
PAGE = "how-it-works.md"
TABLE_MARKER = "<!-- demo:table -->"
STEPS = 400
SEED = 0

_runs: tuple[Any, Any] | None = None


def on_config(config: Any) -> Any:
    """Import lossscale from this checkout's ``src/``, whatever else is installed; require the
    signature formatter."""
    import importlib.util
    import shutil

    has_ruff = importlib.util.find_spec("ruff") is not None or shutil.which("ruff") is not None
    if not has_ruff and importlib.util.find_spec("black") is None:
        raise RuntimeError(
            "mkdocstrings formats signatures with ruff or black; install the docs extra "
            "(pip install -e '.[docs]')"
        )
    global _runs
    _runs = None  # computed once per build, by the first hook that needs it
    src = str(Path(config.config_file_path).parent / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def _demo_runs() -> tuple[Any, Any]:
    global _runs
    if _runs is None:
        from lossscale.demo import run

        _runs = (
            run(scaled=False, steps=STEPS, seed=SEED),
            run(scaled=True, steps=STEPS, seed=SEED),
        )
    return _runs


def _power_of_two(value: float) -> str:
    exponent = math.log2(value)
    return f"2<sup>{exponent:.0f}</sup>" if exponent.is_integer() else f"{value:.3g}"


def _figure(unscaled: Any, scaled: Any) -> bytes:
    """The demo's own plot (``python -m lossscale demo --plot``) of these two runs, as PNG."""
    import tempfile

    from lossscale.demo._cli import save_plot

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scale_trajectory.png"
        save_plot(unscaled, scaled, path)
        return path.read_bytes()


def _table(unscaled: Any, scaled: Any) -> str:
    def percent(x: float) -> str:  # 99.96 % is not "100.0 %"
        for digits in (1, 2, 3):
            text = f"{100 * x:.{digits}f} %"
            if x == 1 or not text.startswith("100."):
                return text
        return "> 99.999 %"

    first_growth = next(
        (i for i, s in enumerate(scaled.scales) if s != scaled.scales[0]), len(scaled.scales)
    )
    rows = [
        ("", "no loss scaling", "`DynamicLossScale`"),
        (
            "final loss, relative to the first step's",
            percent(unscaled.final_loss / unscaled.initial_loss),
            percent(scaled.final_loss / scaled.initial_loss),
        ),
        (
            "float16 weight-gradient entries that were 0",
            percent(unscaled.zero_grad_fraction),
            percent(scaled.zero_grad_fraction),
        ),
        ("skipped steps", str(unscaled.skipped), str(scaled.skipped)),
        (
            "first step with non-finite gradients",
            "—",
            str(scaled.skipped_steps[0]) if scaled.skipped else "none",
        ),
        (
            "loss scale: initial, largest, final",
            "—",
            ", ".join(
                _power_of_two(x) for x in (scaled.scales[0], max(scaled.scales), scaled.final_scale)
            ),
        ),
        ("first growth of the scale", "—", f"after step {first_growth}"),
    ]
    lines = [f"| {' | '.join(row)} |" for row in rows]
    lines.insert(1, "|---|---:|---:|")
    caption = f"The demo's two runs at this build: {STEPS} SGD steps each, seed {SEED}."
    return caption + "\n\n" + "\n".join(lines)


def on_files(files: Any, *, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, FIGURE, content=_figure(*_demo_runs())))
    return files


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if TABLE_MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {TABLE_MARKER} marker")
    return markdown.replace(TABLE_MARKER, _table(*_demo_runs()))


_NESTED_QUOTE = re.compile(r"<blockquote>\s*<blockquote>")
_CODE = re.compile(r"<(pre|code)\b.*?</\1>", re.S)


def rendering_traps(html: str) -> list[str]:
    """What of ``html`` shows a docstring example rendered as text (empty: none)."""
    text = _CODE.sub("", html)
    traps = []
    if "&gt;&gt;&gt;" in text or ">>> " in text:
        traps.append("a '>>>' example rendered as text, not code")
    if _NESTED_QUOTE.search(text):
        traps.append("nested blockquotes (a '>>>' session read as Markdown quotes)")
    return traps


def on_post_page(output: str, *, page: Any, config: Any) -> str:
    traps = rendering_traps(output)
    if traps:
        raise ValueError(f"{page.file.src_uri}: {'; '.join(traps)}")
    return output
