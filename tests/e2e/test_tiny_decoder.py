"""The tiny decoder behind the real server: ``--decoder tiny`` as the server's
default, ``decoder`` per realtime session and per job, refusals that name the
field, and a server asked for a decoder it has no weights for failing its start
in one line. The tiny preset with a tiny decoder of random weights
(``--pipeline-options '{"tiny_decoder": "random"}'``)."""

from __future__ import annotations

import httpx

from tests.e2e.client import Realtime, open_realtime
from tests.e2e.conftest import start_server


async def test_sessions_and_jobs_choose_their_decoder_and_the_server_names_a_missing_one(make_server):
    server = make_server("--decoder", "tiny", model="tiny", pipeline={"tiny_decoder": "random", "warm_up_chunks": 1})
    made = {}
    for decoder in ("tiny", "full", None):
        async with open_realtime(server.ws) as ws:
            client = Realtime(ws)
            start = {"type": "session.start", "prompt": "a red fox", "num_chunks": 2, "format": "raw", "seed": 3}
            await client.send(start if decoder is None else {**start, "decoder": decoder})
            begun = await client.until("video.start")
            assert begun["config"]["decoder"] == (decoder or "tiny")
            got = await client.rest()
        assert [c.metadata["num_frames"] for c in got.chunks] == [9, 12]
        [done] = got.of("session.done")
        assert done["replay"]["decoder"] == (decoder or "tiny")
        made[decoder] = b"".join(c.payload for c in got.chunks)
    assert made["tiny"] == made[None] != made["full"]  # the server's default is its --decoder

    job = {"prompt": "a red fox", "num_chunks": 2, "format": "raw", "seed": 3}
    synced = httpx.post(f"{server.http}/v1/videos/sync", json={**job, "decoder": "tiny"}, timeout=120)
    assert synced.status_code == 200 and synced.content == made["tiny"]
    refused = httpx.post(f"{server.http}/v1/videos", json={**job, "decoder": "huge"}, timeout=30)
    assert refused.status_code == 422 and "decoder" in refused.text

    plain = make_server(model="tiny", pipeline={"warm_up_chunks": 1})
    answer = httpx.post(f"{plain.http}/v1/videos/sync", json={**job, "decoder": "tiny"}, timeout=120)
    assert answer.status_code == 422, answer.text
    assert "decoder: the 'tiny' model has no tiny decoder loaded (it has: full)" in answer.json()["error"]["message"]


def test_a_server_told_to_decode_with_weights_it_lacks_fails_its_start_naming_them():
    try:
        start_server("--decoder", "tiny", model="tiny", pipeline={"warm_up_chunks": 1}, timeout=120)
    except RuntimeError as error:
        assert "decoder tiny: no tiny decoder weights were found" in str(error)
    else:
        raise AssertionError("the server started without the tiny decoder's weights")
