"""The proxy's upstream client against raw loopback servers: error kinds, cut streams."""

from __future__ import annotations

import asyncio

import pytest

from vllm_pd_ext.proxy.upstream import Timeouts, Upstream, UpstreamError
from vllm_pd_ext.tools.vllm_process import free_port

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve(reply: bytes | None, then_close: bool = True):
    """A server that reads one request, writes ``reply`` in one go (None: never answers)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if reply is None:
            await asyncio.sleep(30)
        writer.write(reply)
        await writer.drain()
        if then_close:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _url(server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_events_before_a_broken_stream_are_delivered_then_the_error():
    async def go():
        body = _chunk(b"data: a\n\n") + _chunk(b"data: b\n\n")  # no final 0-chunk: cut short
        server = await _serve(HEAD + body)
        up = Upstream(_url(server), max_connections=4)
        got = b""
        try:
            resp = await up.send("GET", "/", Timeouts(total=10).client())
            await asyncio.sleep(0.3)  # a lagging reader: the break arrives before it reads
            with pytest.raises(UpstreamError) as info:
                async for chunk in resp.chunks():
                    got += chunk
            resp.close()
        finally:
            await up.close()
            server.close()
        return got, info.value

    got, error = asyncio.run(go())
    assert got == b"data: a\n\ndata: b\n\n"
    assert error.kind == "disconnected" and error.down


def test_refused_connection_is_connect_and_down():
    async def go():
        up = Upstream(f"http://127.0.0.1:{free_port()}", max_connections=4)
        try:
            with pytest.raises(UpstreamError) as info:
                await up.fetch("GET", "/health", Timeouts(total=5, connect=2).client())
        finally:
            await up.close()
        return info.value

    error = asyncio.run(go())
    assert error.kind == "connect" and error.down


def test_silent_engine_is_a_read_timeout_not_down():
    async def go():
        server = await _serve(None)
        up = Upstream(_url(server), max_connections=4)
        try:
            with pytest.raises(UpstreamError) as info:
                await up.send("POST", "/v1/completions", Timeouts(read=0.3).client(), {"a": 1})
        finally:
            await up.close()
            server.close()
        return info.value

    error = asyncio.run(go())
    assert error.kind == "read_timeout" and not error.down
