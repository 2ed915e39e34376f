"""The heatmap of a :class:`~lossscale.numerics.Report` (needs matplotlib)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lossscale.numerics._counts import targets_of

if TYPE_CHECKING:
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
) -> None:
    """Save an image of ``field`` (a fraction: ``underflow``, ``subnormal``, ``overflow``,
    ``zeros`` or ``nonfinite``) of ``report`` against one format (the report's first when
    None), per tensor (rows, in first-seen order) and sampled step (columns). Needs matplotlib
    (the ``plot`` extra), imported here.

    Example:
      >>> import numpy as np, tempfile, pathlib
      >>> from lossscale.numerics import Report, heatmap
      >>> report = Report()
      >>> for step in range(3):
      ...     report.record(step, {"w": np.full(4, 10.0**-step * 1e-6, np.float32)})
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "underflow.png"
      >>> heatmap(report, path)
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
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the heatmap needs matplotlib: pip install 'lossscale[plot]'") from exc
    tensors = list(dict.fromkeys(r.tensor for r in rows))
    steps = sorted({r.step for r in rows})
    grid = [[float("nan")] * len(steps) for _ in tensors]
    t_index = {t: i for i, t in enumerate(tensors)}
    s_index = {s: i for i, s in enumerate(steps)}
    for r in rows:
        grid[t_index[r.tensor]][s_index[r.step]] = getattr(r, field)
    fig = Figure(figsize=(8, 1.5 + 0.25 * len(tensors)), constrained_layout=True)
    ax = fig.subplots()
    image = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="magma", interpolation="none")
    ax.set_yticks(range(len(tensors)), tensors, fontsize=8)
    ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("step")
    ax.set_title(title or f"{fmt}: fraction of entries ({field})")
    fig.colorbar(image, ax=ax, label=field)
    fig.savefig(path, dpi=100)
