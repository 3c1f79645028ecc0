"""The socket ``rtvideo serve`` binds before the model loads serves connections
as asyncio's own would: with TCP_NODELAY, so small frames (an interaction, a
chunk's metadata) are never held back for an ACK (Nagle)."""

from __future__ import annotations

import asyncio
import socket

from rtvideo.cli.main import listen


async def test_connections_on_the_early_socket_get_tcp_nodelay():
    sock = listen("127.0.0.1", 0)
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_connect(reader, writer):
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
