"""Prompt conditioning across chunk boundaries, shared by every pipeline.

Worker process. A session's ``PromptBlend`` holds what its chunks are
conditioned on (embeddings of any array type with ``*`` and ``+``): a switch
with ``transition_chunks`` N >= 2 blends linearly, the j-th chunk after the
boundary (j = 0 .. N-1) weighing the new prompt by (j + 1) / N; 0 or 1 is a
hard cut. A switch in the middle of a transition blends from wherever the
conditioning was.
"""

from __future__ import annotations

from typing import Any


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
