"""The pipeline ranks' own sockets (``rtvideo.workers.parallel.sockets``): real TCP
connections on loopback between ranks that meet in a real ``torch.distributed``
store, each rank on a thread of its own (as each would be in its process).

Tensors of every dtype the ranks send arrive equal with their
``RingHeader``; a ring frame whose header is not one raises ``BadMessage``
naming the ranks and what is wrong; frames asked for in
another order than they were sent are matched by kind and tag; two ranks that
send each other messages far larger than the kernel's buffers before either
receives do not deadlock (the connection's thread writes what the kernel did
not take); a silent peer raises ``LinkTimeout``, a closed one ``PeerClosed``,
both naming the rank; a stop ends the plans."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import msgspec
import pytest
import torch
import torch.distributed as dist

from rtvideo.engine.messages import DecodeCancel, Decoded, DecodeWhole, RingHeader, RingItem
from rtvideo.workers.parallel.link import BadMessage, LinkTimeout, Message
from rtvideo.workers.parallel.sockets import (
    CANCEL,
    DECODE,
    DECODED,
    MAX_KEPT,
    PIPELINE,
    RING,
    PeerClosed,
    RankSockets,
    decode_peers,
    receives_from,
    sends_to,
)


def test_who_writes_to_whom():
    assert [sends_to(rank, 2) for rank in range(2)] == [[1], [0]]
    assert [sends_to(rank, 3) for rank in range(3)] == [[1, 2], [2], [0]]  # plans 0 -> every follower; the ring
    assert [receives_from(rank, 3) for rank in range(3)] == [[2], [0], [0, 1]]
    assert [decode_peers(rank, 3) for rank in range(3)] == [[1, 2], [0], [0]]  # both ways, on connections apart


def joined(world: int, timeout_s: float = 5.0, stranger: bool = False) -> list[RankSockets]:
    """``world`` ranks, every one listening, then every one connecting, each on its thread."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    ranks = [RankSockets(rank, world, timeout_s) for rank in range(world)]
    for rank in ranks:
        rank.listen(store, "127.0.0.1")
    errors: list[BaseException] = []

    def connect(rank: RankSockets) -> None:
        try:
            rank.connect(store, 10.0)
        except BaseException as error:  # surfaced below
            errors.append(error)

    if stranger:  # a connection that is no rank's, before the ranks': refused, the group still joins
        host, port = store.get("sockets/0").decode().rsplit(":", 1)
        strangers = [socket.create_connection((host, int(port))) for _ in range(2)]
        strangers[0].sendall(b"GET / HTTP/1.0\r\n\r\n")
    threads = [threading.Thread(target=connect, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors, errors
    return ranks


@pytest.fixture
def pair():
    ranks = joined(2)
    yield ranks
    for rank in ranks:
        rank.close()


def sample_tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randn(2, 48, 128, generator=generator),
        torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        torch.randn(4, generator=generator).to(torch.float16),
        torch.arange(7, dtype=torch.int64),
        torch.tensor([1, 2, 3], dtype=torch.uint8),
        torch.empty(0, 4),
        torch.tensor(2.5),
        torch.randn(8, 8, generator=generator).t(),  # not contiguous
    ]


def marked(mark: object) -> RingHeader:
    """A ring header told apart by ``mark`` (in ``failed``, which carries any string)."""
    return RingHeader(failed={"mark": str(mark)})


def mark(message: Message) -> str:
    return message.header.failed["mark"]


def sent_as(message: Message) -> RingHeader:
    """The header as its sender made it (without what the sockets add: the tensors' shapes)."""
    return msgspec.structs.replace(message.header, tensors=())


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def test_tensors_of_every_dtype_arrive_equal_with_their_header(pair):
    zero, one = pair
    items = (RingItem(kind="forward", count=len(sample_tensors()), meta={"rows": [["s", 0, 1]]}),)
    header = RingHeader(items=items, failed={"t": "rank 1: boom"})
    zero.send(1, 7, Message(header, sample_tensors()))
    got = one.recv(0, 7)
    assert sent_as(got) == header
    assert [(spec.shape, spec.dtype) for spec in got.header.tensors] == [
        (tuple(t.shape), str(t.dtype)) for t in sample_tensors()
    ]
    assert same(got.tensors, sample_tensors())
    one.send(0, 8, Message(RingHeader(), []))  # the last rank's answer: no tensors at all
    assert zero.recv(1, 8).tensors == []
    zero.wait_sent()
    assert zero.transfers == 1 and zero.bytes_sent > 2 * 48 * 128 * 4


def test_frames_are_matched_by_kind_and_tag_whatever_order_they_are_asked_in(pair):
    zero, one = pair
    zero.send(1, 1, Message(marked(1), [torch.ones(3)]))
    zero.send(1, 2, Message(marked(2), [torch.zeros(3)]))
    zero.send_plan(2, b"plan two")
    assert one.recv_plan() == b"plan two"  # behind two ring frames, which are kept
    assert mark(one.recv(0, 2)) == "2"
    assert torch.equal(one.recv(0, 1).tensors[0], torch.ones(3))
    zero.send_stop()
    assert one.recv_plan() is None


def test_a_plan_carries_rank_1s_ring_message_in_one_frame(pair):
    """``send_plan`` with a ring message (rank 0 sends rank 1 the rows it runs
    under that plan with the plan itself): one frame, one write; rank 1 reads
    the plan and finds the ring message kept for ``recv``, tensors equal."""
    zero, one = pair
    header = RingHeader(items=(RingItem(kind="forward", count=len(sample_tensors()), meta={"rows": [["s", 0, 1]]}),))
    before = zero.bytes_sent
    zero.send_plan(5, b"plan five", (5, Message(header, sample_tensors())))
    zero.send_plan(6, b"plan six")  # a plan carrying nothing is a plain plan frame
    assert zero.transfers == 1
    assert one.recv_plan() == b"plan five"
    got = one.recv(0, 5)
    assert sent_as(got) == header and same(got.tensors, sample_tensors())
    assert one.recv_plan() == b"plan six"
    sizes = sum(t.numel() * t.element_size() for t in sample_tensors())
    assert zero.bytes_sent - before > sizes  # the tensors went once, in the plan's frame
    with pytest.raises(LinkTimeout):  # nothing else came: no second copy of the ring message
        one.take(0, (RING,), 5, 0.2, "ring message")


def test_large_messages_both_ways_at_once_do_not_deadlock(pair):
    zero, one = pair
    big = [torch.arange(8 << 20, dtype=torch.float32)]  # 32 MiB each way, far past the kernel's buffers
    began = time.monotonic()
    zero.send(1, 1, Message(marked(0), big))  # neither has received yet: both sends must return
    one.send(0, 1, Message(marked(1), big))
    got_at_one, got_at_zero = one.recv(0, 1), zero.recv(1, 1)
    zero.wait_sent()
    one.wait_sent()
    assert mark(got_at_one) == "0" and mark(got_at_zero) == "1"
    assert same(got_at_one.tensors, big) and same(got_at_zero.tensors, big)
    assert time.monotonic() - began < 10


def test_a_silent_peer_times_out_naming_it():
    zero, one = joined(2, timeout_s=0.3)
    try:
        began = time.monotonic()
        with pytest.raises(LinkTimeout, match="ring message from rank 0 not done within 0.3 s"):
            one.recv(0, 99)
        assert time.monotonic() - began < 3
    finally:
        zero.close()
        one.close()


def test_a_closed_peer_raises_at_once_naming_it(pair):
    zero, one = pair
    zero.close()  # as the kernel closes a killed rank's sockets
    began = time.monotonic()
    with pytest.raises(PeerClosed, match="rank 0 closed its connection"):
        one.recv(0, 1)
    with pytest.raises(PeerClosed, match="rank 0"):
        one.recv_plan()
    assert time.monotonic() - began < 1  # not the 5 s timeout


def test_a_connection_that_is_no_ranks_does_not_stop_the_group_joining(monkeypatch):
    monkeypatch.setattr("rtvideo.workers.parallel.sockets.HELLO_TIMEOUT_S", 0.5)  # the silent one's wait
    zero, one = joined(2, stranger=True)
    try:
        zero.send(1, 1, Message(marked("ok"), []))
        assert mark(one.recv(0, 1)) == "ok"
        one.send(0, 2, Message(marked("back"), []))
        assert mark(zero.recv(1, 2)) == "back"
    finally:
        zero.close()
        one.close()


def test_three_ranks_carry_plans_to_every_follower_and_the_ring_round():
    ranks = joined(3)
    try:
        zero, one, two = ranks
        zero.send_plan(1, b"p1")
        assert one.recv_plan() == b"p1" and two.recv_plan() == b"p1"
        zero.send(1, 2, Message(marked(0), [torch.full((2,), 1.0)]))
        one.send(2, 3, Message(marked(1), [one.recv(0, 2).tensors[0] + 1]))
        two.send(0, 4, Message(marked(2), [two.recv(1, 3).tensors[0] + 1]))
        back = zero.recv(2, 4)
        assert mark(back) == "2" and torch.equal(back.tensors[0], torch.full((2,), 3.0))
    finally:
        for rank in ranks:
            rank.close()


def test_two_threads_wait_on_one_connection_for_frames_of_their_own_kinds(pair):
    """Threads waiting on one connection for frames of different kinds (here a
    plan reader and a ring reader): whichever reads hands the other what is
    its, in the order sent, and a zero timeout takes only what has arrived."""
    first, second = pair
    got: dict[str, list] = {"plans": [], "ring": []}
    ready = threading.Barrier(3)

    def plans() -> None:
        ready.wait()
        for _ in range(20):
            got["plans"].append(second.recv_plan())

    def ring() -> None:
        ready.wait()
        for tag in range(20):
            got["ring"].append(int(second.recv(0, tag).tensors[0].item()))

    threads = [threading.Thread(target=plans), threading.Thread(target=ring)]
    for thread in threads:
        thread.start()
    ready.wait()
    for n in range(20):
        first.send_plan(n, f"plan {n}".encode())
        first.send(1, n, Message(RingHeader(), [torch.tensor(n)]))
    for thread in threads:
        thread.join(10)
    assert got["plans"] == [f"plan {n}".encode() for n in range(20)]
    assert got["ring"] == list(range(20))
    with pytest.raises(LinkTimeout):
        second.take(0, (DECODE,), None, 0.0, "decode request")


def test_the_decode_stage_has_connections_of_its_own_both_ways(pair):
    """Decode frames do not queue behind the ring: a request taken while a ring
    message larger than the kernel's buffers is still on its way, and a
    result back the other way, while the plan channel holds a frame unread."""
    first, second = pair
    big = torch.zeros(64 * 2**20, dtype=torch.uint8)  # 64 MiB: written by the connection's thread
    first.send(1, 0, Message(RingHeader(), [big]))
    first.send_plan(0, b"unread")
    first.post(1, DECODE, 3, Message(DecodeWhole(session_id="s", chunk_index=3), [torch.arange(4)]))
    kind, request = second.take(0, (DECODE, CANCEL), None, 5.0, "decode request")
    assert kind == DECODE and request.header.session_id == "s" and request.tensors[0].tolist() == [0, 1, 2, 3]
    decoded = Decoded(session_id="s", chunk_index=3, ms=1.0, frames=(1, 2, 2))
    second.post(0, DECODED, 3, Message(decoded, [torch.ones(12, dtype=torch.uint8)]))
    _, result = first.take(1, (DECODED,), None, 5.0, "decoded chunk")
    assert result.header.frames == (1, 2, 2) and result.tensors[0].sum().item() == 12
    assert second.recv(0, 0).tensors[0].numel() == big.numel()
    assert second.recv_plan() == b"unread"
    with pytest.raises(ValueError, match="different connections"):
        second.take(0, (RING, DECODE), None, 0.0, "mixed")


def test_decode_requests_a_cancel_check_passes_wait_for_the_decode_thread_past_the_ring_channels_bound(pair):
    """A follower's cancel check reads the decode connection for cancels and
    keeps the decode requests it passes for the decode thread: more of them
    than the pipeline channel would keep are kept, in order (the engine bounds
    them: ``MAX_KEPT``). Frames nobody asks for on the pipeline channel still
    break it past its bound, naming the ranks."""
    zero, one = pair
    waiting = MAX_KEPT[PIPELINE] + 44
    for chunk in range(waiting):
        zero.post(1, DECODE, chunk, Message(DecodeWhole(session_id="s", chunk_index=chunk), []))
    zero.post(1, CANCEL, 0, Message(DecodeCancel(session_id="s"), []))
    kind, cancel = one.take(0, (CANCEL,), None, 5.0, "cancel")
    assert kind == CANCEL and cancel.header == DecodeCancel(session_id="s")
    for chunk in range(waiting):
        kind, request = one.take(0, (DECODE, CANCEL), None, 5.0, "decode request")
        assert kind == DECODE and request.header.chunk_index == chunk
    for n in range(MAX_KEPT[PIPELINE] + 1):
        zero.send(1, n, Message(RingHeader(), []))
    zero.send_plan(0, b"behind the ring frames")
    with pytest.raises(RuntimeError, match=f"rank 1: {MAX_KEPT[PIPELINE]} frames from rank 0 nobody asked for"):
        one.recv_plan()


def test_a_ring_frame_whose_header_is_not_a_ring_header_names_the_ranks_and_what_is_wrong(pair):
    zero, one = pair
    with pytest.raises(TypeError, match="a ring message's header is a RingHeader, not dict"):
        zero.send(1, 1, Message({"items": []}, []))
    with pytest.raises(TypeError, match="a ring message's header is a RingHeader, not DecodeWhole"):
        zero.post(1, RING, 1, Message(DecodeWhole(session_id="s", chunk_index=0), []))
    zero._post(1, RING, 2, msgspec.msgpack.encode({"items": [], "failed": {}}), [])  # the untyped header of old
    with pytest.raises(BadMessage, match=r"rank 1: a ring message from rank 0: not a valid RingHeader: .*`type`"):
        one.recv(0, 2)
    raw = {"type": "ring_header", "items": [{"kind": "sideways", "count": 0}]}
    zero._post(1, RING, 3, msgspec.msgpack.encode(raw), [])
    with pytest.raises(BadMessage, match=r"Invalid enum value 'sideways' - at `\$.items\[0\].kind`"):
        one.recv(0, 3)
    zero.send(1, 4, Message(marked("after"), []))  # the connection is intact: a frame is read whole
    assert mark(one.recv(0, 4)) == "after"


@pytest.mark.parametrize(
    ("kind", "header", "named"),
    [
        (DECODE, {"session": "s", "chunk": 0}, r"a decode request from rank 0: not a valid DecodeWhole or .*`type`"),
        (DECODE, {"type": "decoded", "session_id": "s", "chunk_index": 0, "ms": 1.0}, "not a valid .*: a Decoded"),
        (DECODE, {"type": "decode_whole", "session_id": "s"}, r"missing required field `chunk_index`"),
        (DECODE, {"type": "decode_fronts", "rows": [], "split": 2, "part": 0}, "names no rows"),
        (CANCEL, {"type": "decode_cancel", "session_id": "s", "why": 1}, r"a decode cancel .*unknown field `why`"),
    ],
)
def test_a_decode_frame_whose_header_is_not_its_type_names_the_ranks_and_what_is_wrong(pair, kind, header, named):
    """The decode stage's frames are typed (``rtvideo.engine.messages.DecodeRequest``,
    ``DecodeCancel``, ``Decoded``): an untyped or malformed header is a
    ``BadMessage`` naming the frame, the ranks and what is wrong; a frame is
    read whole, so the connection goes on."""
    zero, one = pair
    zero._post(1, kind, 0, msgspec.msgpack.encode(header), [])
    with pytest.raises(BadMessage, match=f"rank 1: {named}" if named.startswith("a ") else named):
        one.take(0, (DECODE, CANCEL), None, 5.0, "decode request")
    zero.post(1, CANCEL, 0, Message(DecodeCancel(session_id="after"), []))
    assert one.take(0, (DECODE, CANCEL), None, 5.0, "decode request")[1].header.session_id == "after"
