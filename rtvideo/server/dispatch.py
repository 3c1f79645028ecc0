"""Dispatch by type: one table per message family, from a message's type to its handler.

API process, pure Python. A module that acts on several types of one family
(a session's engine results, a connection's client events) builds one
``TypeDispatcher`` of bound handlers when its object is made, instead of an
``isinstance`` chain: adding a type to the family is one entry in the table,
and ``tests/unit/test_dispatch_tables.py`` fails for a type of the family
that has none. A type is looked up exactly (``type(message)``): wire types and
client events are final, never subclassed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

R = TypeVar("R")


class UnhandledMessageError(TypeError):
    """A message whose type has no handler in its family's table: a server bug
    (a type added to the family without a handler), never a client's mistake.
    The text names the family, the type, and the types it handles."""

    def __init__(self, family: str, message: object, handled: Iterable[type]) -> None:
        known = ", ".join(sorted(t.__name__ for t in handled))
        super().__init__(f"{family}: no handler for a {type(message).__name__} message (handled: {known})")
        self.family = family
        self.message_type = type(message)


class TypeDispatcher(Generic[R]):
    """Calls the handler registered for a message's exact type and returns what it
    returns. ``family`` names the table in errors. A message of a type without
    a handler goes to ``on_unknown`` when given (a client event: the protocol's
    own error reply), else raises ``UnhandledMessageError``."""

    def __init__(
        self,
        family: str,
        handlers: Mapping[type, Callable[[Any], R]],
        on_unknown: Callable[[Any], R] | None = None,
    ) -> None:
        self.family = family
        self._handlers = dict(handlers)
        self._on_unknown = on_unknown

    @property
    def types(self) -> frozenset[type]:
        """The types this table has a handler for."""
        return frozenset(self._handlers)

    def __call__(self, message: Any) -> R:
        handler = self._handlers.get(type(message))
        if handler is not None:
            return handler(message)
        if self._on_unknown is not None:
            return self._on_unknown(message)
        raise UnhandledMessageError(self.family, message, self._handlers)
