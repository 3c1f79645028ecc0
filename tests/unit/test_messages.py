"""Wire types round-trip through the transport codec, stay frozen, and refuse garbage;
the messages between pipeline ranks too, and a malformed one is an error naming
what is wrong with it."""

from __future__ import annotations

import msgspec
import pytest

from rtvideo.engine import messages as m
from rtvideo.engine.transport import (
    decode_control,
    decode_rank,
    decode_result,
    encode_control,
    encode_rank,
    encode_result,
)

GEOMETRY = m.SessionGeometry(
    width=64,
    height=48,
    fps=16.0,
    num_inference_steps=4,
    first_chunk_frames=9,
    frames_per_chunk=12,
    num_chunks=None,
    transition_chunks=2,
)
TIMING = m.ChunkTiming(boundary_ms=0.5, denoise_ms=40.0, decode_ms=3.0, steps=4, runner_calls=(7, 7, 7, 7))

CONTROL = [
    m.StartSession(
        session_id="s",
        prompt="a fox",
        negative_prompt="blur",
        seed=2**62,
        width=64,
        height=48,
        fps=16.0,
        num_chunks=7,
        num_inference_steps=3,
        transition_chunks=2,
        scheduled=(m.ScheduledInteraction(at_chunk=3, event_id="e", interaction=m.Interaction(prompt="x")),),
    ),
    m.StartSession(session_id="minimal", prompt="p"),
    m.StartSession(
        session_id="v2v",
        prompt="a watercolour painting",
        input=m.VideoInput(strength=0.6, format="raw", width=64, height=48, fps=16.0),
    ),
    m.SubmitInteraction(
        session_id="s", event_id="e1", interaction=m.Interaction(prompt="ünïcødé ✓", transition_chunks=0)
    ),
    m.SubmitInput(session_id="v2v", chunk_index=1, count=2, height=2, width=3, frames=bytes(range(36))),
    m.Playback(session_id="s", position_seconds=1.25),
    m.Delivered(session_id="s", media_seconds=2.25),
    m.StopSession(session_id="s", reason="client_disconnected"),
    m.Probe(probe_id=3),
    m.Shutdown(reason="sigterm"),
    m.AttachWorker(config={"pp": 2, "pipeline": {"name": "tiny", "options": {"device": "cpu"}}}),
    m.Terminate(reason="wedged"),
]

RESULTS = [
    m.WorkerReady(
        rank=0,
        pid=123,
        pipeline="stub",
        supports_chunk_step_grouping=True,
        grouping=False,
        max_sessions=4,
        defaults=GEOMETRY,
        limits=m.ModelLimits(size_multiple=16, max_size=1280, max_inference_steps=4, max_fps=60.0),
        pipeline_ranks=(124,),
        blocks_per_rank=(1, 1),
        prompts=("a red circle moving right",),
    ),
    m.WorkerStartupFailed(rank=0, error="ValueError: no"),
    m.SessionStarted(session_id="s", geometry=GEOMETRY),
    m.SessionRejected(session_id="s", code="server_full", message="full"),
    m.ChunkReady(
        session_id="s",
        generation_chunk_index=2,
        num_frames=12,
        first_frame_index=21,
        media_start_seconds=1.3125,
        width=64,
        height=48,
        started_event_ids=("a",),
        active_event_ids=("a", "b"),
        completed_event_ids=(),
        timing=TIMING,
        payload=bytes(range(256)) * 10,
    ),
    m.InteractionQueued(session_id="s", event_id="e", in_progress_chunk_index=None, expected_chunk_index=0),
    m.InteractionApplied(
        session_id="s",
        event_id="e",
        generation_chunk_index=3,
        first_frame_index=33,
        media_start_seconds=2.0625,
        queued_to_applied_ms=12.5,
        transition_chunks=0,
    ),
    m.InteractionSuperseded(session_id="s", event_id="a", by_event_id="b"),
    m.InteractionRejected(session_id="s", event_id="a", code="event_id_conflict", message="reused"),
    m.SessionDone(
        session_id="s",
        chunks=3,
        frames=33,
        stopped=True,
        reason="stopped",
        applied=(m.AppliedInteraction(event_id="e", at_chunk=1, prompt="x", transition_chunks=0),),
    ),
    m.SessionFailed(session_id="s", code="pipeline_error", message="boom"),
    m.EngineDead(reason="bug"),
    m.ProbeReply(
        probe_id=1,
        sessions=("s",),
        runner_sessions=("s",),
        pipeline_sessions=(),
        iterations=3,
        busy_s=0.5,
        pipeline_s=0.4,
        steps=12,
        chunks=3,
    ),
    m.EngineStats(
        micro_steps=10,
        rows=14,
        rows_per_micro_step=2,
        micro_step_s=0.02,
        slo_decisions={"hold": 9, "decrease": 0, "increase": 1},
        ranks=(m.RankFigures(rank=0, busy_s=0.1, wall_s=0.2), m.RankFigures(rank=1, busy_s=0.15, wall_s=0.2)),
        step_graphs={"captures": 2, "replays": 13, "fallbacks": 2, "held": 2},
    ),
    m.WorkerHello(host="gpu-3", pid=4242, world_size=2),
    m.WorkerExiting(code=143, reason="its launcher ended the group (SIGTERM)"),
]


RANK = [
    m.RankPlan(
        number=7,
        release=("gone",),
        open=(m.StartSession(session_id="new", prompt="p", prompt_change="reset"),),
        boundaries=(m.RankBoundary(session_id="s", chunk_index=2, prompt_changed=True),),
        ranks=(
            (m.RankRow(session_id="s", chunk_index=2, step=0),),
            (),
            (m.RankRow(session_id="t", chunk_index=0, step=4),),
        ),
    ),
    m.RankPlan(number=0),
    m.RingHeader(
        items=(
            m.RingItem(kind="forward", count=2, meta={"blocks_done": 3, "rows": [["s", 2, 0]], "grouped": True}),
            m.RingItem(kind="commit", count=0, rows=(("t", 0, 4),)),
            m.RingItem(kind="forward", count=1, rows=(("u", 1, 2),)),
        ),
        failed={"v": "rank 1: forward failed: RuntimeError: boom"},
        figures=(m.RankFigures(rank=1, busy_s=0.5, wall_s=0.75),),
        tensors=(m.TensorSpec(shape=(2, 48, 128), dtype="torch.bfloat16"), m.TensorSpec(shape=(), dtype="torch.int64")),
        inline=False,
    ),
    m.RingHeader(),
    m.DecodeWhole(session_id="s", chunk_index=3, tensors=(m.TensorSpec(shape=(1, 16, 3, 8), dtype="torch.float32"),)),
    m.DecodeFront(session_id="s", chunk_index=3, split=7, part=2, meta={"slot": 1}),
    m.DecodeFrontEnd(session_id="s", chunk_index=3, split=7, front_ms=4.5, error="decode failed: boom"),
    m.DecodeFrontEnd(session_id="s", chunk_index=4, split=7, cancelled=True),
    m.DecodeFronts(rows=(("s", 3), ("t", 0)), split=7, part=0, meta={"slot": -1}),
    m.DecodeFrontsEnd(rows=(("s", 3), ("t", 0)), split=7, front_ms=2.0, retry=True),
    m.DecodeCancel(session_id="s"),
    m.DecodeCancel(session_id="s", ended=True),
    m.Decoded(session_id="s", chunk_index=3, ms=12.5, frames=(4, 64, 48)),
    m.Decoded(session_id="s", chunk_index=4, ms=0.0, cancelled=True),
    m.Decoded(session_id="s", chunk_index=5, ms=1.0, error="rank 1: decode failed: RuntimeError: x"),
]


@pytest.mark.parametrize("message", CONTROL, ids=lambda x: type(x).__name__)
def test_control_messages_round_trip(message):
    assert decode_control(encode_control(message)) == message


@pytest.mark.parametrize("message", RESULTS, ids=lambda x: type(x).__name__)
def test_result_messages_round_trip(message):
    decoded = decode_result(encode_result(message))
    assert decoded == message and type(decoded) is type(message)


@pytest.mark.parametrize("message", RANK, ids=lambda x: type(x).__name__)
def test_rank_messages_round_trip(message):
    decoded = decode_rank(encode_rank(message), type(message))
    assert decoded == message and type(decoded) is type(message)


def test_every_wire_type_is_covered_by_the_round_trip_tests():
    covered = {type(x) for x in CONTROL + RESULTS + RANK}
    wire = {t for t in vars(m).values() if isinstance(t, type) and issubclass(t, m._Wire) and t is not m._Wire}
    assert wire == covered


def test_tags_are_the_wire_type_field():
    assert msgspec.msgpack.decode(encode_control(m.Probe(probe_id=1)))["type"] == "probe"


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        m.Probe(probe_id=1).probe_id = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode({"type": "no_such_type"}),
        msgspec.msgpack.encode({"type": "start_session"}),  # missing fields
        msgspec.msgpack.encode({"type": "probe", "probe_id": "one"}),  # wrong type
        msgspec.msgpack.encode([1, 2, 3]),
    ],
)
def test_bad_bytes_are_a_decode_error(data):
    with pytest.raises(msgspec.DecodeError):
        decode_control(data)


def test_a_result_is_not_a_control_message():
    with pytest.raises(msgspec.DecodeError):
        decode_control(encode_result(m.EngineDead(reason="x")))


def _header(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": "ring_header", **fields})


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (b"\xc1", "MessagePack data is malformed"),
        (encode_rank(m.RankPlan(number=1)), "a RankPlan"),  # another rank message: not the header asked for
        (msgspec.msgpack.encode({"items": [], "failed": {}}), "missing required field `type`"),  # the old dict
        (msgspec.msgpack.encode({"type": "no_such_type"}), "Invalid value 'no_such_type' - at `$.type`"),
        (_header(warm_up=True), "unknown field `warm_up`"),
        (_header(items=[{"kind": "sideways", "count": 0}]), "Invalid enum value 'sideways' - at `$.items[0].kind`"),
        (_header(items=[{"kind": "forward", "count": "two"}]), "Expected `int`, got `str` - at `$.items[0].count`"),
        (_header(items=[{"kind": "forward", "count": -1, "meta": {}}]), "count must be >= 0"),
        (_header(items=[{"kind": "forward", "count": 2, "rows": [["s", 0, 1]]}]), "names 1 rows for 2 predictions"),
        (_header(figures=[{"rank": "one", "busy_s": 0.0, "wall_s": 0.0}]), "at `$.figures[0].rank`"),
    ],
)
def test_a_malformed_ring_header_is_an_error_naming_what_is_wrong(data, named):
    with pytest.raises(msgspec.DecodeError) as caught:
        decode_rank(data, m.RingHeader)
    assert str(caught.value).startswith("not a valid RingHeader: ") and named in str(caught.value)


def test_a_decode_request_is_any_of_its_types_and_decodes_as_the_one_sent():
    for message in (m.DecodeWhole(session_id="s", chunk_index=0), m.DecodeFrontsEnd(rows=(("s", 0),), split=2)):
        decoded = decode_rank(encode_rank(message), m.DecodeRequest)
        assert decoded == message and type(decoded) is type(message)


def _frame(kind: str, **fields) -> bytes:
    return msgspec.msgpack.encode({"type": kind, **fields})


_WHOLE = {"session_id": "s", "chunk_index": 0}


@pytest.mark.parametrize(
    ("data", "kind", "named"),
    [
        (b"\xc1", m.DecodeRequest, "MessagePack data is malformed"),
        (msgspec.msgpack.encode({"session": "s", "chunk": 0}), m.DecodeRequest, "missing required field `type`"),
        (_frame("decoded", ms=1.0, **_WHOLE), m.DecodeRequest, "a Decoded"),  # a reply is not a request
        (_frame("decode_cancel", session_id="s"), m.Decoded, "a DecodeCancel"),
        (_frame("decode_whole", session_id="s"), m.DecodeRequest, "missing required field `chunk_index`"),
        (_frame("decode_whole", chunk_index="0", session_id="s"), m.DecodeRequest, "Expected `int`, got `str`"),
        (_frame("decode_whole", last=True, **_WHOLE), m.DecodeRequest, "unknown field `last`"),
        (_frame("decode_front", part=0, **_WHOLE), m.DecodeRequest, "missing required field `split`"),
        (_frame("decode_front_end", split=2, cancelled="yes", **_WHOLE), m.DecodeRequest, "at `$.cancelled`"),
        (_frame("decode_fronts", rows=[], split=2, part=0), m.DecodeRequest, "names no rows"),
        (_frame("decode_fronts", rows=[["s"]], split=2, part=0), m.DecodeRequest, "at `$.rows[0]`"),
        (_frame("decode_fronts_end", rows=[], split=2), m.DecodeRequest, "names no rows"),
        (_frame("decode_cancel", session_id="s", ended=1), m.DecodeCancel, "Expected `bool`, got `int`"),
        (_frame("decoded", ms=1.0, frames=[4, 64], **_WHOLE), m.Decoded, "at `$.frames`"),
        (_frame("decoded", **_WHOLE), m.Decoded, "missing required field `ms`"),
        (_frame("decoded", ms=1.0, tensors=[{"shape": [3]}], **_WHOLE), m.Decoded, "at `$.tensors[0]`"),
    ],
)
def test_a_malformed_decode_frame_is_an_error_naming_what_is_wrong(data, kind, named):
    with pytest.raises(msgspec.DecodeError) as caught:
        decode_rank(data, kind)
    wanted = "DecodeWhole or DecodeFront or DecodeFrontEnd or DecodeFronts or DecodeFrontsEnd"
    assert str(caught.value).startswith(f"not a valid {wanted if kind is m.DecodeRequest else kind.__name__}: ")
    assert named in str(caught.value)


def test_a_malformed_decode_frame_from_a_rank_is_a_bad_message_naming_the_ranks():
    """What the ranks' sockets raise for it (``rtvideo.workers.parallel.link.frame_header``)."""
    from rtvideo.workers.parallel.link import BadMessage, frame_header

    with pytest.raises(BadMessage, match=r"^rank 2: a decoded chunk from rank 0: not a valid Decoded: .*`ms`"):
        frame_header(_frame("decoded", **_WHOLE), m.Decoded, 2, 0, "a decoded chunk")


def test_a_malformed_plan_is_an_error_naming_the_field():
    data = msgspec.msgpack.encode({"type": "rank_plan", "number": 3, "ranks": [[{"session_id": "s", "step": 0}]]})
    with pytest.raises(msgspec.DecodeError, match=r"not a valid RankPlan: .*`chunk_index` - at `\$.ranks\[0\]\[0\]`"):
        decode_rank(data, m.RankPlan)
