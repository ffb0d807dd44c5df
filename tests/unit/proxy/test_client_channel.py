"""The client connection's transport wrapper: a response head leaves with the first body
part, in one write; stream parts go straight to the transport only on a chunked response of
the request cycles the fast path knows."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

from vllm_pd_ext.proxy import client_channel, front_protocol
from vllm_pd_ext.proxy.front_protocol import DirectWriter, _HeadWithBody


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def test_head_and_first_body_part_are_one_write_later_parts_are_not_held():
    async def go():
        inner = _Transport()
        t = _HeadWithBody(cast(asyncio.Transport, inner), asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        assert inner.writes == []
        t.write(b"5\r\nhello\r\n")
        t.write(b"0\r\n\r\n")
        await asyncio.sleep(0)
        return inner.writes, t.get_extra_info("peername")

    writes, info = asyncio.run(go())
    assert writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n", b"0\r\n\r\n"]
    assert info == "info:peername"  # everything else is the wrapped transport's


def test_a_head_alone_leaves_at_the_end_of_the_turn_or_on_close():
    async def go():
        inner = _Transport()
        t = _HeadWithBody(cast(asyncio.Transport, inner), asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        await asyncio.sleep(0)
        alone = list(inner.writes)
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        t.close()
        return alone, inner.writes, inner.closed

    alone, writes, closed = asyncio.run(go())
    assert alone == [b"HTTP/1.1 200 OK\r\n\r\n"]
    assert writes == [b"HTTP/1.1 200 OK\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n"]
    assert closed


class _Cycle:
    """Stands in for uvicorn's httptools request cycle (matched by exact type)."""

    chunked_encoding = True
    response_started = True
    disconnected = False
    response_complete = False
    flow = SimpleNamespace(write_paused=False)
    transport = _Transport()

    async def send(self, message) -> None:
        return None


def test_direct_writes_only_on_a_known_request_cycle_with_a_chunked_response(monkeypatch):
    assert DirectWriter.for_send(_Cycle().send) is None  # not uvicorn's cycle: the ASGI path
    monkeypatch.setattr(front_protocol, "_impl", SimpleNamespace(RequestResponseCycle=_Cycle))
    writer = DirectWriter.for_send(_Cycle().send)
    assert writer is not None and writer.ready()
    writer.write(b"data: x\n\n")
    assert _Cycle.transport.writes == [b"9\r\ndata: x\n\n\r\n"]
    _Cycle.flow.write_paused = True  # the client's buffer is full: back to send()
    assert not writer.ready()
    unchunked = _Cycle()
    unchunked.chunked_encoding = False
    assert DirectWriter.for_send(unchunked.send) is None


def _fast_cycle():
    from vllm_pd_ext.proxy.front_protocol import BodyBudget, FastCycle

    protocol = SimpleNamespace(
        server=("127.0.0.1", 1),
        client=("127.0.0.1", 2),
        transport=_Transport(),
        flow=SimpleNamespace(write_paused=False),
        on_response_complete=lambda: None,
        server_state=SimpleNamespace(default_headers=[(b"server", b"t")]),
    )
    cycle = FastCycle(protocol, b"/v1/completions", b"", [], True, BodyBudget(1 << 20))
    return cycle, protocol.transport


HEADERS = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"r1")]


def test_a_writer_before_start_starts_the_response_once_and_the_relay_does_not_again():
    from starlette.requests import Request

    async def go():
        cycle, transport = _fast_cycle()
        await cycle.receive()  # the body, as the app reads it first
        watch = client_channel.DisconnectWatch(Request(cycle.scope, cycle.receive))
        writer = DirectWriter.before_start(watch.cycle, HEADERS)
        assert writer is not None and writer.ready() and not writer.started
        writer.write(b"data: 1\n\n")  # from the engine connection, ahead of the task
        direct = SimpleNamespace(writer=writer)

        async def body():
            yield b"data: 2\n\n"
            yield client_channel.STREAM_END

        response = client_channel.RelayResponse(body(), watch, HEADERS, direct=direct)
        await response(cycle.scope, cycle.receive, cycle.send)
        return transport.writes, cycle.response_complete

    writes, complete = asyncio.run(go())
    data = b"".join(writes)
    assert data.count(b"HTTP/1.1 200") == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"x-request-id: r1\r\n" in writes[0] and b"transfer-encoding: chunked" in writes[0]
    assert data.endswith(
        b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    )
    assert complete


def test_a_writer_before_start_stands_back_once_send_started_the_response():
    from starlette.requests import Request

    async def go():
        cycle, transport = _fast_cycle()
        watch = client_channel.DisconnectWatch(Request(cycle.scope, cycle.receive))
        writer = DirectWriter.before_start(watch.cycle, HEADERS)
        assert writer is not None
        await cycle.send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        ready_after_start = writer.ready()  # the head is held by the cycle, not written yet
        late = DirectWriter.before_start(watch.cycle, HEADERS)
        return ready_after_start, late, transport.writes

    ready_after_start, late, writes = asyncio.run(go())
    assert not ready_after_start and late is None and writes == []
