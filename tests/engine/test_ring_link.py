"""The pipeline ranks' point-to-point messages (``rtvideo.workers.parallel.link``)
between two real processes over gloo: tensors small enough to ride in the
message's buffer and tensors too large for it arrive equal with their
``RingHeader``, in every dtype the ranks send; a header that is not a valid
``RingHeader`` raises ``BadMessage`` naming what is wrong, and a peer that
sends nothing raises ``LinkTimeout``."""

from __future__ import annotations

import multiprocessing
import socket

import torch

SPAWN = multiprocessing.get_context("spawn")


def tensors_for(kind: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    if kind == "small":  # a tiny model's activations: inside the buffer
        return [
            torch.randn(2, 48, 128, generator=generator),
            torch.randn(3, 5, generator=generator).to(torch.bfloat16),
            torch.arange(7, dtype=torch.int64),
            torch.tensor([1, 2, 3], dtype=torch.uint8),
            torch.empty(0, 4),
        ]
    return [torch.randn(1, 512, 256, generator=generator), torch.randn(9, generator=generator)]  # 512 KiB: apart


def peer(rank: int, port: int, results) -> None:
    import msgspec
    import torch.distributed as dist

    from rtvideo.engine.messages import RingHeader, RingItem
    from rtvideo.workers.parallel.link import MESSAGE_BYTES, BadMessage, LinkTimeout, Message, RingLink

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    link = RingLink(rank, 2, timeout_s=1.0, device=torch.device("cpu"))
    try:
        for tag, kind in enumerate(("small", "large", "small")):
            expected = tensors_for(kind)
            items = (RingItem(kind="forward", count=len(expected), meta={"kind": kind, "rows": [["s", tag, 0]]}),)
            if rank == 0:
                before = link.transfers
                link.send(1, tag, Message(RingHeader(items=items, failed={"t": "boom"}), expected))
                results.put((f"{kind} transfers", link.transfers - before))
            else:
                got = link.recv(0, tag)
                same = got.header.items == items and got.header.failed == {"t": "boom"}
                same = same and got.header.inline == (kind == "small") and len(got.tensors) == len(expected)
                same = same and all(
                    a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                    for a, b in zip(got.tensors, expected, strict=True)
                )
                results.put((kind, same))
        if rank == 0:  # a header that is not a RingHeader's, in the link's own framing
            header = msgspec.msgpack.encode({"type": "ring_header", "items": [{"kind": "sideways", "count": 0}]})
            buffer = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
            buffer[: 4 + len(header)] = torch.frombuffer(
                bytearray(len(header).to_bytes(4, "little") + header), dtype=torch.uint8
            )
            dist.batch_isend_irecv([dist.P2POp(dist.isend, buffer, 1, tag=3)])[0].wait()
        else:
            try:
                link.recv(0, 3)
                results.put(("bad header", False))
            except BadMessage as error:
                results.put(
                    ("bad header", "from rank 0" in str(error) and "'sideways' - at `$.items[0].kind`" in str(error))
                )
        link.wait_sent()
        if rank == 1:
            try:
                link.recv(0, 99)  # rank 0 never sends this one
                results.put(("timeout", False))
            except LinkTimeout as error:
                results.put(("timeout", "not done within 1 s" in str(error)))
        # Rank 0 hosts the store, so only it waits: were both to wait, rank 0
        # could see both keys and exit, closing the store before rank 1's
        # own wait was answered.
        if rank == 1:
            store.set("done/1", "1")
        else:
            store.wait(["done/1"])
    finally:
        dist.destroy_process_group()


def test_small_and_large_messages_arrive_equal_and_a_silent_peer_times_out():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = SPAWN.Queue()
    processes = [SPAWN.Process(target=peer, args=(rank, port, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        got = [results.get(timeout=60) for _ in range(8)]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert sorted(got) == sorted(
        [("small", True), ("large", True), ("small", True), ("bad header", True), ("timeout", True)]
        + [("small transfers", 1), ("large transfers", 3), ("small transfers", 1)]  # in the buffer; 2 apart
    )
    assert [process.exitcode for process in processes] == [0, 0]
