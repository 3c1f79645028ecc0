"""A demo model directory behind the real server: written by ``rtvideo train-demo``,
served by ``rtvideo serve --model DIR``; the prompts it knows reach ``GET /v1/models``
(where the page reads its suggestions) and it streams at its own size. And the
shipped demo model, the server's default: a red circle turns into a blue square
at the chunk the server names."""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest
import torch

from rtvideo.training.demo.classify import classify, dominant_colour
from rtvideo.workers.cpu_threads import candidates
from tests.e2e.client import Chunk, Realtime, assert_applied_as_promised, interaction, open_realtime
from tests.e2e.conftest import start_server, stop_server, train_tiny_demo


@pytest.fixture(scope="module")
def trained_server(tmp_path_factory):
    model = train_tiny_demo(tmp_path_factory.mktemp("demo"))
    server = start_server(model=str(model))
    yield server, model
    stop_server(server)


def test_the_model_card_lists_the_prompts_the_demo_model_knows(trained_server):
    server, model = trained_server
    [card] = httpx.get(f"{server.http}/v1/models").json()["data"]
    known = json.loads((model / "rtvideo.json").read_text())["demo"]["prompts"]
    assert card["prompts"] == known and len(known) == 60
    assert "a red circle moving right" in card["prompts"]
    assert (card["defaults"]["width"], card["defaults"]["height"]) == (32, 32)


async def test_the_demo_model_streams_a_known_prompt_and_a_switch(trained_server):
    server, _ = trained_server
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        # Endless, stopped once the switch is in: a session of a few chunks may end before it arrives.
        await client.send({"type": "session.start", "prompt": "a red circle moving right", "format": "raw"})
        await client.until("video.start")
        await client.next()  # chunk 0
        await client.send(interaction("a blue square moving left", "switch"))
        queued = await client.until("session.interaction.queued")
        applied = await client.until("session.interaction.applied")
        await client.send({"type": "session.stop"})
        got = await client.rest()
    assert_applied_as_promised(queued, applied)
    frames = [c.metadata["num_frames"] for c in got.chunks]
    assert len(frames) >= 2 and frames[0] == 9 and set(frames[1:]) == {12}, frames
    assert all(len(c.payload) == c.metadata["num_frames"] * 32 * 32 * 3 for c in got.chunks)


async def test_the_shipped_demo_model_draws_red_then_blue_from_the_applied_chunk(demo_server):
    """Over WebSocket, raw frames: "a red circle moving right", then "a blue square
    moving left" once chunk 0 is in. Every chunk before the one the applied event
    names is red, that chunk and every one after it blue."""
    async with open_realtime(demo_server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "a red circle moving right", "seed": 3, "format": "raw"})
        started = await client.until("video.start")
        assert isinstance(await client.next(), Chunk)  # chunk 0
        await client.send(interaction("a blue square moving left", "switch"))
        applied = await client.until("session.interaction.applied", timeout=60)
        at = applied["generation_chunk_index"]
        while not client.received.chunks or client.received.chunks[-1].metadata["generation_chunk_index"] < at + 2:
            await client.next(timeout=60)
        await client.send({"type": "session.stop"})
        got = await client.rest()
    width, height = started["config"]["width"], started["config"]["height"]
    assert (width, height) == (64, 64)
    colours = {}
    for chunk in got.chunks:
        frames = np.frombuffer(chunk.payload, np.uint8).reshape(-1, height, width, 3)
        colours[chunk.metadata["generation_chunk_index"]] = dominant_colour(frames)
    assert at >= 1 and len(colours) >= at + 3
    assert all(colours[i] == "red" for i in range(at)), colours
    assert all(colours[i] == "blue" for i in colours if i >= at), colours


def test_the_shipped_demo_model_runs_on_the_cpu_threads_its_worker_measured():
    """``rtvideo serve`` as a newcomer runs it, no thread count given (and no
    ``OMP_NUM_THREADS``, which the test runner sets for its own processes): on
    a CPU the worker measured its kernels' threads at start
    (``rtvideo.workers.cpu_threads``), says so in its log, and /health says the count
    it keeps. On a machine too loaded to run a warm-up chunk in time the
    worker measures nothing and says so; /health then says torch's default."""
    server = start_server(model="demo", unset=("OMP_NUM_THREADS",))
    try:
        workers = server.health()["workers"]
        device = workers[0]["device"]  # what the worker computes on, by name
        assert device["kind"] == ("cuda" if torch.cuda.is_available() else "cpu") and device["name"], device
        if torch.cuda.is_available():
            assert workers[0]["cpu_threads"] is None, workers  # on a GPU there is no count to choose
        else:
            assert workers[0]["cpu_threads"] in candidates(os.cpu_count() or 1), workers
            said = server.wait_for_log("CPU threads ")  # measured, or not on a machine too slow to
            if "not measured" in said:  # measure in time (a loaded CI box): torch's default stays
                assert f"torch's default ({workers[0]['cpu_threads']}) stays" in said, said
            else:
                assert f"CPU threads for the kernels: {workers[0]['cpu_threads']} (" in said, said
    finally:
        stop_server(server)


def test_the_shipped_demo_models_card_lists_what_it_knows(demo_server):
    [card] = httpx.get(f"{demo_server.http}/v1/models").json()["data"]
    assert card["id"] == "demo" and len(card["prompts"]) == 60 and "a blue square moving left" in card["prompts"]
    assert (card["defaults"]["width"], card["defaults"]["height"]) == (64, 64)


async def test_the_shipped_demo_model_draws_an_unknown_prompt_as_the_known_one_nearest_in_words(demo_server):
    """What the README promises: a prompt the demo model does not know is drawn as
    a shape it knows, the caption sharing the most words with it
    (``conditioning.nearest_known``), in every chunk, not a fade to the dark
    background. "a paper boat drifting down a rainy street" shares "down" with
    "a red circle moving down" (and "a" with every caption): a red circle, moving
    down, in each chunk; so is a switch to "a boat going up in blue" blue, moving up."""
    async with open_realtime(demo_server.ws) as ws:
        client = Realtime(ws)
        start = {"type": "session.start", "prompt": "a paper boat drifting down a rainy street", "format": "raw"}
        await client.send({**start, "seed": 5, "num_chunks": 8})
        started = await client.until("video.start")
        while len(client.received.chunks) < 4:
            await client.next(timeout=60)
        await client.send(interaction("a boat going up in blue", "unknown"))
        applied = await client.until("session.interaction.applied", timeout=60)
        got = await client.rest()
    width, height = started["config"]["width"], started["config"]["height"]
    at = applied["generation_chunk_index"]
    readings = {}
    for chunk in got.chunks:
        reading = classify(np.frombuffer(chunk.payload, np.uint8).reshape(-1, height, width, 3))
        readings[chunk.metadata["generation_chunk_index"]] = (reading.presence, reading.attributes)
    assert len(readings) == 8 and 4 <= at < 8, readings
    for index, (presence, attributes) in readings.items():
        assert presence == 1.0, readings  # an object in every frame: nothing fades out
        colour, direction = ("red", "down") if index < at else ("blue", "up")
        if index == at and (attributes.colour, attributes.direction) != (colour, direction):
            continue  # the applied chunk may still carry the turn
        assert (attributes.colour, attributes.shape, attributes.direction) == (colour, "circle", direction), readings
