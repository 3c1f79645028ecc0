"""A demo model directory behind the real server: written by ``rtvideo train-demo``,
served by ``rtvideo serve --model DIR``; the prompts it knows reach ``GET /v1/models``
(where the page reads its suggestions) and it streams at its own size."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.client import Realtime, assert_applied_as_promised, interaction, open_realtime
from tests.e2e.conftest import start_server, stop_server, train_tiny_demo


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    model = train_tiny_demo(tmp_path_factory.mktemp("demo"))
    server = start_server(model=str(model))
    yield server, model
    stop_server(server)


def test_the_model_card_lists_the_prompts_the_demo_model_knows(demo_server):
    server, model = demo_server
    [card] = httpx.get(f"{server.http}/v1/models").json()["data"]
    known = json.loads((model / "rtvideo.json").read_text())["demo"]["prompts"]
    assert card["prompts"] == known and len(known) == 60
    assert "a red circle moving right" in card["prompts"]
    assert (card["defaults"]["width"], card["defaults"]["height"]) == (32, 32)


async def test_the_demo_model_streams_a_known_prompt_and_a_switch(demo_server):
    server, _ = demo_server
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        start = {"type": "session.start", "prompt": "a red circle moving right", "num_chunks": 3, "format": "raw"}
        await client.send(start)
        await client.until("video.start")
        await client.next()  # chunk 0
        await client.send(interaction("a blue square moving left", "switch"))
        queued = await client.until("session.interaction.queued")
        applied = await client.until("session.interaction.applied")
        got = await client.rest()
    assert_applied_as_promised(queued, applied)
    assert [c.metadata["num_frames"] for c in got.chunks] == [9, 12, 12]
    assert all(len(c.payload) == c.metadata["num_frames"] * 32 * 32 * 3 for c in got.chunks)
