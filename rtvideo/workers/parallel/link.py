"""Point-to-point messages between pipeline ranks: a header and its tensors.

Worker processes. A ``Message`` is a header (``rtvideo.engine.messages.RingHeader``:
which passes and rows it carries, which sessions failed, the ranks' figures,
what the tensors are; encoded by ``rtvideo.engine.transport.encode_rank``) and a list
of tensors. ``RingLink.send`` posts it with non-blocking operations
(``batch_isend_irecv``) in a buffer of fixed size (``MESSAGE_BYTES``): the
header, then, when they fit, the tensors' bytes after it (small activations:
one transfer per message); tensors that do not fit follow as transfers of
their own. The sender goes on computing while it travels, and the sends are
waited for only before the link sends again. ``RingLink.recv`` takes the
fixed-size buffer first (so it can be posted before anything is known), then
the tensors the header says did not fit: shapes and row identities travel
with the data, so rows that change in number or size, sessions that join or
leave, and rows cancelled on the way never make two ranks disagree about
what is on the wire. Messages are matched by (peer, tag); the tag is the
micro-step number the receiver runs them in. (Measured on 2 CPU cores over
gloo: a round trip of two small messages took 4-7 ms in one transfer each,
11-13 ms as a header then its tensor.)

Every wait has a timeout (``timeout_s``): a peer that stops answering raises
``LinkTimeout`` instead of hanging, whichever backend noticed (``timed_out``);
a peer that dies makes gloo raise at once. Tensors travel from the link's
device (``rtvideo.workers.parallel.placement.link_device``): GPU tensors sent over
gloo are copied to host memory first.
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass, field
from types import UnionType
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rtvideo.engine.messages import DecodeFrame, RingHeader, RingItem, TensorSpec
from rtvideo.engine.transport import decode_rank, encode_rank

MESSAGE_BYTES = 128 * 1024  # the header (a few hundred bytes per row), and the tensors when they fit
ALIGN = 16  # tensors inside the buffer start at multiples of this (any dtype may view them)
_TAG_MASK = (1 << 30) - 1
DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)}


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class LinkTimeout(RuntimeError):
    """A peer did not send or receive within the link's timeout."""


class BadMessage(RuntimeError):
    """A message from another rank that breaks the protocol: its header does not
    decode as the type its frame must carry (a ``RingHeader``, a decode stage's
    frame: ``rtvideo.engine.messages``), a tensor is of a type the link does not know,
    or its items take more tensors than came with it."""


@dataclass
class Message:
    """What one rank hands another: a ring message for one micro-step (its header
    a ``RingHeader``), or a decode stage's frame (``rtvideo.workers.parallel.rank_decode``:
    its header an ``rtvideo.engine.messages.DecodeFrame``, which the ranks' sockets carry
    on a connection of its own)."""

    header: RingHeader | DecodeFrame
    tensors: list[torch.Tensor] = field(default_factory=list)


def tensor_specs(parts: list[torch.Tensor]) -> tuple[TensorSpec, ...]:
    """What a header says of the tensors after it; ``ValueError`` naming a dtype
    the link cannot carry."""
    for t in parts:
        if str(t.dtype) not in DTYPES:
            raise ValueError(f"a ring message cannot carry a tensor of {t.dtype} (only {', '.join(DTYPES)})")
    return tuple(TensorSpec(shape=tuple(t.shape), dtype=str(t.dtype)) for t in parts)


def tensor_dtype(spec: TensorSpec) -> torch.dtype:
    kind = DTYPES.get(spec.dtype)
    if kind is None:
        raise BadMessage(f"a ring message's tensor is of {spec.dtype!r}, not one of {', '.join(DTYPES)}")
    return kind


def ring_header(data: bytes, rank: int, peer: int) -> RingHeader:
    """The ``RingHeader`` in ``data``, from ``peer``; ``BadMessage`` saying what is wrong with it."""
    return frame_header(data, RingHeader, rank, peer, "a ring message")


def frame_header(data: bytes, kind: type | UnionType, rank: int, peer: int, what: str) -> Any:
    """The header in ``data`` of a frame ``peer`` sent ``rank``, which must be a
    ``kind`` (``rtvideo.engine.transport.decode_rank``); ``BadMessage`` naming the
    frame (``what``), the ranks, and what is wrong with it."""
    try:
        return decode_rank(data, kind)
    except msgspec.DecodeError as error:
        raise BadMessage(f"rank {rank}: {what} from rank {peer}: {error}") from None


def items_and_tensors(message: Message) -> list[tuple[RingItem, list[torch.Tensor]]]:
    """Each item of a ring message with its own tensors (the next ``count``);
    ``BadMessage`` when the items take more tensors than came."""
    wanted = sum(item.count for item in message.header.items)
    if wanted > len(message.tensors):
        raise BadMessage(f"a ring message's items take {wanted} tensors, and {len(message.tensors)} came with it")
    out, offset = [], 0
    for item in message.header.items:
        out.append((item, message.tensors[offset : offset + item.count]))
        offset += item.count
    return out


class RingLink:
    def __init__(self, rank: int, world: int, timeout_s: float, device: torch.device) -> None:
        self.rank = rank
        self.world = world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []  # sends in flight, with their buffers
        self.bytes_sent = 0
        self.transfers = 0  # point-to-point sends posted (one per message when its tensors fit its buffer)

    def send(self, peer: int, tag: int, message: Message) -> None:
        """Post ``message`` to ``peer``; returns at once. The previous sends are
        waited for first (their buffers may then be reused)."""
        self.wait_sent()
        if not isinstance(message.header, RingHeader):
            raise TypeError(f"a ring message's header is a RingHeader, not {type(message.header).__name__}")
        parts = [t.contiguous().to(self.device) for t in message.tensors]  # GPU tensors over gloo: via host memory
        specs = tensor_specs(parts)
        header = encode_rank(msgspec.structs.replace(message.header, tensors=specs, inline=True))
        start = aligned(4 + len(header))
        inline = start + sum(aligned(t.numel() * t.element_size()) for t in parts) <= MESSAGE_BYTES
        if not inline:
            header = encode_rank(msgspec.structs.replace(message.header, tensors=specs, inline=False))
        if len(header) + 4 > MESSAGE_BYTES:
            raise ValueError(f"a micro-step header of {len(header)} bytes is over {MESSAGE_BYTES}")
        buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        prefix = len(header).to_bytes(4, "little") + header
        buffer[: len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8).to(self.device)
        tensors = [buffer]
        if inline:
            offset = start
            for t in parts:
                size = t.numel() * t.element_size()
                buffer[offset : offset + size] = t.reshape(-1).view(torch.uint8)
                offset += aligned(size)
        else:
            tensors += parts
        ops = [dist.P2POp(dist.isend, t, peer, tag=tag & _TAG_MASK) for t in tensors]
        self._pending.append((dist.batch_isend_irecv(ops), tensors))
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        self.transfers += len(tensors)

    def recv(self, peer: int, tag: int) -> Message:
        """The message ``peer`` sent with ``tag``; ``LinkTimeout`` past the timeout."""
        buffer = torch.empty(MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        self._wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, peer, tag=tag & _TAG_MASK)]), "header", peer)
        size = int.from_bytes(bytes(buffer[:4].tolist()), "little")
        if size + 4 > MESSAGE_BYTES:
            raise BadMessage(f"rank {self.rank}: a ring message from rank {peer} says its header is {size} bytes")
        header = ring_header(buffer[4 : 4 + size].cpu().numpy().tobytes(), self.rank, peer)
        if header.inline:
            tensors, offset = [], aligned(4 + size)
            for spec in header.tensors:
                kind = tensor_dtype(spec)
                count = math.prod(spec.shape) * kind.itemsize
                if offset + count > MESSAGE_BYTES:
                    raise BadMessage(f"rank {self.rank}: a ring message from rank {peer} overruns its buffer")
                tensors.append(buffer[offset : offset + count].view(kind).reshape(spec.shape))
                offset += aligned(count)
            return Message(header, tensors)
        tensors = [torch.empty(spec.shape, dtype=tensor_dtype(spec), device=self.device) for spec in header.tensors]
        if tensors:
            ops = [dist.P2POp(dist.irecv, t, peer, tag=tag & _TAG_MASK) for t in tensors]
            self._wait(dist.batch_isend_irecv(ops), "tensors", peer)
        return Message(header, tensors)

    def wait_sent(self) -> None:
        """Wait until every posted send has left."""
        pending, self._pending = self._pending, []
        for works, _ in pending:
            self._wait(works, "send", None)

    def _wait(self, works: list, what: str, peer: int | None) -> None:
        """Wait for ``works``; ``LinkTimeout`` when one is not done within the
        timeout, however the backend says so (``timed_out``)."""
        for work in works:
            try:
                done = work.wait(self.timeout)
            except RuntimeError as error:  # torch.distributed.DistBackendError is one
                if not timed_out(error):
                    raise
                raise self._timeout(what, peer) from error
            if done is False:  # a backend that answers a timeout instead of raising
                raise self._timeout(what, peer)

    def _timeout(self, what: str, peer: int | None) -> LinkTimeout:
        who = "a peer" if peer is None else f"rank {peer}"
        return LinkTimeout(f"rank {self.rank}: {what} from {who} not done within {self.timeout.total_seconds():g} s")


_TIMED_OUT = re.compile(r"timed out|timing out|timeout", re.IGNORECASE)


def timed_out(error: BaseException) -> bool:
    """Whether a backend's error says a wait ran out of time: gloo says "Timed
    out waiting ... for recv operation", NCCL "... ran for N milliseconds before
    timing out" (or names its watchdog's timeout)."""
    return bool(_TIMED_OUT.search(str(error)))
