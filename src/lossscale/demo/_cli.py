"""The ``lossscale`` command line (also ``python -m lossscale``): ``lossscale demo``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from lossscale._version import __version__
from lossscale.demo import _train
from lossscale.demo._progress import ProgressBar
from lossscale.demo._train import RunResult
from lossscale.numerics import heatmap, recommend

__all__ = [
    "build_parser",
    "format_percent",
    "format_scale",
    "format_report",
    "format_table",
    "heatmap_path",
    "main",
    "run_demo",
    "save_plot",
    "verdict",
]

PLOT_INSTALL_HINT = "pip install 'lossscale[plot]'  (or: pip install matplotlib)"

#: ``lossscale demo``'s default ``--report-every``.
REPORT_EVERY = 50

_UNSCALED_LABEL = "no loss scaling"
_SCALED_LABEL = "DynamicLossScale"


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_seed = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``lossscale`` command."""
    parser = argparse.ArgumentParser(
        prog="lossscale",
        description="lossscale command line (also available as: python -m lossscale).",
    )
    parser.add_argument(
        "--version", action="version", version=f"lossscale {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small float16 network with and without loss scaling, and compare",
        description=(
            "Train a 2-layer MLP in float16 with NumPy twice, on data whose float16 gradients "
            "underflow: once without loss scaling and once with lossscale.DynamicLossScale. "
            "Print the final loss, skipped steps and final scale of both runs."
        ),
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=_train.DEFAULT_STEPS,
        metavar="N",
        help=f"training steps per run (default: {_train.DEFAULT_STEPS})",
    )
    demo.add_argument(
        "--seed", type=_seed, default=0, metavar="S", help="seed of data and weights (default: 0)"
    )
    demo.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help=(
            "save the loss curves and the loss-scale trajectory, and the scaled run's float16 "
            f"underflow heatmap beside it (needs {PLOT_INSTALL_HINT})"
        ),
    )
    demo.add_argument(
        "--no-progress", action="store_true", help="do not draw progress bars on stderr"
    )
    demo.add_argument(
        "--report-every",
        type=_positive_int,
        default=REPORT_EVERY,
        metavar="N",
        help=(
            "sample the float16 numerics report every N steps and print it for the last "
            f"sampled step (default: {REPORT_EVERY})"
        ),
    )
    return parser


def format_scale(scale: float | None) -> str:
    """``-`` for no scale, ``2^k`` for a power of two, else three significant digits."""
    if scale is None:
        return "-"
    mantissa, exponent = math.frexp(scale)
    if mantissa == 0.5:
        return f"2^{exponent - 1}"
    return f"{scale:.3g}"


def format_percent(fraction: float) -> str:
    """``12.3%``, with more digits near 100% so that only exactly 1 reads ``100.0%``."""
    for digits in (1, 2, 3):
        text = f"{fraction:.{digits}%}"
        if fraction == 1 or not text.startswith("100."):
            return text
    return ">99.999%"


def format_table(unscaled: RunResult, scaled: RunResult) -> str:
    """The results of both runs as an aligned text table (no trailing newline)."""
    header = ["", "final loss", "vs. start", "skipped steps", "final scale", "zero fp16 grads"]
    rows = [header]
    for label, result in ((_UNSCALED_LABEL, unscaled), (_SCALED_LABEL, scaled)):
        rows.append(
            [
                label,
                f"{result.final_loss:.2e}",
                format_percent(result.final_loss / result.initial_loss),
                str(result.skipped),
                format_scale(result.final_scale),
                format_percent(result.zero_grad_fraction),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def verdict(unscaled: RunResult, scaled: RunResult) -> str:
    """One line that says which run won, from the numbers themselves."""
    zero = (
        f"{format_percent(unscaled.zero_grad_fraction)} of float16 gradient entries underflowed "
        "to zero"
    )
    if scaled.final_loss * 2 <= unscaled.final_loss:
        ratio = unscaled.final_loss / scaled.final_loss
        stalled = unscaled.final_loss > 0.5 * unscaled.initial_loss
        return (
            f"Verdict: DynamicLossScale's final loss is {ratio:.0f}x lower; without scaling "
            f"{zero}{' and training stalled' if stalled else ''}."
        )
    if unscaled.final_loss * 2 <= scaled.final_loss:
        return f"Verdict: the unscaled run ended lower this time ({zero} without scaling)."
    return (
        f"Verdict: no clear difference after {len(scaled.losses)} steps ({zero} without "
        "scaling); try more --steps."
    )


def save_plot(unscaled: RunResult, scaled: RunResult, path: Path) -> None:
    """Save both loss curves and the scaled run's loss scale (two subplots) as an image.

    Needs matplotlib (imported here, lazily; no pyplot, no GUI backend).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.5), constrained_layout=True)
    loss_ax, scale_ax = fig.subplots(2, 1, sharex=True)
    steps = range(1, len(unscaled.losses) + 1)
    loss_ax.plot(steps, unscaled.losses, label=f"float16, {_UNSCALED_LABEL}", color="tab:red")
    loss_ax.plot(steps, scaled.losses, label=f"float16 + {_SCALED_LABEL}", color="tab:blue")
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss (MSE)")
    loss_ax.set_title("float16 training: gradients underflow without loss scaling")
    loss_ax.legend()
    loss_ax.grid(True, which="major", alpha=0.3)

    scaled_steps = range(1, len(scaled.scales) + 1)
    scale_ax.plot(scaled_steps, scaled.scales, color="tab:blue", drawstyle="steps-post")
    if scaled.skipped_steps:
        scale_ax.plot(
            scaled.skipped_steps,
            [scaled.scales[step - 1] for step in scaled.skipped_steps],
            "x",
            color="tab:red",
            label=f"overflow: step skipped ({scaled.skipped})",
        )
        scale_ax.legend()
    scale_ax.set_yscale("log", base=2)
    scale_ax.set_ylabel("loss scale")
    scale_ax.set_xlabel("step")
    scale_ax.set_title(
        f"DynamicLossScale(initial_loss_scale=2**{int(math.log2(_train.INITIAL_LOSS_SCALE))}, "
        f"increment_period={_train.INCREMENT_PERIOD})"
    )
    scale_ax.grid(True, which="major", alpha=0.3)
    fig.savefig(path, dpi=100)


def format_report(unscaled: RunResult, scaled: RunResult) -> str:
    """Both runs' numerics tables at their last sampled step, and whether one float16 loss
    scale covers every tensor of the scaled run (no trailing newline)."""
    if unscaled.report is None or scaled.report is None or not scaled.report.rows:
        return ""
    parts = ["Where float16 loses the gradients (lossscale.numerics; the backward's results):"]
    for label, result in ((_UNSCALED_LABEL, unscaled), (_SCALED_LABEL, scaled)):
        assert result.report is not None
        parts.append(f"{label}: " + result.report.table())
    advice = str(recommend(scaled.report)).splitlines()[:2]
    parts.append("Recommendation: " + "\n".join(advice))
    return "\n\n".join(parts)


def heatmap_path(plot: Path) -> Path:
    """Where ``--plot OUT.png`` saves the scaled run's underflow heatmap: ``OUT-underflow.png``."""
    return plot.with_name(f"{plot.stem}-underflow{plot.suffix}")


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def run_demo(
    steps: int = _train.DEFAULT_STEPS,
    seed: int = 0,
    plot: Path | None = None,
    progress: bool = True,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    report_every: int = REPORT_EVERY,
) -> int:
    """Run ``lossscale demo``: train both runs, print the table and verdict, maybe plot.

    Args:
      steps: training steps per run.
      seed: seed of the data and initial weights.
      plot: where to save the figure (needs matplotlib; checked before training).
      progress: draw progress bars on ``stderr``.
      stdout: where the table goes (default ``sys.stdout``).
      stderr: where the progress bars and errors go (default ``sys.stderr``).
      report_every: sample the numerics report every this many steps.

    Returns:
      The exit code: 0 on success, 1 when the plot cannot be made.
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if plot is not None:
        if not _have_matplotlib():
            err.write(
                f"error: --plot needs matplotlib, which is not installed. Install it with:\n"
                f"    {PLOT_INSTALL_HINT}\n"
            )
            return 1
        if not plot.parent.is_dir():
            err.write(f"error: --plot: directory {str(plot.parent)!r} does not exist\n")
            return 1

    out.write(
        f"lossscale demo: a {_train.N_IN}-{_train.N_HIDDEN}-{_train.N_OUT} tanh MLP trained in "
        f"float16 with NumPy, {steps} SGD steps, seed {seed}.\n"
        f"Targets are ~{_train.TARGET_SCALE:g} and the loss averages {_train.BATCH}x{_train.N_OUT} "
        "squared errors, so its gradient per\n"
        "output is ~1e-8: below float16's smallest subnormal (6e-8), it underflows to zero unless "
        "the\nloss is scaled.\n\n"
    )
    out.flush()
    results: list[RunResult] = []
    for scaled, label in ((False, _UNSCALED_LABEL), (True, _SCALED_LABEL)):
        with ProgressBar(steps, f"{label:<16}", stream=err, enabled=progress) as bar:
            bar.update(0)
            results.append(
                _train.run(scaled, steps, seed, on_step=bar.update, report_every=report_every)
            )
    unscaled, scaled_run = results
    out.write(format_table(unscaled, scaled_run) + "\n\n" + verdict(unscaled, scaled_run) + "\n")
    out.write("\n" + format_report(unscaled, scaled_run) + "\n")
    if plot is not None:
        try:
            save_plot(unscaled, scaled_run, plot)
            underflow = heatmap_path(plot)
            if scaled_run.report is not None and scaled_run.report.rows:
                heatmap(
                    scaled_run.report,
                    underflow,
                    title=f"{_SCALED_LABEL}: float16 underflow per backward tensor",
                )
        except (OSError, ValueError) as exc:
            err.write(f"error: could not save the plot to {str(plot)!r}: {exc}\n")
            return 1
        out.write(f"Plot saved to {plot}\n")
        if scaled_run.report is not None and scaled_run.report.rows:
            out.write(f"Underflow heatmap saved to {underflow}\n")
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lossscale`` command; returns the exit code.

    Args:
      argv: the arguments after the program name; ``sys.argv[1:]`` when None.

    Without a command it prints the help on stderr and returns 2; usage errors also return 2
    (argparse prints the message), ``--help`` returns 0.

    Example:
      >>> from lossscale.demo import main
      >>> main(["demo", "--steps", "30", "--no-progress"])
      lossscale demo: a 4-48-32 tanh MLP trained in float16 with NumPy, 30 SGD steps, seed 0.
      ...
      DynamicLossScale ... 0 2^18 ...
      Verdict: DynamicLossScale's final loss is ...x lower; ...
      0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error that argparse has already printed
        return _exit_code(exc.code)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        return run_demo(args.steps, args.seed, args.plot, progress, report_every=args.report_every)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
