"""The heatmap of a :class:`~lossscale.numerics.Report` (needs matplotlib)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lossscale.numerics._counts import targets_of
from lossscale.numerics._report import format_scale

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from lossscale.numerics._report import Report

__all__ = ["heatmap"]

FIELDS = ("underflow", "subnormal", "overflow", "zeros", "nonfinite")


def heatmap(
    report: Report,
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    field: str = "underflow",
    title: str | None = None,
) -> Figure:
    """Save an image of ``field`` (a fraction: ``underflow``, ``subnormal``, ``overflow``,
    ``zeros`` or ``nonfinite``) of ``report`` against one format (the report's first when
    None), per tensor (rows, in first-seen order) and sampled step (columns), and return the
    matplotlib ``Figure``. Needs matplotlib (the ``plot`` extra), imported here.

    The colours follow a symmetric log scale (``SymLogNorm``: linear below 1e-5 of the
    entries, logarithmic above, up to all of them), so that fractions around the
    recommendation's threshold (:data:`THRESHOLD`, 0.1% underflow) stand apart: 0.05% and 0.2%
    get clearly different colours, and 0 its own. The colour bar is in percent and marks the
    threshold. Each column is labelled at the top with the loss scale in use at that step
    (``2^k``), the steps at the bottom.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> from lossscale.numerics import Report, heatmap
      >>> report = Report()
      >>> for step in range(3):
      ...     report.record(step, {"w": np.full(4, 10.0**-step * 1e-6, np.float32)})
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "underflow.png"
      >>> figure = heatmap(report, path)
      >>> path.read_bytes()[:4]
      b'\x89PNG'

    Raises:
      ImportError: matplotlib is missing (``pip install 'lossscale[plot]'``).
      ValueError: ``field`` is not a fraction field, or the report has no rows.
    """
    if field not in FIELDS:
        raise ValueError(f"field must be one of {', '.join(FIELDS)}, got {field!r}")
    fmt = report.formats[0] if format is None else targets_of(format, "format")[0]
    rows = [r for r in report.rows if r.format == fmt]
    if not rows:
        raise ValueError(f"the report has no rows for {fmt!r}")
    try:
        from matplotlib.colors import SymLogNorm
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the heatmap needs matplotlib: pip install 'lossscale[plot]'") from exc
    tensors = list(dict.fromkeys(r.tensor for r in rows))
    steps = sorted({r.step for r in rows})
    scales = {r.step: r.loss_scale for r in reversed(rows)}  # each step's (first row's) scale
    grid = [[float("nan")] * len(steps) for _ in tensors]
    t_index = {t: i for i, t in enumerate(tensors)}
    s_index = {s: i for i, s in enumerate(steps)}
    for r in rows:
        grid[t_index[r.tensor]][s_index[r.step]] = getattr(r, field)
    width = max(8.0, 3.0 + 0.3 * len(steps))
    fig = Figure(figsize=(width, 2.0 + 0.25 * len(tensors)), constrained_layout=True)
    ax = fig.subplots()
    norm = SymLogNorm(linthresh=LINEAR_BELOW, linscale=1.0, vmin=0.0, vmax=1.0, base=10)
    image = ax.imshow(grid, aspect="auto", norm=norm, cmap="magma", interpolation="none")
    ax.set_yticks(range(len(tensors)), tensors, fontsize=8)
    ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("step")
    top = ax.secondary_xaxis("top")
    top.set_xticks(range(len(steps)), [format_scale(scales[s]) for s in steps], fontsize=7)
    top.tick_params(axis="x", labelrotation=90)
    top.set_xlabel("loss scale in use")
    ax.set_title(title or f"{fmt}: fraction of entries ({field})")
    bar = fig.colorbar(image, ax=ax, label=f"{field} (% of entries)")
    bar.set_ticks(COLOUR_TICKS)
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: _percent_label(value)))
    bar.ax.axhline(THRESHOLD, color="cyan", linewidth=1.5)
    fig.savefig(path, dpi=100)
    return fig


#: The recommendation's default underflow threshold (``recommend(underflow=1e-3)``), marked on
#: the colour bar.
THRESHOLD = 1e-3
#: Below this fraction (one entry in 100,000) the colour scale is linear: 0 must have a colour,
#: which a log scale has not.
LINEAR_BELOW = 1e-5
#: The colour bar's ticks: 0, then every power of ten up to 1.
COLOUR_TICKS = (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def _percent_label(fraction: float) -> str:
    """``0``, ``0.1%``, ``10%``, ``100%``, ...: a colour bar tick as a percentage."""
    if fraction <= 0:
        return "0"
    return f"{fraction * 100:.6g}%"
