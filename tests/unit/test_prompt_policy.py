"""The operator's prompt policy (``rtvideo.server.prompt_policy``): loaded at
start, with every mistake named; a deny list refuses what its patterns match
and tells the client its reason, never the pattern; a function of the
operator's is called with each prompt, sync or async, and fails closed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import types

import pytest

from rtvideo.server.jobs import job_prompts
from rtvideo.server.prompt_policy import (
    CHECK_FAILED,
    DEFAULT_REASON,
    POLICY_THREADS,
    PromptPolicyError,
    PromptRefused,
    load_prompt_policy,
)
from rtvideo.server.schemas import JobRequest


def policy_file(tmp_path, body) -> str:
    path = tmp_path / "policy.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("{not json", "not a JSON file"),
        ([r"storm"], 'expected an object {"deny": ["pattern", ...], "reason": "..."}'),
        ({"deny": "storm"}, 'expected an object {"deny"'),
        ({"deny": [], "refuse": "x"}, 'expected an object {"deny"'),
        ({"deny": ["ok", ""]}, "deny[1] must be a non-empty string, got ''"),
        ({"deny": ["ok", "(unclosed"]}, "deny[1] '(unclosed' is no regex (missing ), unterminated subpattern"),
        ({"deny": ["ok"], "reason": "  "}, "reason must be a non-blank string"),
    ],
)
def test_a_policy_file_that_cannot_be_used_is_named_with_what_is_wrong(tmp_path, body, said):
    path = policy_file(tmp_path, body)
    with pytest.raises(PromptPolicyError) as error:
        load_prompt_policy(path, 5.0)
    assert error.value.spec == path and said in error.value.what, str(error.value)
    assert str(error.value).startswith(f"prompt policy {path}: ")


def test_a_missing_file_and_a_function_that_cannot_be_imported_are_named(tmp_path):
    with pytest.raises(PromptPolicyError, match=r"policy.json: no such file \(a JSON file, or module:function\)"):
        load_prompt_policy(str(tmp_path / "policy.json"), 5.0)
    with pytest.raises(PromptPolicyError, match=r"no_such_module:check: cannot be imported \(ModuleNotFoundError"):
        load_prompt_policy("no_such_module:check", 5.0)
    with pytest.raises(PromptPolicyError, match=r"json:nothing_here: cannot be imported \(AttributeError"):
        load_prompt_policy("json:nothing_here", 5.0)
    with pytest.raises(PromptPolicyError, match="json:__doc__: __doc__ is not a function"):
        load_prompt_policy("json:__doc__", 5.0)
    assert load_prompt_policy(None, 5.0) is None and load_prompt_policy("  ", 5.0) is None


async def test_a_deny_list_refuses_what_a_pattern_matches_anywhere_case_ignored(tmp_path):
    policy = load_prompt_policy(policy_file(tmp_path, {"deny": [r"\bstorm\b", "gore"]}), 5.0)
    await policy.check({"prompt": "a calm sea", "negative_prompt": ""})  # taken
    await policy.check({"prompt": "a brainstorming session", "negative_prompt": None})  # no whole word
    with pytest.raises(PromptRefused) as refused:
        await policy.check({"prompt": "a calm sea", "negative_prompt": "a STORM at night"})
    assert (refused.value.field, refused.value.reason) == ("negative_prompt", DEFAULT_REASON)
    assert str(refused.value) == f"negative_prompt: refused by this server's prompt policy: {DEFAULT_REASON}"
    assert "storm" not in refused.value.reason  # the pattern is never told

    worded = load_prompt_policy(policy_file(tmp_path, {"deny": ["gore"], "reason": "see our terms"}), 5.0)
    with pytest.raises(PromptRefused, match=r"^prompt: refused by this server's prompt policy: see our terms$"):
        await worded.check({"prompt": "GoRe everywhere", "negative_prompt": "gore"})  # the first field refused


def _module(monkeypatch, name: str, **functions) -> str:
    """A module of the operator's, importable by ``name`` for this test."""
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**functions))
    return name


async def test_a_function_of_the_operators_is_called_with_each_prompt_sync_or_async(monkeypatch):
    seen: list[tuple[str, str]] = []

    def plain(text):
        seen.append((threading.current_thread().name, text))
        return "no boats" if "boat" in text else None

    async def awaited(text):
        await asyncio.sleep(0)
        return "no storms" if "storm" in text else None

    name = _module(monkeypatch, "policy_functions", plain=plain, awaited=awaited)
    sync_policy = load_prompt_policy(f"{name}:plain", 5.0)
    await sync_policy.check({"prompt": "a lighthouse"})
    with pytest.raises(PromptRefused, match="interaction.event.prompt: .*: no boats"):
        await sync_policy.check({"interaction.event.prompt": "a paper boat"})
    assert [text for _, text in seen] == ["a lighthouse", "a paper boat"]
    assert all(thread != threading.main_thread().name for thread, _ in seen)  # a plain function runs in a thread

    async_policy = load_prompt_policy(f"{name}:awaited", 5.0)
    await async_policy.check({"prompt": "a lighthouse"})
    with pytest.raises(PromptRefused, match="prompt: .*: no storms"):
        await async_policy.check({"prompt": "a storm"})


async def test_a_check_that_fails_answers_nonsense_or_hangs_refuses_and_is_logged(caplog, monkeypatch):
    release = threading.Event()

    def broken(text):
        raise ConnectionError("moderation service down")

    def nonsense(text):
        return 42

    def hangs(text):
        release.wait(5)

    name = _module(monkeypatch, "policy_failures", broken=broken, nonsense=nonsense, hangs=hangs)
    caplog.set_level(logging.WARNING, logger="rtvideo.server.prompt_policy")
    for function, logged in (
        ("broken", "failed on prompt (ConnectionError: moderation service down); refused"),
        ("nonsense", "answered 42 for prompt, not a reason or None; refused"),
        ("hangs", "no answer within 0.2 s for prompt; refused"),
    ):
        policy = load_prompt_policy(f"{name}:{function}", 0.2)
        with pytest.raises(PromptRefused) as refused:
            await policy.check({"prompt": "a lighthouse"})
        assert refused.value.reason == CHECK_FAILED
        assert logged in caplog.records[-1].getMessage()
    release.set()


def test_every_prompt_of_a_job_is_checked_by_its_field():
    request = JobRequest(
        prompt="a lighthouse",
        negative_prompt=None,
        interactions=[{"at_chunk": 1, "prompt": "a storm"}, {"at_chunk": 2, "prompt": "a calm sea"}],
    )
    assert job_prompts(request) == {
        "prompt": "a lighthouse",
        "negative_prompt": None,
        "interactions[0].prompt": "a storm",
        "interactions[1].prompt": "a calm sea",
    }


async def test_a_hanging_function_holds_only_the_policys_own_threads(monkeypatch):
    """A plain function runs on the policy's daemon threads, not the loop's default
    executor that encodes every session's media: with all of them hung, checks
    are refused on time and the server's other threaded work goes on."""
    release = threading.Event()

    def hangs(text):
        release.wait(10)

    name = _module(monkeypatch, "policy_hangs", hangs=hangs)
    policy = load_prompt_policy(f"{name}:hangs", 0.3)
    default_executor = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor's threads
    checks = [policy.check({"prompt": f"prompt {i}"}) for i in range(max(POLICY_THREADS, default_executor) + 1)]
    results = await asyncio.gather(*checks, return_exceptions=True)
    assert all(isinstance(r, PromptRefused) and r.reason == CHECK_FAILED for r in results), results
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "encoded"), 2) == "encoded"
    ours = [t for t in threading.enumerate() if t.name.startswith("prompt-policy-")]
    assert len(ours) >= POLICY_THREADS and all(t.daemon for t in ours)  # never holds the process at exit
    release.set()
