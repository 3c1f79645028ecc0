"""Video input on the server: a frame's header and image checked as it arrives
(``parse_frame``) and as it is decoded (``decode_image``), the bounded buffer
that drops the oldest frames (``FrameGatherer``), the feeder that hands each
chunk's frames to the engine in order and no further ahead than it may
(``InputFeeder``), and ``session.start.input`` as the schema and ``resolve``
take it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from rtvideo.engine.messages import SessionGeometry, VideoInput
from rtvideo.server.media import JpegEncoder, split_jpeg_payload
from rtvideo.server.metrics import Metrics
from rtvideo.server.schemas import ClientEvent, RequestError, check_input_message, describe_validation_error, resolve
from rtvideo.server.settings import ServerSettings
from rtvideo.server.video_input import (
    HEADER,
    MAX_CHUNKS_AHEAD,
    MAX_CHUNKS_WAITING,
    ChunkInput,
    FrameError,
    FrameGatherer,
    InputFeeder,
    InputFrame,
    JpegDecoder,
    decode_image,
    jpeg_size,
    parse_frame,
)

W, H = 8, 6
RAW = VideoInput(strength=0.0, format="raw", width=W, height=H, fps=16.0)
JPEG = VideoInput(strength=0.0, format="jpeg", width=W, height=H, fps=16.0)
GEOMETRY = SessionGeometry(
    width=W, height=H, fps=16.0, num_inference_steps=1, first_chunk_frames=3, frames_per_chunk=2,
    num_chunks=None, transition_chunks=0,
)  # fmt: skip


def pixels(index: int) -> np.ndarray:
    """A frame whose every byte says its index."""
    return np.full((H, W, 3), index % 256, dtype=np.uint8)


def raw_frame(index: int, capture_us: int = 0, image: bytes | None = None) -> bytes:
    return HEADER.pack(index, capture_us) + (pixels(index).tobytes() if image is None else image)


def jpeg_image(width: int = W, height: int = H) -> bytes:
    [image] = split_jpeg_payload(JpegEncoder(width, height).encode(np.zeros((1, height, width, 3), np.uint8), 0))
    return image


def frame(index: int, received_at: float = 0.0) -> InputFrame:
    return InputFrame(index=index, capture_us=0, image=pixels(index).tobytes(), received_at=received_at)


# -- parse_frame ------------------------------------------------------------------


def test_a_raw_frame_is_taken_with_its_header():
    taken = parse_frame(raw_frame(7, capture_us=2**40), RAW, last_index=6, received_at=1.5)
    assert (taken.index, taken.capture_us, taken.received_at) == (7, 2**40, 1.5)
    assert taken.image == pixels(7).tobytes()


@pytest.mark.parametrize(
    ("data", "last", "index", "says"),
    [
        (
            b"\x00" * 11,
            4,
            None,
            "a binary frame of 11 bytes (the frame after frame 4): shorter than the 12-byte header",
        ),
        (b"", None, None, "a binary frame of 0 bytes: shorter than the 12-byte header"),
        (raw_frame(4), 4, 4, "frame 4: its index is not above the last frame's (4)"),
        (raw_frame(3), 4, 3, "frame 3: its index is not above the last frame's (4)"),
        (raw_frame(5, image=b"\x00" * 10), 4, 5, "frame 5: 10 bytes of raw RGB after the header; a 8x6 frame"),
        (raw_frame(5, image=pixels(5).tobytes() + b"\x00"), 4, 5, f"frame 5: {W * H * 3 + 1} bytes of raw RGB"),
    ],
)
def test_a_bad_frame_is_refused_naming_it_and_what_was_wrong(data, last, index, says):
    with pytest.raises(FrameError) as refused:
        parse_frame(data, RAW, last_index=last, received_at=0.0)
    assert str(refused.value).startswith(says), str(refused.value)
    assert refused.value.frame_index == index


def test_a_jpeg_frame_needs_an_image_after_its_header():
    with pytest.raises(FrameError, match="frame 2: no image after the header"):
        parse_frame(HEADER.pack(2, 0), JPEG, last_index=None, received_at=0.0)


# -- decode_image -----------------------------------------------------------------


def test_a_jpeg_decodes_to_rgb_of_the_declared_size():
    taken = parse_frame(HEADER.pack(0, 0) + jpeg_image(), JPEG, None, 0.0)
    decoded = decode_image(taken, JPEG, None)
    assert decoded.shape == (H, W, 3) and decoded.dtype == np.uint8


def test_a_jpeg_that_does_not_decode_or_has_another_size_is_refused_naming_the_frame():
    garbage = InputFrame(index=9, capture_us=0, image=b"\xff\xd8not a jpeg at all" * 4, received_at=0.0)
    with pytest.raises(FrameError, match=r"^frame 9: not a JPEG image that decodes") as refused:
        decode_image(garbage, JPEG, None)
    assert refused.value.frame_index == 9
    larger = InputFrame(index=10, capture_us=0, image=jpeg_image(16, 12), received_at=0.0)
    with pytest.raises(FrameError, match=r"^frame 10: a 16x12 image; the session's input is 8x6"):
        decode_image(larger, JPEG, None)


def test_a_jpegs_size_is_read_from_its_frame_header_without_decoding_it():
    assert jpeg_size(jpeg_image(16, 12)) == (16, 12)
    assert jpeg_size(b"\xff\xd8 not segments") is None and jpeg_size(b"GIF89a") is None
    with pytest.raises(FrameError, match=r"^frame 4: a 16x12 image; the session's input is 8x6") as refused:
        parse_frame(HEADER.pack(4, 0) + jpeg_image(16, 12), JPEG, last_index=3, received_at=0.0)
    assert refused.value.frame_index == 4


def claiming(width: int, height: int, stray: bytes = b"\x00") -> bytes:
    """A small JPEG whose frame header claims ``width x height``, with ``stray``
    bytes between its start marker and its first segment (which decoders pass over)."""
    image = bytearray(jpeg_image(16, 16))
    at = next(i for i in range(2, len(image) - 1) if image[i] == 0xFF and image[i + 1] in (0xC0, 0xC2))
    image[at + 5 : at + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(image[:2] + stray + image[2:])


def test_a_jpeg_claiming_a_huge_size_is_refused_by_its_size_without_being_decoded():
    bomb = claiming(8000, 8000)  # 8000x8000 would decode to 96 MB of RGB
    assert jpeg_size(bomb) == (8000, 8000)  # read past the stray byte, as a decoder reads
    with pytest.raises(FrameError, match=r"^frame 5: a 8000x8000 image; the session's input is 8x6"):
        parse_frame(HEADER.pack(5, 0) + bomb, JPEG, last_index=None, received_at=0.0)
    # What the size check cannot read, the decoder's own bound refuses before allocating a picture.
    assert JpegDecoder(W, H).decode(jpeg_image()).width == W
    with pytest.raises(ValueError):
        JpegDecoder(W, H).decode(claiming(200, 200, stray=b""))
    past_it = InputFrame(index=6, capture_us=0, image=claiming(8000, 8000, stray=b""), received_at=0.0)
    with pytest.raises(FrameError, match=r"^frame 6: a 8000x8000 image; the session's input is 8x6"):
        decode_image(past_it, JPEG, JpegDecoder(W, H))


def test_a_frame_refused_while_decoding_keeps_no_traceback(metrics):
    """Its traceback would hold the decode's frames, a picture as large as the image
    claimed among them, in a cycle through the list of errors: freed only by a full
    collection, which a server rarely runs (each such session held its pictures)."""
    feeder = InputFeeder(JPEG, Sink(), metrics, on_error=lambda error: None)
    garbage = InputFrame(index=1, capture_us=0, image=b"\xff\xd8not a jpeg at all" * 4, received_at=0.0)
    good, errors = feeder._decode([garbage])
    assert good == [] and len(errors) == 1 and errors[0].__traceback__ is None


def test_a_raw_image_is_its_bytes():
    assert np.array_equal(decode_image(frame(3), RAW, None), pixels(3))


# -- FrameGatherer ----------------------------------------------------------------


def test_the_gatherer_drops_its_oldest_frames_past_its_capacity_and_counts_them():
    gatherer = FrameGatherer(capacity=3)
    assert [gatherer.add(frame(i)) for i in range(3)] == [[], [], []]
    dropped = gatherer.add(frame(3))
    assert [f.index for f in dropped] == [0]
    gatherer.add(frame(4))
    assert (gatherer.dropped, gatherer.taken, gatherer.last_index, len(gatherer)) == (2, 5, 4, 3)
    assert [f.index for f in gatherer.take(2)] == [2, 3]
    assert [f.index for f in gatherer.take(5)] == [4]
    assert gatherer.take(1) == []


# -- InputFeeder ------------------------------------------------------------------


class Sink:
    """The engine's side: records each chunk's input, and says when one arrived."""

    geometry = GEOMETRY

    def __init__(self) -> None:
        self.chunks: list[tuple[int, np.ndarray]] = []
        self.arrived = asyncio.Event()

    async def send_input(self, chunk_index: int, frames: np.ndarray) -> None:
        self.chunks.append((chunk_index, frames))
        self.arrived.set()

    async def next_chunk(self) -> tuple[int, np.ndarray]:
        while not self.chunks:
            self.arrived.clear()
            await self.arrived.wait()
        return self.chunks.pop(0)


def metric(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(worker_up=lambda: True)


async def test_chunks_go_to_the_engine_in_order_each_with_its_own_frames(metrics):
    sink = Sink()
    feeder = InputFeeder(RAW, sink, metrics, on_error=pytest.fail, num_chunks=3)
    task = asyncio.create_task(feeder.run())
    for i in range(5):  # chunk 0 (3 frames) and chunk 1 (2): both may go before the engine makes one
        feeder.receive(raw_frame(10 + i), received_at=float(i))
    chunks = [await asyncio.wait_for(sink.next_chunk(), 10) for _ in range(2)]
    for i in range(5, 7):
        feeder.receive(raw_frame(10 + i), received_at=float(i))
    await asyncio.wait_for(feeder.settled(), 10)
    assert not sink.chunks  # chunk 2 waits for the engine to make chunk 0
    feeder.made(0)
    chunks.append(await asyncio.wait_for(sink.next_chunk(), 10))
    await asyncio.wait_for(task, 10)  # the last chunk's input went: the feeder is done
    assert [k for k, _ in chunks] == [0, 1, 2]
    assert [len(f) for _, f in chunks] == [3, 2, 2]
    assert np.array_equal(np.concatenate([f for _, f in chunks]), np.stack([pixels(10 + i) for i in range(7)]))
    assert feeder.sent[1].indexes == (13, 14) and feeder.sent[1].received_at == (3.0, 4.0)
    feeder.receive(raw_frame(30))  # past the last chunk: ignored, not an error
    assert (feeder.dropped, feeder.invalid) == (0, 0)
    assert metric(metrics, "rtvideo_input_frames_received_total") == 8


async def test_no_more_than_max_chunks_ahead_go_before_the_engine_makes_one_and_the_oldest_waiting_drop(metrics):
    sink = Sink()
    feeder = InputFeeder(RAW, sink, metrics, on_error=pytest.fail)
    task = asyncio.create_task(feeder.run())
    capacity = MAX_CHUNKS_WAITING * 3  # the larger chunk (the first) counts
    ahead = GEOMETRY.first_chunk_frames + (MAX_CHUNKS_AHEAD - 1) * GEOMETRY.frames_per_chunk
    index = 0
    while len(sink.chunks) < MAX_CHUNKS_AHEAD:  # the engine takes the first chunks' input as it comes
        feeder.receive(raw_frame(index))
        index += 1
        await asyncio.wait_for(feeder.settled(), 10)
    assert index == ahead
    for _ in range(capacity + 5):  # the engine makes nothing: these wait, and the oldest of them drop
        feeder.receive(raw_frame(index))
        index += 1
        await asyncio.wait_for(feeder.settled(), 10)
    assert len(sink.chunks) == MAX_CHUNKS_AHEAD
    assert feeder.dropped == 5 and metric(metrics, "rtvideo_input_frames_dropped_total") == 5
    assert [f.index for f in feeder.gatherer.waiting] == list(range(index - capacity, index))
    feeder.made(0)  # one chunk made: the next one's input goes, from the oldest frames still waiting
    await asyncio.wait_for(feeder.settled(), 10)
    k, frames = sink.chunks[-1]
    assert k == MAX_CHUNKS_AHEAD
    assert feeder.sent[k].indexes == tuple(range(index - capacity, index - capacity + 2))
    assert np.array_equal(frames[0], pixels(index - capacity))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_jpeg_that_does_not_decode_is_reported_and_the_next_frame_takes_its_place(metrics):
    sink = Sink()
    refused: list[FrameError] = []
    feeder = InputFeeder(JPEG, sink, metrics, on_error=refused.append, num_chunks=1)
    task = asyncio.create_task(feeder.run())
    good = jpeg_image()
    feeder.receive(HEADER.pack(0, 0) + good)
    feeder.receive(HEADER.pack(1, 0) + b"\xff\xd8broken" * 8)
    with pytest.raises(FrameError, match=r"^frame 2: a 4x4 image; the session's input is 8x6"):
        feeder.receive(HEADER.pack(2, 0) + jpeg_image(4, 4))  # refused as it comes: its frame header says 4x4
    feeder.receive(HEADER.pack(3, 0) + good)
    feeder.receive(HEADER.pack(4, 0) + good)
    k, frames = await asyncio.wait_for(sink.next_chunk(), 10)
    await asyncio.wait_for(task, 10)
    assert k == 0 and frames.shape == (3, H, W, 3)
    assert feeder.sent[0].indexes == (0, 3, 4)
    assert [(e.frame_index, str(e).split(":")[0]) for e in refused] == [(1, "frame 1")]
    assert feeder.invalid == 2 and metric(metrics, "rtvideo_input_frames_invalid_total") == 2


async def test_a_refused_frame_on_arrival_is_counted_and_the_index_check_follows_the_frames_taken(metrics):
    feeder = InputFeeder(RAW, Sink(), metrics, on_error=pytest.fail)
    feeder.receive(raw_frame(5))
    with pytest.raises(FrameError, match="frame 6: 3 bytes"):
        feeder.receive(raw_frame(6, image=b"abc"))
    feeder.receive(raw_frame(6))  # the refused frame's index was not taken: the corrected one is
    with pytest.raises(FrameError, match=r"frame 6: its index is not above the last frame's \(6\)"):
        feeder.receive(raw_frame(6))
    assert feeder.invalid == 2 and metric(metrics, "rtvideo_input_frames_invalid_total") == 2
    assert metric(metrics, "rtvideo_input_frames_received_total") == 4


async def test_each_output_frame_is_timed_from_its_input_frame_once(metrics):
    feeder = InputFeeder(RAW, Sink(), metrics, on_error=pytest.fail)
    feeder.sent[0] = ChunkInput(indexes=(0, 1, 2), received_at=(1.0, 2.0, 3.0))
    feeder.sent[1] = ChunkInput(indexes=(3, 4), received_at=(4.0, 5.0))
    feeder.sent[2] = ChunkInput(indexes=(5, 6), received_at=(6.0, 7.0))
    assert feeder.written(1, frames=1, now=5.5).indexes == (3, 4)  # a trimmed chunk: its first frame only
    assert 0 not in feeder.sent and 1 not in feeder.sent  # an older chunk never written is forgotten
    assert feeder.written(1, frames=2, now=9.0) is None  # observed once
    assert metric(metrics, "rtvideo_input_frame_latency_seconds_count") == 1
    assert metric(metrics, "rtvideo_input_frame_latency_seconds_sum") == pytest.approx(1.5)


# -- session.start.input ----------------------------------------------------------

EVENTS: TypeAdapter = TypeAdapter(ClientEvent)
START = {"type": "session.start", "prompt": "p"}
INPUT = {"kind": "video", "strength": 0.5, "format": "raw", "width": 32, "height": 24, "fps": 16}
STUB = SessionGeometry(
    width=64, height=64, fps=16.0, num_inference_steps=4, first_chunk_frames=4, frames_per_chunk=4,
    num_chunks=None, transition_chunks=0,
)  # fmt: skip


def start_refusal(**fields) -> str:
    with pytest.raises(ValidationError) as caught:
        EVENTS.validate_python({**START, **fields})
    return describe_validation_error(caught.value)


@pytest.mark.parametrize(
    ("given", "names"),
    [
        ({"kind": "audio"}, "input.kind: Input should be 'video'"),
        ({"strength": 1.5}, "input.strength: Input should be less than or equal to 1"),
        ({"strength": -0.1}, "input.strength: Input should be greater than or equal to 0"),
        ({"format": "png"}, "input.format: Input should be 'jpeg' or 'raw'"),
        ({"width": 1}, "input.width: Input should be greater than or equal to 2"),
        ({"fps": 0}, "input.fps: Input should be greater than 0"),
        ({"fps": 1000}, "input.fps: Input should be less than or equal to 120"),
        ({"bogus": 1}, "input.bogus: Extra inputs are not permitted"),
    ],
)
def test_a_bad_input_is_refused_naming_its_field(given, names):
    assert names in start_refusal(input={**INPUT, **given})


def test_an_input_needs_kind_strength_and_its_size_and_rate():
    message = start_refusal(input={"format": "raw"})
    for field in ("kind", "strength", "width", "height", "fps"):
        assert f"input.{field}: Field required" in message


def test_the_session_takes_the_inputs_size_and_rate_and_passes_the_input_to_the_engine():
    event = EVENTS.validate_python({**START, "input": INPUT})
    start, config = resolve(event, "s", STUB, ServerSettings(), "stub", video_input=event.input.engine())
    assert (start.width, start.height, start.fps) == (config.width, config.height, config.fps) == (32, 24, 16.0)
    assert start.input == VideoInput(kind="video", strength=0.5, format="raw", width=32, height=24, fps=16.0)
    assert config.input == {"kind": "video", "strength": 0.5, "format": "raw", "width": 32, "height": 24, "fps": 16.0}
    same = EVENTS.validate_python({**START, "width": 32, "height": 24, "fps": 16, "input": INPUT})
    assert resolve(same, "s", STUB, ServerSettings(), "stub", video_input=same.input.engine())[0].width == 32


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"width": 64}, "input.width: 32 differs from the session's width (64)"),
        ({"height": 64}, "input.height: 24 differs from the session's height (64)"),
        ({"fps": 30}, "input.fps: 16 differs from the session's fps (30)"),
    ],
)
def test_a_session_size_or_rate_other_than_the_inputs_is_refused_naming_both(fields, says):
    event = EVENTS.validate_python({**START, **fields, "input": INPUT})
    with pytest.raises(RequestError) as refused:
        resolve(event, "s", STUB, ServerSettings(), "stub", video_input=event.input.engine())
    assert str(refused.value).startswith(says), str(refused.value)


def test_the_servers_limits_name_the_input_field_the_size_came_from():
    event = EVENTS.validate_python({**START, "input": {**INPUT, "width": 2000, "format": "jpeg"}})
    with pytest.raises(RequestError, match=r"^input.width: at most 1280, got 2000"):
        resolve(event, "s", STUB, ServerSettings(), "stub", video_input=event.input.engine())
    event = EVENTS.validate_python({**START, "input": {**INPUT, "width": 640, "height": 480}})
    with pytest.raises(RequestError, match=r"^input.format: a raw 640x480 frame is 921612 bytes .* \(1000\)"):
        check_input_message(event.input.engine(), ServerSettings(max_message_bytes=1000))
    check_input_message(event.input.engine(), ServerSettings(max_message_bytes=921612))
