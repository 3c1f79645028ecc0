"""The live realtime sessions of one app, found by their tokens.

API process, pure. A session that outlives its connection is found again by
the tokens its ``video.start`` gave out: ``resume`` (the controller that
started it, to resume after a drop), ``watch`` (spectators) and ``control``
(further controllers of a ``shared_control`` session). Tokens are
``secrets.token_urlsafe`` (192 bits): unguessable, so a token is the whole
proof of access, and a wrong one finds nothing. An ended session's watch and
control tokens find nothing from its end on; its resume token finds it until
its end reached the client that holds the token, or for
``resume_grace_s`` where that client dropped first
(``rtvideo.server.live_session``), and then nothing.
"""

from __future__ import annotations

import secrets
from typing import Generic, Literal, TypeVar

TokenKind = Literal["resume", "watch", "control"]
Session = TypeVar("Session")
TOKEN_BYTES = 24


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


class SessionRegistry(Generic[Session]):
    def __init__(self) -> None:
        self._by_token: dict[tuple[TokenKind, str], Session] = {}
        self._tokens: dict[int, list[tuple[TokenKind, str]]] = {}  # id(session) -> its keys
        self._sessions: dict[int, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def add(self, session: Session, tokens: dict[TokenKind, str | None]) -> None:
        keys = [(kind, token) for kind, token in tokens.items() if token is not None]
        for key in keys:
            if key in self._by_token:
                raise ValueError(f"a {key[0]} token is already in use")
        for key in keys:
            self._by_token[key] = session
        self._tokens[id(session)] = keys
        self._sessions[id(session)] = session

    def remove(self, session: Session) -> None:
        for key in self._tokens.pop(id(session), []):
            self._by_token.pop(key, None)
        self._sessions.pop(id(session), None)

    def keep_only(self, session: Session, kind: TokenKind) -> None:
        """From now ``session`` is found by its token of ``kind`` alone."""
        keys = self._tokens.get(id(session), [])
        for key in [key for key in keys if key[0] != kind]:
            self._by_token.pop(key, None)
            keys.remove(key)

    def find(self, kind: TokenKind, token: str) -> Session | None:
        """The live session with this token of this kind, or None."""
        return self._by_token.get((kind, token))
