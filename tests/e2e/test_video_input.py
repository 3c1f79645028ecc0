"""Video to video over the realtime socket, against the server as a subprocess
(stub pipeline: at strength 0 a chunk's frames are its input frames, byte for
byte; above 0, row 0 of every frame still shows the prompt's conditioning):
input frames in as binary messages, chunks out made from them, a prompt change
at the next chunk, a fast sender's oldest frames dropped and counted, bad
frames refused by name while the session goes on."""

from __future__ import annotations

import io
import time

import av
import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.client import Realtime, input_frame, interaction, open_realtime
from tests.support import video_file

W, H, FPS = 32, 24, 16.0
PER = 4  # the stub's frames a chunk (the first chunk's too)


def start(strength: float = 0.0, fmt: str = "raw", **fields) -> dict:
    source = {"kind": "video", "strength": strength, "format": fmt, "width": W, "height": H, "fps": FPS}
    return {"type": "session.start", "prompt": "a red circle moving right", "format": "raw", "input": source, **fields}


def picture(index: int) -> np.ndarray:
    """Input frame ``index``: noise of its own (every byte matters at strength 0)."""
    return np.random.default_rng(index).integers(0, 256, (H, W, 3), dtype=np.uint8)


def jpeg(image: np.ndarray) -> bytes:
    frame = av.VideoFrame.from_ndarray(image, format="rgb24")
    out = io.BytesIO()
    with av.open(out, "w", format="mjpeg") as container:
        stream = container.add_stream("mjpeg", rate=16)
        stream.width, stream.height, stream.pix_fmt = image.shape[1], image.shape[0], "yuvj444p"
        for packet in stream.encode(frame.reformat(format="yuvj444p")):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def frames_of(chunk) -> np.ndarray:
    return np.frombuffer(chunk.payload, np.uint8).reshape(chunk.metadata["num_frames"], H, W, 3)


def scrape(server) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.http}/metrics").text):
        for sample in family.samples:
            if not sample.labels:
                samples[sample.name] = sample.value
    return samples


async def send_chunk(client: Realtime, k: int) -> None:
    """Chunk ``k``'s input frames, ``k * PER`` to ``k * PER + PER - 1``, raw."""
    for i in range(k * PER, (k + 1) * PER):
        await client.send(input_frame(i, picture(i).tobytes(), capture_us=i * 62_500))


async def stream(client: Realtime, chunks: int, on_chunk=None) -> list:
    """Send the input of ``chunks`` chunks, never more than two chunks ahead of the
    output received (so the server never holds more than two chunks' worth waiting:
    nothing is dropped), and read up to ``session.done``."""
    await send_chunk(client, 0)
    await send_chunk(client, 1)
    out = []
    while True:
        item = await client.next()
        if isinstance(item, dict):
            assert item["type"] != "error", item
            if item["type"] == "session.done":
                return out
            continue
        out.append(item)
        k = item.metadata["generation_chunk_index"]
        if k + 2 < chunks:
            await send_chunk(client, k + 2)
        if on_chunk is not None:
            await on_chunk(item)


async def test_at_strength_0_the_chunks_are_the_input_frames_and_name_them(server):
    before = scrape(server)
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start(num_chunks=4))
        started = await client.until("video.start")
        chunks = await stream(client, 4)
    config = started["config"]
    assert (config["width"], config["height"], config["fps"]) == (W, H, FPS)  # the input's
    assert config["input"] == {"kind": "video", "strength": 0.0, "format": "raw", "width": W, "height": H, "fps": FPS}
    assert [c.metadata["generation_chunk_index"] for c in chunks] == [0, 1, 2, 3]
    for k, chunk in enumerate(chunks):
        indexes = list(range(k * PER, (k + 1) * PER))
        assert chunk.metadata["input_frame_indexes"] == indexes
        assert chunk.metadata["input_frames_dropped"] == 0
        assert np.array_equal(frames_of(chunk), np.stack([picture(i) for i in indexes])), f"chunk {k}"
    [done] = client.received.of("session.done")
    assert done["replay"]["exact"] is False and "input video" in done["replay"]["inexact_reason"]
    after = scrape(server)
    assert (
        after["rtvideo_input_frame_latency_seconds_count"] - before.get("rtvideo_input_frame_latency_seconds_count", 0)
        == 4 * PER
    )
    received = "rtvideo_input_frames_received_total"
    assert after[received] - before.get(received, 0) == 4 * PER


async def test_jpeg_frames_are_decoded_and_restyled(server):
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start(fmt="jpeg", num_chunks=1))
        await client.until("video.start")
        images = [np.full((H, W, 3), 40 * i + 20, np.uint8) for i in range(PER)]  # flat: JPEG keeps them near exact
        for i, image in enumerate(images):
            await client.send(input_frame(i, jpeg(image)))
        got = await client.rest()
    [chunk] = got.chunks
    assert chunk.metadata["input_frame_indexes"] == list(range(PER))
    assert np.abs(frames_of(chunk).astype(int) - np.stack(images)).max() <= 2
    assert not got.of("error")


async def test_a_prompt_change_applies_at_the_next_chunk(server):
    """Above strength 0 the stub's row 0 shows the prompt: it changes exactly at the
    chunk the applied event names, which is the one after the chunk in progress."""

    async def change_after_first(chunk) -> None:
        if chunk.metadata["generation_chunk_index"] == 0:
            await client.send(interaction("a blue square moving left", event_id="p1"))

    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start(strength=0.5, num_chunks=6))
        await client.until("video.start")
        chunks = await stream(client, 6, on_chunk=change_after_first)
    [queued] = client.received.of("session.interaction.queued")
    [applied] = client.received.of("session.interaction.applied")
    k = applied["generation_chunk_index"]
    assert k == queued["expected_chunk_index"] and 1 <= k < 6
    rows = [frames_of(c)[0, 0] for c in chunks]
    assert all(np.array_equal(rows[j], rows[0]) for j in range(k)), "the prompt changed before its chunk"
    assert not np.array_equal(rows[k], rows[0]), "the new prompt did not take effect at its chunk"
    assert all(c.metadata["input_frames_dropped"] == 0 for c in chunks)


async def test_a_fast_sender_loses_its_oldest_frames_counted_and_reported(make_server):
    """60 frames at once to a slow model: the server keeps at most two chunks' worth
    waiting, dropping the oldest. Whatever the timing, the newest 8 frames (two
    chunks) are never dropped (a frame goes only when 8 newer ones came after it),
    every frame sent is either in a chunk or counted dropped, and the drops are
    on /metrics."""
    server = make_server(pipeline={"step_time_s": 0.1})
    total, capacity = 60, 2 * PER
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start(strength=1.0, max_lead_seconds=None))
        await client.until("video.start")
        for i in range(total):
            await client.send(input_frame(i, picture(i).tobytes()))
        await client.send({"type": "session.ping"})
        await client.until("session.pong")  # the server has read every frame
        used: list[int] = []
        while total - 1 not in used:
            item = await client.next()
            if isinstance(item, dict):
                assert item["type"] != "error", item
                continue
            used += item.metadata["input_frame_indexes"]
            dropped = item.metadata["input_frames_dropped"]
        await client.send({"type": "session.stop"})
        await client.rest()
    assert used == sorted(used) and len(set(used)) == len(used)
    assert set(range(total - capacity, total)) <= set(used)
    assert len(used) + dropped == total
    assert dropped > 0  # the model makes a chunk in 0.4 s; the 60 frames came far faster
    assert scrape(server)["rtvideo_input_frames_dropped_total"] == dropped


async def test_bad_frames_are_refused_by_name_and_the_session_goes_on(server):
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start(num_chunks=1))
        await client.until("video.start")
        await client.send(b"\x00\x01\x02")
        short = await client.until("error")
        assert short["code"] == "invalid_input_frame" and "frame_index" not in short and not short["fatal"]
        assert "a binary frame of 3 bytes: shorter than the 12-byte header" in short["message"]
        await client.send(input_frame(0, picture(0).tobytes()))
        await client.send(input_frame(1, picture(1).tobytes()[:-3]))  # 3 bytes short
        wrong = await client.until("error")
        assert (wrong["code"], wrong["frame_index"], wrong["fatal"]) == ("invalid_input_frame", 1, False)
        assert f"frame 1: {W * H * 3 - 3} bytes of raw RGB after the header; a {W}x{H} frame" in wrong["message"]
        await client.send(input_frame(0, picture(0).tobytes()))
        repeated = await client.until("error")
        assert repeated["frame_index"] == 0 and "not above the last frame's (0)" in repeated["message"]
        await client.send({"type": "session.ping"})
        await client.until("session.pong")  # the session goes on
        for i in range(1, PER):
            await client.send(input_frame(i, picture(i).tobytes()))
        got = await client.rest()
    [chunk] = got.chunks
    assert chunk.metadata["input_frame_indexes"] == list(range(PER))
    assert np.array_equal(frames_of(chunk), np.stack([picture(i) for i in range(PER)]))
    assert got.of("session.done")[0]["reason"] == "completed"


async def test_a_jpeg_that_does_not_decode_is_refused_by_name_and_the_next_frame_takes_its_place(server):
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start(fmt="jpeg", num_chunks=1))
        await client.until("video.start")
        good = jpeg(np.full((H, W, 3), 128, np.uint8))
        await client.send(input_frame(0, good))
        await client.send(input_frame(1, b"\xff\xd8 not a JPEG " * 8))
        await client.send(input_frame(2, jpeg(np.zeros((H * 2, W * 2, 3), np.uint8))))  # another size
        for i in range(3, 3 + PER - 1):
            await client.send(input_frame(i, good))
        got = await client.rest()
    errors = sorted(got.of("error"), key=lambda e: e["frame_index"])  # frame 2's size is refused as it comes
    assert [(e["code"], e["frame_index"], e["fatal"]) for e in errors] == [
        ("invalid_input_frame", 1, False),
        ("invalid_input_frame", 2, False),
    ]
    assert errors[0]["message"].startswith("frame 1: not a JPEG image that decodes")
    assert errors[1]["message"].startswith(f"frame 2: a {2 * W}x{2 * H} image; the session's input is {W}x{H}")
    [chunk] = got.chunks
    assert chunk.metadata["input_frame_indexes"] == [0, 3, 4, 5]


async def test_binary_frames_without_an_input_are_still_not_supported(server):
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "p", "format": "raw", "num_chunks": 2})
        await client.until("video.start")
        await client.send(input_frame(0, picture(0).tobytes()))
        error = await client.until("error")
        assert (error["code"], error["fatal"]) == ("binary_not_supported", False)
        got = await client.rest()
    assert got.of("session.done")[0]["reason"] == "completed" and len(got.chunks) == 2
    async with open_realtime(server.ws) as ws:  # a first message that is binary: fatal, as before
        client = Realtime(ws)
        await client.send(input_frame(0, b"x"))
        got = await client.rest()
    assert got.of("error")[0]["code"] == "binary_not_supported" and got.close_code == 1008


async def test_a_spectator_cannot_send_input_and_a_resumed_controller_sends_on(server):
    """Frames from a spectator are ``read_only``; a controller whose socket dropped
    resumes and sends the next frames (indexes going on), and the session's chunks
    are its input, whichever connection sent them."""
    first = Realtime(await open_realtime(server.ws))
    await first.send(start(num_chunks=3))
    started = await first.until("video.start")
    await send_chunk(first, 0)
    await send_chunk(first, 1)
    chunk = await first.next()
    assert chunk.metadata["generation_chunk_index"] == 0
    async with open_realtime(f"{server.ws}?watch={started['watch_token']}") as ws:
        spectator = Realtime(ws)
        await spectator.until("video.start")
        await spectator.send(input_frame(100, picture(100).tobytes()))
        refused = await spectator.until("error")
        assert (refused["code"], refused["fatal"]) == ("read_only", False)
    first.ws.transport.abort()  # a network drop: the session waits for a resume
    body = {"type": "session.resume", "request_id": started["request_id"], "resume_token": started["resume_token"]}
    for _ in range(50):
        second = Realtime(await open_realtime(server.ws))
        await second.send({**body, "last_chunk_index": 0})
        answer = await second.next()
        if answer["type"] == "video.start":
            break
        assert answer["code"] == "resume_token_in_use", answer
        await second.rest()
    await send_chunk(second, 2)
    got = await second.rest()
    await second.ws.close()
    assert [c.metadata["generation_chunk_index"] for c in got.chunks] == [1, 2]
    assert got.of("session.done")[0]["reason"] == "completed"
    for c in [chunk, *got.chunks]:
        k = c.metadata["generation_chunk_index"]
        assert c.metadata["input_frame_indexes"] == list(range(k * PER, (k + 1) * PER))
        assert np.array_equal(frames_of(c), np.stack([picture(i) for i in range(k * PER, (k + 1) * PER)]))


@pytest.mark.parametrize(
    ("fields", "code", "says"),
    [
        ({"width": 64}, "invalid_request", "input.width: 32 differs from the session's width (64)"),
        ({"fps": 30}, "invalid_request", "input.fps: 16 differs from the session's fps (30)"),
        ({"input": {"kind": "video", "strength": 2, "width": W, "height": H, "fps": FPS}}, "invalid_event", None),
    ],
)
async def test_an_input_the_session_cannot_take_is_refused_naming_its_field(server, fields, code, says):
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start(**fields))
        got = await client.rest()
    [error] = got.of("error")
    assert (error["code"], error["fatal"], got.close_code) == (code, True, 1008)
    assert (says or "input.strength: Input should be less than or equal to 1") in error["message"]


async def test_a_session_whose_frames_do_not_come_fails_with_input_timeout(make_server):
    server = make_server("--input-timeout-s", "0.5")
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(start())
        await client.until("video.start")
        got = await client.rest()
    [error] = got.of("error")
    assert (error["code"], error["fatal"], got.close_code) == ("input_timeout", True, 1011)


# -- request mode: POST /v1/videos with the file input_reference ---------------------


FORM = {"prompt": "a watercolour", "format": "raw", "width": str(W), "height": str(H), "fps": "16"}


def post_job(server, route: str = "/v1/videos", file: bytes | None = None, **fields: str) -> httpx.Response:
    files = {"input_reference": ("input.mkv", file, "video/x-matroska")} if file is not None else None
    return httpx.post(f"{server.http}{route}", data={**FORM, **fields}, files=files, timeout=60)


def test_a_jobs_input_video_is_restyled_and_its_length_is_the_videos(server):
    source = [picture(i) for i in range(8)]  # half a second at 16 fps
    made = post_job(server, "/v1/videos/sync", video_file(source, 16), input_strength="0")
    assert made.status_code == 200, made.text
    frames = np.frombuffer(made.content, np.uint8).reshape(-1, H, W, 3)
    assert np.array_equal(frames, np.stack(source))  # strength 0: the input itself, all of it and no more
    retimed = post_job(server, "/v1/videos/sync", video_file(source, 8), input_strength="0")  # 1 s at 8 fps
    frames = np.frombuffer(retimed.content, np.uint8).reshape(-1, H, W, 3)
    assert np.array_equal(frames, np.stack([source[i // 2] for i in range(16)]))  # each frame twice at 16 fps
    queued = post_job(server, file=video_file(source, 16), num_frames="6")  # a length the video covers
    assert queued.status_code == 202, queued.text
    assert (queued.json()["num_frames"], queued.json()["size"]) == (6, f"{W}x{H}")
    assert queued.json()["exact"] is True  # posting the same form, its file included, makes the same bytes
    twice = [post_job(server, "/v1/videos/sync", video_file(source, 16), input_strength="0.5") for _ in range(2)]
    assert twice[0].status_code == 200 and twice[0].content == twice[1].content
    assert twice[0].content != made.content  # restyled: not the input


def test_a_still_image_stands_for_every_frame_of_a_job(server):
    """The OpenAI SDK's input_reference is often an image: one frame, held for the job's length."""
    image = picture(7)
    still = post_job(server, "/v1/videos/sync", jpeg(image), input_strength="0", num_frames="6")
    assert still.status_code == 200, still.text
    frames = np.frombuffer(still.content, np.uint8).reshape(-1, H, W, 3)
    assert len(frames) == 6 and all(np.array_equal(f, frames[0]) for f in frames)
    assert np.abs(frames[0].astype(int) - image).mean() < 8  # the JPEG's own loss
    default = post_job(server, file=jpeg(image))  # no length: a job's default, 4 s
    assert default.status_code == 202 and default.json()["num_frames"] == 64, default.text


def test_with_no_length_the_videos_own_is_held_to_max_frames_not_the_four_second_default(make_server):
    """--max-frames 40 at 16 fps, below the 4 s default's 64 frames: a 24-frame
    video makes a 24-frame job; a 48-frame one is refused as too long; a still
    image, which takes the default, is refused naming it."""
    server = make_server("--max-frames", "40")
    accepted = post_job(server, file=video_file([picture(i) for i in range(24)], 16))
    assert accepted.status_code == 202 and accepted.json()["num_frames"] == 24, accepted.text
    too_long = post_job(server, file=video_file([picture(i) for i in range(48)], 16))
    assert too_long.status_code == 422 and too_long.json()["error"]["message"].startswith(
        "input_reference: the video is longer than this server's max_frames (40 frames at 16 fps, 2.5 s;"
    ), too_long.text
    still = post_job(server, file=jpeg(picture(3)))
    assert still.status_code == 422 and still.json()["error"]["message"].startswith(
        "seconds: none of num_frames, num_chunks, seconds was given, so the job is 4 s (64 frames at 16 fps)"
    ), still.text
    # Two frames a day apart (2 KB): counted no further than max_frames, not 1.4 million frames one by one.
    day = video_file([picture(0), picture(1)], 16, times_ms=[0, 86_400_000])
    endless = post_job(server, file=day)
    assert endless.status_code == 422 and "longer than this server's max_frames" in endless.text, endless.text
    bounded = post_job(server, file=day, num_frames="20")
    assert bounded.status_code == 202 and bounded.json()["num_frames"] == 20, bounded.text


def completed(server, video_id: str, within: float = 30.0) -> dict:
    """The job's object once it reads completed (from the store), polled as a client does."""
    deadline = time.monotonic() + within
    while (job := httpx.get(f"{server.http}/v1/videos/{video_id}").json())["status"] != "completed":
        assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
        time.sleep(0.02)
    return job


def test_a_jobs_video_object_reports_its_input_strength(server):
    """The strength the job's input video was restyled at: the request's input_strength,
    0.5 when it gives none; null for a job made from its prompt alone."""
    source = video_file([picture(i) for i in range(8)], 16)
    jobs = [post_job(server, file=source, input_strength="0.25"), post_job(server, file=source), post_job(server)]
    assert [job.status_code for job in jobs] == [202, 202, 202], [job.text for job in jobs]
    assert [job.json()["input_strength"] for job in jobs] == [0.25, 0.5, None]
    assert [completed(server, job.json()["id"])["input_strength"] for job in jobs] == [0.25, 0.5, None]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks its videos API deprecated
def test_the_openai_sdk_sends_an_input_reference(server):
    sdk = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=60)
    source = [picture(i) for i in range(16)]  # one second at 16 fps
    video = sdk.videos.create_and_poll(
        prompt="a watercolour",
        model="stub",
        size=f"{W}x{H}",
        input_reference=("input.mkv", video_file(source, 16), "video/x-matroska"),
        poll_interval_ms=10,
    )
    assert (video.status, video.seconds, video.size) == ("completed", "1", f"{W}x{H}")
    content = sdk.videos.download_content(video.id).read()
    assert len(content) > 0
    sdk.videos.delete(video.id)


@pytest.mark.parametrize(
    ("file", "fields", "says"),
    [
        (b"not a video" * 40, {}, "input_reference: not a video file that decodes"),
        (None, {"input_strength": "0.5"}, "input_strength: given without input_reference"),
        ("short", {"num_frames": "20"}, "input_reference: the video is 8 frames at 16 fps (0.5 s), shorter than"),
        ("short", {"input_strength": "2"}, "input_strength: Input should be less than or equal to 1"),
    ],
)
def test_a_job_input_it_cannot_take_is_refused_naming_the_field(server, file, fields, says):
    data = video_file([picture(i) for i in range(8)], 16) if file == "short" else file
    refused = post_job(server, file=data, **fields)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_request" and says in error["message"], error


def test_a_json_body_cannot_carry_an_input_reference(server):
    refused = httpx.post(f"{server.http}/v1/videos", json={"prompt": "p", "input_reference": "https://x/v.mp4"})
    assert refused.status_code == 422
    assert "input_reference: send the input video as a file field" in refused.json()["error"]["message"]
    as_text = httpx.post(f"{server.http}/v1/videos", data={"prompt": "p", "input_reference": "v.mp4"})
    assert as_text.status_code == 422
    assert as_text.json()["error"]["message"].startswith("input_reference: expected a video file")
