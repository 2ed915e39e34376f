"""A minimal single-line progress bar for the demo (stderr, redrawn in place with ``\\r``)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """Draw ``label [#####.....]  120/400  loss 1.23e-09`` on one line, updated in place.

    Nothing is written when ``enabled`` is False. The line is redrawn only when its text
    changes visibly (at most ``width + 1`` times, plus the last step), and
    :meth:`close` ends it with a newline. Usable as a context manager.

    Args:
      total: the number of steps that make a full bar (≥ 1).
      label: text before the bar.
      stream: where to draw; default ``sys.stderr`` (looked up when the bar is made).
      enabled: draw at all.
      width: characters inside the brackets.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 30,
    ) -> None:
        if total < 1:
            raise ValueError(f"total must be at least 1, got {total}")
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self._last_filled = -1
        self._last_length = 0
        self._closed = False

    def update(self, done: int, loss: float | None = None) -> None:
        """Show ``done`` of ``total`` steps, and ``loss`` when given."""
        if not self.enabled or self._closed:
            return
        done = max(0, min(done, self.total))
        filled = done * self.width // self.total
        if filled == self._last_filled and done != self.total:
            return
        self._last_filled = filled
        bar = "#" * filled + "." * (self.width - filled)
        digits = len(str(self.total))
        text = f"{self.label} [{bar}] {done:>{digits}}/{self.total}"
        if loss is not None:
            text += f"  loss {loss:.2e}"
        # Pad with spaces to wipe a longer previous line.
        padding = " " * max(0, self._last_length - len(text))
        self.stream.write("\r" + text + padding)
        self.stream.flush()
        self._last_length = len(text)

    def close(self) -> None:
        """End the line (once); later updates draw nothing."""
        if self.enabled and not self._closed and self._last_length:
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
