"""The operator's prompt policy: which prompts this server refuses.

API process. Off unless ``--prompt-policy`` (``RTVIDEO_PROMPT_POLICY``) names
one; then every prompt that reaches the server is checked before anything is
started or queued: a realtime session's ``prompt`` and ``negative_prompt``, each
``session.interaction``'s prompt (the owner's and a shared controller's), and a
job's prompt, negative prompt and scheduled prompts. A refused prompt gets
``prompt_refused`` naming the field and the policy's reason (a fatal error at a
start, a non-fatal one for an interaction, HTTP 400 for a job); nothing else of
the session or the server is touched. Two kinds:

- a JSON file, ``{"deny": ["regex", ...], "reason": "..."}``: a prompt is
  refused when any pattern matches anywhere in it (Python ``re``, case
  ignored); ``reason`` is what the client is told (default: "it matches a
  pattern this server refuses"), never which pattern matched;
- ``module:function``, importable in the API process: called with each prompt
  (``str``), it returns None to take it or the reason to refuse it (a string),
  or an awaitable of either (a moderation service's client). A plain function
  runs on one of ``POLICY_THREADS`` daemon threads of its own: one that hangs
  holds one of them, never the threads that encode every session's media, and
  never holds the process at exit. One that raises, answers anything else, or takes longer
  than ``prompt_policy_timeout_s`` refuses the prompt ("the prompt check
  failed"), logged with its cause: the policy fails closed.

``load_prompt_policy`` reads it at start; ``PromptPolicyError`` names what is
wrong (a missing or malformed file, a pattern that does not compile, a
function that cannot be imported), and the server does not start.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import logging
import queue
import re
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POLICY_THREADS = 4
DEFAULT_REASON = "it matches a pattern this server refuses"
CHECK_FAILED = "the prompt check failed"


class PromptPolicyError(ValueError):
    """A prompt policy that cannot be loaded: ``spec`` (what named it) and ``what``
    is wrong; the message says both."""

    def __init__(self, spec: object, what: str) -> None:
        super().__init__(f"prompt policy {spec}: {what}")
        self.spec, self.what = str(spec), what


class PromptRefused(Exception):
    """A prompt the policy refuses: ``field`` (``prompt``, ``negative_prompt``,
    ``interaction.event.prompt``, a job's ``interactions[1].prompt``) and the policy's ``reason``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: refused by this server's prompt policy: {reason}")
        self.field, self.reason = field, reason


class PromptPolicy:
    """A loaded policy: ``check`` refuses the first field whose text it refuses."""

    def __init__(self, name: str, judge: Callable[[str], Awaitable[str | None]], timeout_s: float) -> None:
        self.name, self._judge, self.timeout_s = name, judge, timeout_s

    async def check(self, fields: Mapping[str, str | None]) -> None:
        """``PromptRefused`` for the first of ``fields`` (name -> text; None or
        blank: nothing to check) that the policy refuses, in order."""
        for field, text in fields.items():
            if text is None or not text.strip():
                continue
            try:
                async with asyncio.timeout(self.timeout_s):
                    reason = await self._judge(text)
            except TimeoutError:
                log.warning("prompt policy %s: no answer within %g s for %s; refused", self.name, self.timeout_s, field)
                reason = CHECK_FAILED
            except Exception as error:  # any failure of the operator's check refuses: the policy fails closed
                log.warning(
                    "prompt policy %s failed on %s (%s: %s); refused", self.name, field, type(error).__name__, error
                )
                reason = CHECK_FAILED
            if reason is not None and not isinstance(reason, str):
                log.warning(
                    "prompt policy %s answered %r for %s, not a reason or None; refused", self.name, reason, field
                )
                reason = CHECK_FAILED
            if reason is not None:
                log.info("prompt policy %s refused %s", self.name, field)
                raise PromptRefused(field, reason or DEFAULT_REASON)


def deny_list(path: Path, timeout_s: float) -> PromptPolicy:
    """The JSON file's policy (see the module's docstring)."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PromptPolicyError(path, f"cannot be read ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PromptPolicyError(path, f"not a JSON file ({error})") from None
    if not isinstance(spec, dict) or set(spec) - {"deny", "reason"} or not isinstance(spec.get("deny"), list):
        raise PromptPolicyError(
            path,
            f'expected an object {{"deny": ["pattern", ...], "reason": "..."}} '
            f"(reason optional), got {json.dumps(spec)[:200]}",
        )
    reason = spec.get("reason", DEFAULT_REASON)
    if not isinstance(reason, str) or not reason.strip():
        raise PromptPolicyError(path, f"reason must be a non-blank string, got {reason!r}")
    patterns = []
    for index, pattern in enumerate(spec["deny"]):
        if not isinstance(pattern, str) or not pattern:
            raise PromptPolicyError(path, f"deny[{index}] must be a non-empty string, got {pattern!r}")
        try:
            patterns.append(re.compile(pattern, re.IGNORECASE))
        except re.error as error:
            raise PromptPolicyError(path, f"deny[{index}] {pattern!r} is no regex ({error})") from None

    async def judge(text: str) -> str | None:
        return reason if any(pattern.search(text) for pattern in patterns) else None

    return PromptPolicy(str(path), judge, timeout_s)


class PolicyThreads:
    """``size`` daemon threads that run a plain policy function, apart from the
    event loop's default executor (media encoding, frame decoding use that one):
    calls beyond them queue, and a call that hangs holds its thread only. The
    threads start with the first call (a policy loaded only to be checked starts none)."""

    def __init__(self, size: int) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.size = size
        self.threads: list[threading.Thread] = []

    def run(self, function: Callable[[str], Any], text: str) -> asyncio.Future:
        """``function(text)`` on one of the threads; its answer (or exception) on the returned future."""
        if not self.threads:
            self.threads = [
                threading.Thread(target=self._serve, name=f"prompt-policy-{i}", daemon=True) for i in range(self.size)
            ]
            for thread in self.threads:
                thread.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, function, text))
        return future

    def _serve(self) -> None:
        while True:
            loop, future, function, text = self._calls.get()
            try:
                outcome, failed = function(text), False
            except Exception as error:  # handed to the awaiting check, which refuses
                outcome, failed = error, True
            try:
                loop.call_soon_threadsafe(_settle, future, outcome, failed)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass


def _settle(future: asyncio.Future, outcome: Any, failed: bool) -> None:
    if not future.done():  # a check that timed out cancelled it
        future.set_exception(outcome) if failed else future.set_result(outcome)


def function_policy(spec: str, timeout_s: float) -> PromptPolicy:
    """``module:function``'s policy (see the module's docstring)."""
    module_name, _, attribute = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except Exception as error:  # an import error of any kind names the spec
        raise PromptPolicyError(spec, f"cannot be imported ({type(error).__name__}: {error})") from None
    if not callable(function):
        raise PromptPolicyError(spec, f"{attribute} is not a function")

    threads = None if inspect.iscoroutinefunction(function) else PolicyThreads(POLICY_THREADS)

    async def judge(text: str) -> Any:
        if threads is None:
            return await function(text)
        answer = await threads.run(function, text)
        return await answer if inspect.isawaitable(answer) else answer

    return PromptPolicy(spec, judge, timeout_s)


def load_prompt_policy(spec: str | None, timeout_s: float) -> PromptPolicy | None:
    """The policy ``spec`` names: None (no policy), ``module:function``, or a JSON
    file's path; ``PromptPolicyError`` names what is wrong with it."""
    if spec is None or not spec.strip():
        return None
    path = Path(spec)
    if path.exists() or spec.endswith(".json") or ":" not in spec:
        if not path.is_file():
            raise PromptPolicyError(spec, "no such file (a JSON file, or module:function)")
        return deny_list(path, timeout_s)
    return function_policy(spec, timeout_s)
