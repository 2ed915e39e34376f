"""``Report``: the rows of sampled steps, their log file, the table of the worst tensors."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from lossscale.core._backends import namespace_of
from lossscale.numerics._counts import TensorStats, count_row, decode_row, histogram, targets_of
from lossscale.numerics._formats import float_format

__all__ = ["Counted", "Report", "ReportRow", "format_scale"]


class ReportRow(NamedTuple):
    """One tensor at one sampled step against one format (the fields of
    :class:`~lossscale.numerics.TensorStats`, with where and when).

    Attributes:
      step: the step number the front end counted (0 is the first step).
      tensor: the tensor's name (a parameter's, or ``module:<name>`` for a module's incoming
        gradient).
      format: the format cast to.
      loss_scale: the loss scale in use at that step (1.0 without scaling). The tensor holds
        the gradients as the scaled backward left them, already multiplied by it.
      scale: the factor the report applied before the cast (1.0 in the front ends).

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import Report
      >>> report = Report()
      >>> report.record(7, {"w": np.array([1e-9, 1.0], np.float32)}, loss_scale=1.0)
      >>> row = report.rows[0]
      >>> row.step, row.tensor, row.format, row.underflow
      (7, 'w', 'float16', 0.5)
    """

    step: int
    tensor: str
    format: str
    loss_scale: float
    underflow: float
    subnormal: float
    overflow: float
    zeros: float
    nonfinite: float
    amax: float
    headroom_max: float
    headroom_normal: float
    size: int
    scale: float


class Counted(NamedTuple):
    """Rows counted by :meth:`Report.count` and not read yet."""

    entries: list[tuple[str, str, int, int]]  # (tensor, source dtype, size, row length) each
    ints: Any  # every row, then the loss scale's float32 bits when it was an array; 1-D
    scale: float | None  # the loss scale, or None when its bits end ``ints``


class Exponents(NamedTuple):
    """A tensor's exponent-field histogram at one step (what recommendations are made from):
    ``counts[e]`` entries have the exponent field ``e`` in the ``source`` dtype (0: zeros, of
    which there are ``zeros``, and subnormals).

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import Report
      >>> report = Report()
      >>> report.record(0, {"w": np.array([0.0, 1.0, 1.5], np.float16)})
      >>> e = report.exponents[(0, "w")]
      >>> e.source, e.zeros, e.counts[0], e.counts[15]  # 1.0 and 1.5: field 15 (bias 15)
      ('float16', 1, 1, 2)
    """

    source: str
    zeros: int
    counts: tuple[int, ...]


def format_scale(scale: float) -> str:
    """A loss scale as the reports print it: ``2^k`` for a power of two, else three
    significant digits.

    Example:
      >>> from lossscale.numerics import format_scale
      >>> format_scale(65536.0), format_scale(1.0), format_scale(3.0)
      ('2^16', '2^0', '3')
    """
    if scale > 0 and math.isfinite(scale):
        mantissa, exponent = math.frexp(scale)
        if mantissa == 0.5:
            return f"2^{exponent - 1}"
    return f"{scale:.3g}"


def _percent(fraction: float) -> str:
    if fraction == 0:
        return "0"
    text = f"{fraction:.1%}"
    return text if text not in ("0.0%", "100.0%") or fraction == 1 else f"{fraction:.3%}"


class Report:
    """The numerics of sampled steps: one :class:`ReportRow` per tensor per format per step.

    Front ends fill it (``lossscale.torch.NumericsMonitor``, ``lossscale.jax.record``,
    ``lossscale.keras.NumericsCallback``); :meth:`record` counts named arrays and :meth:`add`
    takes one tensor's stats by hand. :meth:`table` prints the worst tensors;
    :func:`~lossscale.numerics.heatmap` draws them over the steps and
    :func:`~lossscale.numerics.recommend` says which scales fit.

    Args:
      formats: the formats to report against (names or dtypes, as for :func:`tensor_stats`).
      every: sample every ``every``-th step (steps 0, every, 2 * every, ...).
      path: a ``.jsonl`` or ``.csv`` file that gets each row as it is added (appended to; a
        CSV's header is written when the file is new). JSON lines also carry each tensor's
        exponent histogram (``"exponents"``).

    Raises:
      TypeError: ``every`` is not an int, or ``path`` is not a path.
      ValueError: ``every`` < 1, ``path`` has another suffix, or a format is unknown.

    Example:
      >>> import numpy as np
      >>> from lossscale.numerics import Report, tensor_stats
      >>> report = Report(("float16",), every=10)
      >>> report.due(0), report.due(5), report.due(20)
      (True, False, True)
      >>> g = np.array([1e-9, 1e-3, 2e-3, 0.0], np.float32)
      >>> report.add(0, "w", tensor_stats(g))
      >>> report.rows[0].underflow
      0.25
    """

    def __init__(
        self,
        formats: Any = ("float16",),
        *,
        every: int = 1,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.formats = targets_of(formats)
        if isinstance(every, bool) or not isinstance(every, int):
            raise TypeError(f"every must be an int, got {type(every).__name__}")
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self.rows: list[ReportRow] = []
        #: ``(step, tensor) -> Exponents``, for :meth:`recommend`.
        self.exponents: dict[tuple[int, str], Exponents] = {}
        self.path: Path | None = None
        self._file: IO[str] | None = None
        self._csv: Any = None
        if path is not None:
            if not isinstance(path, str | os.PathLike):
                raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
            self.path = Path(path)
            if self.path.suffix not in (".jsonl", ".csv"):
                raise ValueError(f"path must end in .jsonl or .csv, got {str(path)!r}")

    def due(self, step: int) -> bool:
        """Whether step ``step`` is sampled (``step % every == 0``)."""
        return step % self.every == 0

    @property
    def steps(self) -> list[int]:
        """The sampled steps, in order."""
        return sorted({row.step for row in self.rows})

    def add(
        self,
        step: int,
        tensor: str,
        stats: Mapping[str, TensorStats],
        *,
        loss_scale: float = 1.0,
        exponents: Exponents | None = None,
    ) -> None:
        """Add one tensor's stats (``{format: TensorStats}``) at ``step``."""
        for fmt, s in stats.items():
            self._append(ReportRow(step, tensor, fmt, float(loss_scale), *s), exponents)
        if exponents is not None:
            self.exponents[(step, tensor)] = exponents

    def add_rows(
        self,
        step: int,
        entries: Sequence[tuple[str, str, int, Sequence[int]]],
        *,
        loss_scale: float = 1.0,
    ) -> None:
        """Add the count rows of a front end, read back to the host: ``(tensor, source dtype,
        size, row)`` each, counted at scale 1 against this report's formats."""
        for name, source, size, row in entries:
            stats = decode_row(row, source, self.formats, size)
            zeros = int(row[0])
            counts = tuple(histogram(row, len(self.formats)))
            self.add(
                step, name, stats, loss_scale=loss_scale, exponents=Exponents(source, zeros, counts)
            )

    def record(self, step: int, tensors: Any, *, loss_scale: Any = 1.0) -> None:
        """Count and add named tensors at ``step``, against this report's formats at scale 1.

        Args:
          step: the step number.
          tensors: ``{name: array}`` or ``(name, array)`` pairs, all of one library (NumPy,
            torch or JAX); their counts are gathered on the first one's device.
          loss_scale: the loss scale the tensors were produced with: a number, or a 0-d
            float32 array of their library (read back with the counts).

        Host syncs: one (all rows and the scale come back in one transfer). Device work:
        :func:`~lossscale.numerics._counts.count_row` per tensor and one concatenation.
        :meth:`count` and :meth:`add_counted` are its two halves, for a caller that reads the
        rows together with other values.

        Raises:
          TypeError: a tensor is not a floating-point array of a known library.
        """
        counted = self.count(tensors, loss_scale=loss_scale)
        if counted.entries:
            self.add_counted(step, counted, counted.ints.tolist())  # the one host read

    def count(self, tensors: Any, *, loss_scale: Any = 1.0) -> Counted:
        """:meth:`record`'s device half: the rows of ``tensors`` (same arguments) in one 1-D
        integer array of their library, not read (no host sync; the tensors may be let go).
        No tensors: no entries, ``ints`` None.

        Raises:
          TypeError: a tensor is not a floating-point array of a known library.
        """
        pairs = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        if not pairs:
            return Counted([], None, None)
        xp = namespace_of(pairs[0][1])
        if xp is None:
            raise TypeError(
                f"tensor {pairs[0][0]!r}: expected a NumPy, torch or JAX array, "
                f"got {type(pairs[0][1]).__name__}"
            )
        rows = [count_row(x, self.formats, xp=xp) for _, x in pairs]
        scale_on_device = namespace_of(loss_scale) is xp and xp.name != "numpy"
        parts = [*rows, xp.bits(xp.float32(loss_scale))] if scale_on_device else rows
        # rows of tensors on other devices (model parallel) join the first one's: small copies
        parts = [p if xp.same_place(p, parts[0]) else xp.move(p, parts[0]) for p in parts]
        entries = [
            (name, xp.dtype_name(x), math.prod(x.shape), row.shape[0])
            for (name, x), row in zip(pairs, rows, strict=True)
        ]
        scale = None if scale_on_device else float(loss_scale)
        return Counted(entries, xp.stack_ints(parts), scale)

    def add_counted(self, step: int, counted: Counted, values: Sequence[int]) -> None:
        """:meth:`record`'s host half: add the rows of ``counted`` at ``step`` from
        ``values``, its ``ints`` read on the host (a sequence of ints)."""
        entries, start = [], 0
        for name, source, size, n in counted.entries:
            entries.append((name, source, size, values[start : start + n]))
            start += n
        scale = counted.scale
        if scale is None:
            scale = float_format("float32").value(int(values[-1]))
        self.add_rows(step, entries, loss_scale=scale)

    def _append(self, row: ReportRow, exponents: Exponents | None) -> None:
        self.rows.append(row)
        if self.path is None:
            return
        if self._file is None:
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._file = self.path.open("a", encoding="utf-8", newline="")
            if self.path.suffix == ".csv":
                self._csv = csv.writer(self._file)
                if new:
                    self._csv.writerow(ReportRow._fields)
        if self._csv is not None:
            self._csv.writerow(row)
        else:
            record: dict[str, Any] = row._asdict()
            for key in ("headroom_max", "headroom_normal"):  # JSON has no inf
                if not math.isfinite(record[key]):
                    record[key] = None
            if exponents is not None:
                record["exponents"] = {
                    "source": exponents.source,
                    "zeros": exponents.zeros,
                    "counts": {str(i): c for i, c in enumerate(exponents.counts) if c},
                }
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the log file (a later row opens it again, appending)."""
        if self._file is not None:
            self._file.close()
            self._file, self._csv = None, None

    def latest(self, format: str | None = None, step: int | None = None) -> list[ReportRow]:
        """The rows of one step (the last sampled when None) against one format (the first)."""
        fmt = self.formats[0] if format is None else targets_of(format, "format")[0]
        if not self.rows:
            return []
        when = self.steps[-1] if step is None else step
        return [r for r in self.rows if r.step == when and r.format == fmt]

    def table(self, format: str | None = None, step: int | None = None, top: int = 10) -> str:
        """The ``top`` worst tensors of one step (the last when None) as an aligned text table,
        worst first (by underflow plus overflow, then non-finite entries, then subnormals)."""
        rows = self.latest(format, step)
        if not rows:
            return "no sampled step"
        fmt, when, scale = rows[0].format, rows[0].step, rows[0].loss_scale
        losing = [r for r in rows if r.underflow or r.overflow or r.nonfinite]
        rows = sorted(
            rows, key=lambda r: (-(r.underflow + r.overflow), -r.nonfinite, -r.subnormal, r.tensor)
        )
        head = (
            f"step {when}, loss scale {format_scale(scale)}, {fmt}: {len(losing)} of "
            f"{len(rows)} tensors lose entries"
        )
        header = ["tensor", "entries", "zeros", "underflow", "subnormal", "overflow", "amax"]
        header.append("headroom")
        cells = [header]
        for r in rows[:top]:
            cells.append(
                [
                    r.tensor,
                    str(r.size),
                    _percent(r.zeros),
                    _percent(r.underflow),
                    _percent(r.subnormal),
                    _percent(r.overflow + r.nonfinite),
                    f"{r.amax:.3g}",
                    f"{r.headroom_max:+.1f}" if math.isfinite(r.headroom_max) else "-",
                ]
            )
        widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
        lines = [head]
        for c in cells:
            line = [c[0].ljust(widths[0])] + [
                v.rjust(w) for v, w in zip(c[1:], widths[1:], strict=True)
            ]
            lines.append("  ".join(line).rstrip())
        if len(rows) > top:
            lines.append(f"... and {len(rows) - top} more")
        return "\n".join(lines)
