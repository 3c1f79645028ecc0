"""``rtvideo.engine.progress``: a bar on a terminal, nothing anywhere else, and stdout lines
printed through it as they would be without it."""

from __future__ import annotations

import io

import pytest

from rtvideo.engine.progress import Progress


class Terminal(io.StringIO):
    """A stream that says it is a terminal (and, closed, raises as a real one does)."""

    def isatty(self) -> bool:
        super().isatty()  # ValueError once closed
        return True


def test_on_a_terminal_the_bar_counts_and_says_what_runs():
    stream = Terminal()
    with Progress("eval-demo", unit="chunk", stream=stream) as progress:
        assert progress.shown
        progress.expect(4)
        progress.advance()
        progress.describe("loading the model")
        progress.advance(3)
    drawn = stream.getvalue()
    assert "eval-demo" in drawn and "loading the model" in drawn
    assert "0/4" in drawn and "4/4" in drawn and "chunk" in drawn
    assert drawn.endswith("\n")  # closed: the finished bar stays, the cursor on a line of its own


@pytest.mark.parametrize(
    ("stream", "quiet"),
    [(io.StringIO(), False), (Terminal(), True)],
    ids=["not a terminal", "--json on a terminal"],
)
def test_elsewhere_or_quiet_nothing_is_drawn(stream, quiet, capsys):
    with Progress("bench pp", 2, unit="config", quiet=quiet, stream=stream) as progress:
        assert not progress.shown
        progress.expect(3, done=1)
        progress.advance()
        progress.describe("pp2@4")
        progress.print("a line of the command's own")
    assert stream.getvalue() == ""
    assert capsys.readouterr().out == "a line of the command's own\n"


def test_a_closed_stream_is_no_terminal():
    stream = Terminal()
    stream.close()
    assert not Progress("convert", stream=stream).shown


def test_lines_printed_through_a_shown_bar_reach_stdout_whole(capsys):
    stream = Terminal()
    with Progress("train-demo", 10, unit="step", stream=stream) as progress:
        progress.advance(5)
        progress.print('{"step": 5, "loss": 0.1}')
    assert capsys.readouterr().out == '{"step": 5, "loss": 0.1}\n'
    assert "5/10" in stream.getvalue()
