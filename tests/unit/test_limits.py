"""One source for each limit: the API schema and the engine's checks agree at every bound."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rtvideo.engine.limits import MAX_PROMPT_CHARS, MAX_SEED, MAX_TRANSITION_CHUNKS, PROMPT_CHANGE_MODES
from rtvideo.engine.messages import Interaction, StartSession, VideoInput
from rtvideo.engine.validation import check_interaction, check_start
from rtvideo.server.schemas import InteractionPayload, ScheduledPrompt, VideoRequest


def engine_admits(**start) -> bool:
    try:
        check_start(StartSession(session_id="s", **{"prompt": "p", **start}))
    except ValueError:
        return False
    return True


def schema_admits(model, **fields) -> bool:
    try:
        model.model_validate(fields)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("field", "at_bound", "past_bound"),
    [
        ("prompt", "p" * MAX_PROMPT_CHARS, "p" * (MAX_PROMPT_CHARS + 1)),
        ("transition_chunks", MAX_TRANSITION_CHUNKS, MAX_TRANSITION_CHUNKS + 1),
        ("seed", MAX_SEED, MAX_SEED + 1),
    ],
)
def test_a_start_at_a_bound_is_admitted_by_both_and_one_past_it_by_neither(field, at_bound, past_bound):
    base = {"prompt": "p"}
    assert schema_admits(VideoRequest, **{**base, field: at_bound}) and engine_admits(**{field: at_bound})
    assert not schema_admits(VideoRequest, **{**base, field: past_bound})
    assert not engine_admits(**{field: past_bound})


@pytest.mark.parametrize("mode", [*PROMPT_CHANGE_MODES, "melt"])
def test_prompt_change_modes_are_one_list(mode):
    known = mode in PROMPT_CHANGE_MODES
    assert schema_admits(VideoRequest, prompt="p", prompt_change=mode) is known
    assert engine_admits(prompt_change=mode) is known


def test_interactions_share_the_limits():
    long_prompt = "p" * (MAX_PROMPT_CHARS + 1)
    assert not schema_admits(InteractionPayload, event={"prompt": long_prompt})
    assert not schema_admits(ScheduledPrompt, at_chunk=0, prompt=long_prompt)
    assert not schema_admits(InteractionPayload, event={"prompt": "p"}, transition_chunks=MAX_TRANSITION_CHUNKS + 1)
    with pytest.raises(ValueError, match="interaction.prompt"):
        check_interaction(Interaction(prompt=long_prompt))
    with pytest.raises(ValueError, match="interaction.transition_chunks"):
        check_interaction(Interaction(prompt="p", transition_chunks=MAX_TRANSITION_CHUNKS + 1))
    check_interaction(Interaction(prompt="p" * MAX_PROMPT_CHARS, transition_chunks=MAX_TRANSITION_CHUNKS))


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("1", 0),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"prompt": "[[[[{{{{"}', 1),  # brackets inside a string do not nest
        ('{"prompt": "a \\" [[[ \\\\", "x": [[]]}', 3),  # escaped quotes and backslashes keep the string intact
        ("[" * 1000 + "]" * 1000, 1000),
    ],
)
def test_json_depth_counts_nesting_outside_strings(text, depth):
    from rtvideo.server.limits import json_depth

    assert json_depth(text) == depth


def test_an_integer_too_long_is_named_by_its_field():
    from rtvideo.server.limits import MAX_JSON_INT_DIGITS, IntegerTooLongError, long_integers, parse_json

    long = "9" * (MAX_JSON_INT_DIGITS + 1)
    text = f'{{"seed": 1, "interactions": [{{"at_chunk": {long}}}], "num_chunks": -{long}}}'
    why = f"an integer of {MAX_JSON_INT_DIGITS + 1} digits; at most {MAX_JSON_INT_DIGITS} are accepted"
    assert long_integers(text) == f"interactions.0.at_chunk: {why}; num_chunks: {why}"
    with pytest.raises(IntegerTooLongError, match="^body: "):
        parse_json(long)
    within = "9" * MAX_JSON_INT_DIGITS
    assert parse_json(f'{{"seed": {within}, "prompt": "{long}", "x": {long}.5}}')["seed"] == int(within)
    assert long_integers("not JSON " + long) is None  # the parser that runs next says what is wrong


VIDEO_INPUT = {"kind": "video", "strength": 0.5, "format": "jpeg", "width": 64, "height": 64, "fps": 16.0}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", "audio"),
        ("format", "png"),
        ("strength", -0.01),
        ("strength", 1.01),
        ("strength", float("nan")),
        ("width", 0),
        ("height", -8),
        ("fps", 0.0),
        ("fps", float("inf")),
    ],
)
def test_a_start_with_a_bad_input_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"input\.{field}"):
        check_start(StartSession(session_id="s", prompt="p", input=VideoInput(**{**VIDEO_INPUT, field: value})))


@pytest.mark.parametrize("strength", [0.0, 0.5, 1.0])
def test_a_start_with_an_input_is_admitted(strength):
    assert engine_admits(input=VideoInput(**{**VIDEO_INPUT, "strength": strength, "format": "raw"}))
    assert engine_admits(input=None)
