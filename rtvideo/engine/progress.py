"""Progress bars for the ``rtvideo`` commands that run long: the benchmarks
(``bench engine``, ``pipeline``, ``pp``, ``realtime``), ``train-demo``,
``eval-demo``, ``refine-demo-decoder`` and ``convert``.

Pure Python (tqdm), here because commands of both sides use it: the
benchmarks (``bench``), the demo model's training (``rtvideo.training.demo``) and
the checkpoint converter (``rtvideo.workers.convert``).
A bar is drawn on stderr, and only where stderr is a terminal and the command
was not asked for its JSON alone (``--json``): piped output, logs, CI and the
tests see exactly what they saw without it, and stdout, whose last line is a
command's JSON summary, is never drawn on.
"""

from __future__ import annotations

import io
import os
import sys
from types import TracebackType
from typing import TextIO

from tqdm import tqdm


class _Bar(tqdm):
    monitor_interval = 0  # no monitor thread: the benchmarks start worker processes


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal someone watches (False for a closed stream)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed
        return False


def _size(stream: TextIO) -> tuple[int, int]:
    """The terminal's columns and lines; 0 where it says none or is not one."""
    try:
        return tuple(os.get_terminal_size(stream.fileno()))
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return 0, 0


class Progress:
    """One command's bar, used as a context manager (closed at the end).

    ``description`` names the command, ``total`` counts ``unit``s (None while
    unknown: ``expect`` gives it later). Callers ``advance`` it as work
    completes, ``describe`` what runs now, and ``print`` their own stdout lines
    through it (so a line does not land in the middle of the bar). Where the
    bar is not shown (``shown`` False: ``quiet``, or ``stream`` (default
    stderr) not a terminal) ``advance``, ``describe`` and ``expect`` do
    nothing and ``print`` prints, so a caller never asks."""

    def __init__(
        self,
        description: str,
        total: float | None = None,
        *,
        unit: str = "it",
        quiet: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        stream = sys.stderr if stream is None else stream
        self.shown = not quiet and is_terminal(stream)
        self._bar = None
        if self.shown:
            # The terminal's size as it changes; 80x24 where it says none (a new pseudo-terminal says 0x0,
            # which tqdm would take as no room for a bar).
            size = {"dynamic_ncols": True} if all(_size(stream)) else {"ncols": 80, "nrows": 24}
            self._bar = _Bar(total=total, desc=description, unit=unit, file=stream, **size)

    @classmethod
    def silent(cls) -> Progress:
        """A bar never shown: the default of functions that take one."""
        return cls("", quiet=True)

    def expect(self, total: float, done: float | None = None) -> None:
        """The total, once known (or changed); ``done``: how much of it is done already."""
        if self._bar is not None:
            self._bar.total = total
            if done is not None:
                self._bar.n = done
            self._bar.refresh()

    def advance(self, amount: float = 1) -> None:
        """``amount`` more units done."""
        if self._bar is not None:
            self._bar.update(amount)

    def describe(self, text: str) -> None:
        """What runs now, after the figures (empty: nothing)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def print(self, line: str) -> None:
        """``line`` on stdout, flushed (the bar cleared first and drawn again after)."""
        if self._bar is None:
            print(line, flush=True)
        else:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
