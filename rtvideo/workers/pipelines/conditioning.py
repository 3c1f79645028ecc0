"""Prompt conditioning across chunk boundaries, shared by every pipeline.

Worker process. A session's ``PromptBlend`` holds what its chunks are
conditioned on (embeddings of any array type with ``*`` and ``+``): a switch
with ``transition_chunks`` N >= 2 blends linearly, the j-th chunk after the
boundary (j = 0 .. N-1) weighing the new prompt by (j + 1) / N; 0 or 1 is a
hard cut. A switch in the middle of a transition blends from wherever the
conditioning was.

A model that knows only a list of prompts (a demo model: ``rtvideo.json``'s
``demo.prompts``) is conditioned on one of them whatever it is sent:
``nearest_known`` picks it by the words they share.
"""

from __future__ import annotations

import re
from typing import Any

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def nearest_known(prompt: str, known: tuple[str, ...]) -> str:
    """The prompt of ``known`` that ``prompt`` stands for: itself when it is one;
    else the one sharing the most words with it (words: runs of letters and
    digits, case ignored), the earliest in ``known`` among equals, so a prompt
    with no word in common gets the first. ``prompt`` itself when ``known`` is
    empty (a model that reads any text). Deterministic: a function of its arguments."""
    if not known or prompt in known:
        return prompt
    words = _words(prompt)
    return max(known, key=lambda candidate: len(words & _words(candidate)))


def blend(old: Any, new: Any, weight: float) -> Any:
    """The conditioning of a transition chunk: ``weight`` on the new prompt."""
    return (1.0 - weight) * old + weight * new


class PromptBlend:
    def __init__(self, initial: Any) -> None:
        self.target = initial  # where the conditioning is heading (or is)
        self.current: Any = None  # what the last prepared chunk used
        self._transition: tuple[Any, Any, int, int] | None = None  # (from, to, chunks, chunks done)

    def switch(self, new: Any, transition_chunks: int) -> None:
        """A new prompt from the next chunk on."""
        if transition_chunks <= 1:
            self.target, self._transition = new, None
        else:
            start = self.current if self.current is not None else self.target
            self._transition = (start, new, transition_chunks, 0)

    def next_chunk(self) -> Any:
        """The conditioning of the chunk being prepared."""
        if self._transition is None:
            self.current = self.target
            return self.current
        old, new, chunks, done = self._transition
        self.current = blend(old, new, (done + 1) / chunks)
        if done + 1 == chunks:
            self.target, self._transition = new, None
        else:
            self._transition = (old, new, chunks, done + 1)
        return self.current
