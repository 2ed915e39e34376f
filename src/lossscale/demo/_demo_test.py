"""Tests of the demo: the float16 numerics, the training runs, the progress bar and the CLI."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lossscale.demo import _cli, _train
from lossscale.demo._progress import ProgressBar

# Few steps keep the tests fast; the scale still grows from 2**15 and training clearly separates.
STEPS = 120


@pytest.fixture(scope="module")
def runs() -> tuple[_train.RunResult, _train.RunResult]:
    return _train.run(False, STEPS, seed=0), _train.run(True, STEPS, seed=0)


# -- float16 conversions --------------------------------------------------------------------


def test_to_float32_matches_numpy_for_every_float16() -> None:
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    expected = halves.astype(np.float32)
    got = _train.to_float32(halves)
    assert got.dtype == np.float32
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def _assert_same_halves(x: np.ndarray) -> None:
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    got = _train.to_float16(x)
    assert got.dtype == np.float16 and got.shape == x.shape
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    mismatch = got[~nan].view(np.uint16) != expected[~nan].view(np.uint16)
    assert not mismatch.any(), (x[~nan][mismatch][:5], got[~nan][mismatch][:5])


def test_to_float16_matches_numpy_across_magnitudes() -> None:
    rng = np.random.default_rng(0)
    for exponent in range(-40, 20):
        _assert_same_halves((rng.standard_normal(5000) * 2.0**exponent).astype(np.float32))


def test_to_float16_matches_numpy_at_ties_and_edges() -> None:
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)].astype(np.float32)
    up = np.nextafter(finite, np.float32(np.inf))
    down = np.nextafter(finite, np.float32(-np.inf))
    # Exact midpoints between neighbouring float16 values (ties: round to even).
    ordered = np.unique(finite.astype(np.float64))
    midpoints = ((ordered[:-1] + ordered[1:]) / 2).astype(np.float32)
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, -65520, 1e30, 2**-25,
         3 * 2**-26, 2**-24, 2**-14, 2**-14 - 2**-25, 1e-45],
        dtype=np.float32,
    )  # fmt: skip
    for values in (finite, up, down, midpoints, specials):
        _assert_same_halves(values)


def test_to_float16_keeps_shape_and_sign_of_zero() -> None:
    x = np.array([[-0.0, 1e-9], [-1e-9, 3.0]], dtype=np.float32)
    got = _train.to_float16(x)
    assert got.shape == (2, 2)
    assert np.signbit(got).tolist() == [[True, False], [True, False]]


# -- training -------------------------------------------------------------------------------


def test_unscaled_float16_training_stalls(runs: tuple[_train.RunResult, _train.RunResult]) -> None:
    unscaled, _ = runs
    assert unscaled.scales == [] and unscaled.final_scale is None and unscaled.skipped == 0
    # Almost every float16 gradient entry underflows to zero, so the loss barely moves.
    assert unscaled.zero_grad_fraction > 0.95
    assert unscaled.final_loss > 0.8 * unscaled.initial_loss
    # And it has stopped moving at all by the end.
    assert unscaled.losses[-1] == pytest.approx(unscaled.losses[-20], rel=1e-3)


def test_scaled_float16_training_learns(runs: tuple[_train.RunResult, _train.RunResult]) -> None:
    unscaled, scaled = runs
    assert scaled.initial_loss == unscaled.initial_loss  # same data and initial weights
    assert scaled.zero_grad_fraction < 0.1  # the first step's, where the output layer is 0
    assert scaled.final_loss < 0.1 * scaled.initial_loss
    assert scaled.final_loss < 0.1 * unscaled.final_loss


def test_scaled_run_records_the_scale_trajectory(
    runs: tuple[_train.RunResult, _train.RunResult],
) -> None:
    _, scaled = runs
    assert len(scaled.scales) == len(scaled.losses) == STEPS
    assert scaled.scales[0] == _train.INITIAL_LOSS_SCALE
    # With finite gradients the scale doubles every INCREMENT_PERIOD steps.
    assert scaled.scales[_train.INCREMENT_PERIOD] == 2 * _train.INITIAL_LOSS_SCALE
    assert scaled.final_scale is not None and scaled.final_scale > scaled.scales[0]
    for step in scaled.skipped_steps:  # a skipped step backs the scale off
        following = scaled.scales[step] if step < STEPS else scaled.final_scale
        assert following == scaled.scales[step - 1] / 2


def test_scale_backs_off_on_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    # Started far above what float16 can hold for these gradients, the scale overflows, the
    # steps are skipped and it backs off until the gradients are finite; training goes on.
    monkeypatch.setattr(_train, "INITIAL_LOSS_SCALE", 2**60)
    scaled = _train.run(True, 40, seed=0)
    assert scaled.scales[0] == 2.0**60
    assert scaled.skipped_steps[:3] == [1, 2, 3]
    assert scaled.scales[:3] == [2.0**60, 2.0**59, 2.0**58]
    assert scaled.skipped < 40 and all(np.isfinite(scaled.losses))
    assert scaled.final_loss < 0.5 * scaled.initial_loss


def test_runs_are_deterministic() -> None:
    first = _train.run(True, 15, seed=3)
    second = _train.run(True, 15, seed=3)
    other = _train.run(True, 15, seed=4)
    assert first.losses == second.losses and first.scales == second.scales
    assert first.losses != other.losses


def test_on_step_is_called_every_step() -> None:
    calls: list[tuple[int, float]] = []
    result = _train.run(False, 5, seed=0, on_step=lambda done, loss: calls.append((done, loss)))
    assert [done for done, _ in calls] == [1, 2, 3, 4, 5]
    assert [loss for _, loss in calls] == result.losses


def test_run_rejects_no_steps() -> None:
    with pytest.raises(ValueError, match="steps"):
        _train.run(False, 0)


# -- progress bar ---------------------------------------------------------------------------


def test_progress_bar_draws_one_line_in_place() -> None:
    stream = io.StringIO()
    with ProgressBar(4, "run", stream=stream, width=4) as bar:
        for done in range(1, 5):
            bar.update(done, loss=1e-9)
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert "[####] 4/4  loss 1.00e-09" in text


def test_progress_bar_redraws_only_on_visible_change() -> None:
    stream = io.StringIO()
    bar = ProgressBar(1000, "run", stream=stream, width=10)
    for done in range(1, 1001):
        bar.update(done)
    bar.close()
    assert stream.getvalue().count("\r") == 11  # the empty bar, then each tenth


def test_disabled_progress_bar_writes_nothing() -> None:
    stream = io.StringIO()
    with ProgressBar(3, "run", stream=stream, enabled=False) as bar:
        bar.update(1)
        bar.update(3)
    assert stream.getvalue() == ""


# -- command line ---------------------------------------------------------------------------


def test_demo_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["demo", "--steps", "60", "--no-progress"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "final loss" in out and "skipped steps" in out and "final scale" in out
    lines = out.splitlines()
    unscaled_row = next(line for line in lines if line.startswith("no loss scaling"))
    scaled_row = next(line for line in lines if line.startswith("DynamicLossScale"))
    assert unscaled_row.split()[-2] == "-"  # no final scale without scaling
    assert scaled_row.split()[-2].startswith("2^")
    assert "Verdict: DynamicLossScale's final loss is" in out and "x lower" in out
    assert "\r" not in captured.err  # --no-progress


def test_demo_draws_progress_bars_on_stderr() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert _cli.run_demo(steps=8, progress=True, stdout=out, stderr=err) == 0
    assert err.getvalue().count("\n") == 2 and "\r" in err.getvalue()
    assert "\r" not in out.getvalue()


def test_no_command_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["demo", "--steps", "0"]) == 2
    assert _cli.main(["demo", "--seed", "x"]) == 2
    assert _cli.main(["frobnicate"]) == 2
    assert "usage" in capsys.readouterr().err


def test_help_returns_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["demo", "--help"]) == 0
    assert "--plot" in capsys.readouterr().out


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    argv = ["demo", "--steps", "30", "--no-progress", "--plot", str(path), "--report-every", "5"]
    assert _cli.main(argv) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    underflow = tmp_path / "demo-underflow.png"
    assert underflow.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert str(path) in out and str(underflow) in out


def test_plot_without_matplotlib_fails_before_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained although the plot cannot be made")

    monkeypatch.setattr(_train, "run", no_training)
    path = tmp_path / "demo.png"
    assert _cli.main(["demo", "--steps", "5", "--no-progress", "--plot", str(path)]) == 1
    captured = capsys.readouterr()
    assert "matplotlib" in captured.err and "pip install" in captured.err
    assert captured.out == "" and not path.exists()


def test_plot_into_a_missing_directory_fails_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "missing" / "demo.png"
    assert _cli.main(["demo", "--steps", "5", "--no-progress", "--plot", str(path)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_format_percent() -> None:
    assert _cli.format_percent(0.123) == "12.3%"
    assert _cli.format_percent(0.99981) == "99.98%"
    assert _cli.format_percent(0.999996) == ">99.999%"
    assert _cli.format_percent(1.0) == "100.0%"


def test_format_scale() -> None:
    assert _cli.format_scale(None) == "-"
    assert _cli.format_scale(32768.0) == "2^15"
    assert _cli.format_scale(3.0) == "3"


def test_python_dash_m_lossscale() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lossscale", "demo", "--steps", "3", "--no-progress"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "DynamicLossScale" in done.stdout
    bare = subprocess.run(
        [sys.executable, "-m", "lossscale"], capture_output=True, text=True, timeout=120
    )
    assert bare.returncode == 2 and "usage" in bare.stderr


# -- the numerics report ----------------------------------------------------------------------


def test_the_report_shows_where_float16_loses_the_gradients() -> None:
    """Without scaling the loss gradient underflows entirely (and all below it is zero); at
    the dynamic scale nothing underflows. Sampling changes nothing in the training."""
    plain = _train.run(scaled=False, steps=30, report_every=10)
    scaled = _train.run(scaled=True, steps=360, report_every=350)
    assert plain.report is not None and scaled.report is not None
    assert plain.report.steps == [0, 10, 20] and scaled.report.steps == [0, 350]
    first = {r.tensor: r for r in plain.report.latest(step=0)}
    assert first["output"].underflow > 0.99 and first["output"].loss_scale == 1.0
    assert first["hidden"].zeros == 1.0  # the output layer starts at zero
    at_scale = scaled.report.latest()
    assert at_scale[0].loss_scale == scaled.scales[350]
    assert all(r.underflow == 0 and r.overflow == 0 for r in at_scale)
    assert _train.run(scaled=True, steps=360).losses == scaled.losses


def test_demo_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["demo", "--steps", "30", "--no-progress", "--report-every", "10"]) == 0
    out = capsys.readouterr().out
    assert "no loss scaling: step 20, loss scale 2^0, float16: 1 of 7 tensors lose entries" in out
    assert "DynamicLossScale: step 20, loss scale 2^" in out
    assert "Recommendation: float16 at step 20" in out
