"""Report: rows, the log files, the table, the heatmap and the recommendation."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from lossscale.numerics import Report, heatmap, recommend, tensor_stats

FORMATS = ("float16", "float8_e4m3fn")


def _grads(scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "big": (rng.standard_normal(1000) * scale).astype(np.float32),
        "small": (rng.standard_normal(1000) * 1e-9 * scale).astype(np.float32),
        "tiny": (rng.standard_normal(100) * 1e-13 * scale).astype(np.float32),
    }


def test_record_matches_tensor_stats_and_logs_every_row(tmp_path: Path) -> None:
    jl, cv = tmp_path / "r.jsonl", tmp_path / "r.csv"
    reports = [Report(FORMATS, every=2, path=p) for p in (jl, cv)]
    for report in reports:
        for step, scale in ((0, 1.0), (2, 2.0**16)):
            report.record(step, _grads(scale), loss_scale=scale)
        report.close()
    rows = reports[0].rows
    assert len(rows) == 2 * 3 * len(FORMATS)
    for r in rows:
        want = tensor_stats(_grads(r.loss_scale)[r.tensor], formats=r.format)[r.format]
        assert tuple(r[4:]) == tuple(want)
    lines = [json.loads(line) for line in jl.read_text().splitlines()]
    assert [(d["step"], d["tensor"], d["format"]) for d in lines] == [r[:3] for r in rows]
    assert lines[0]["exponents"]["source"] == "float32"
    with cv.open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and float(table[-1]["underflow"]) == rows[-1].underflow


def test_a_row_is_its_stats_with_where_and_when() -> None:
    # Report.add builds a row as (step, tensor, format, loss_scale, *stats): the fields must
    # stay in TensorStats' order for that to hold.
    from lossscale.numerics import ReportRow, TensorStats

    assert ReportRow._fields == ("step", "tensor", "format", "loss_scale", *TensorStats._fields)


def test_table_names_the_worst_tensors_first() -> None:
    report = Report(FORMATS)
    report.record(0, _grads(1.0))
    text = report.table()
    lines = text.splitlines()
    assert lines[0] == "step 0, loss scale 2^0, float16: 2 of 3 tensors lose entries"
    assert [line.split()[0] for line in lines[2:]] == ["small", "tiny", "big"]  # ties by name
    assert "100.0%" in lines[2] and "100.0%" in lines[3]
    assert Report().table() == "no sampled step"


def test_recommendation_states_the_ranges() -> None:
    report = Report(FORMATS)
    report.record(0, _grads(2.0**10), loss_scale=2.0**10)
    rec = recommend(report)
    assert rec.covering is None and rec.uncovered  # 1e-13 and 1 cannot share a float16 scale
    assert rec.ranges["big"].high == 2.0**14  # |g| up to ~3.5: 2**14 * 3.5 < 65504
    small = rec.ranges["small"]
    assert small.low is not None and small.low <= 2.0**24 and small.covers(2.0**30)
    assert rec.float8["float8_e4m3fn"]["big"][0] == 2.0**6  # 3.5 * 2**7 would pass 464
    assert "no single loss scale covers all 3 tensors" in str(rec)
    one = Report(FORMATS)
    one.record(0, {"big": _grads(1.0)["big"]})
    assert recommend(one).covering is not None
    with pytest.raises(ValueError, match="underflow must be in"):
        recommend(report, underflow=1.0)
    with pytest.raises(ValueError, match="no sampled step"):
        recommend(Report())


def test_heatmap_writes_an_image(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = Report()
    for step in range(3):
        report.record(step, _grads(4.0**step))
    heatmap(report, tmp_path / "h.png", format="float16", title="t")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="field must be one of"):
        heatmap(report, tmp_path / "h.png", field="amax")
    with pytest.raises(ValueError, match="no rows for 'float16'"):
        heatmap(Report(), tmp_path / "h.png")


def test_heatmap_colours_set_apart_fractions_near_the_threshold_and_columns_show_the_scale(
    tmp_path: Path,
) -> None:
    """A log colour scale: 0.05% and 0.2% underflow (either side of recommend's 0.1%) get
    clearly different colours, where a linear scale from 0 to 1 gave them the same; the colour
    bar reads in percent and marks 0.1%; each column is labelled with its loss scale."""
    pytest.importorskip("matplotlib")
    from matplotlib.colors import SymLogNorm

    report = Report(("float16",))
    fractions = [0.0, 5e-4, 2e-3, 0.3]
    for step, fraction in enumerate(fractions):
        g = np.full(10_000, 1e-3, np.float32)
        g[: round(fraction * g.size)] = 1e-12  # underflows in float16 at these scales
        report.record(10 * step, {"w": g}, loss_scale=2.0 ** (12 + step))
    figure = heatmap(report, tmp_path / "h.png")
    ax, bar = figure.axes
    image = ax.images[0]
    assert isinstance(image.norm, SymLogNorm)
    assert image.get_array()[0].tolist() == fractions
    colours = [image.norm(f) for f in fractions]
    assert colours[0] == 0.0 and colours[-1] < 1.0 and colours == sorted(colours)
    assert colours[2] - colours[1] > 0.05  # 0.05% and 0.2%: the linear scale put 0.0015 apart
    (top,) = ax.child_axes  # the loss scale of each column, above it
    assert [t.get_text() for t in top.get_xticklabels()] == ["2^12", "2^13", "2^14", "2^15"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "10", "20", "30"]
    labels = [t.get_text() for t in bar.get_yticklabels()]
    assert labels == ["0", "0.001%", "0.01%", "0.1%", "1%", "10%", "100%"]
    assert [line.get_ydata()[0] for line in bar.lines] == [1e-3]  # the threshold, marked


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="every must be an int, got float"):
        Report(every=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"path must end in \.jsonl or \.csv"):
        Report(path="log.txt")
    with pytest.raises(TypeError, match="tensor 'w': expected a NumPy, torch or JAX array"):
        Report().record(0, {"w": [1.0]})
    assert math.isinf(Report().every * math.inf)
