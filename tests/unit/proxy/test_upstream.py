"""The proxy's upstream client against raw loopback servers: error kinds, cut streams."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from vllm_pd_ext.proxy.upstream import _DONE, Timeouts, Upstream, UpstreamError, _Conn
from vllm_pd_ext.util.vllm_process import free_port

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve(reply: bytes | None, then_close: bool = True):
    """A server that reads one request, writes ``reply`` in one go (None: never answers)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if reply is None:
            await asyncio.Event().wait()  # never answers
            return
        writer.write(reply)
        await writer.drain()
        if then_close:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _url(server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _until(condition, timeout: float = 5.0) -> None:
    """Poll ``condition`` on the running loop until it holds (fail after ``timeout``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _sink_into(taken: list[bytes], refuse: bytes | None):
    """A sink that takes every piece into ``taken`` but ``refuse`` (left to ``chunks``)."""

    def sink(piece: bytes) -> bool:
        if piece == refuse:
            return False
        taken.append(piece)
        return True

    return sink


def test_events_before_a_broken_stream_are_delivered_then_the_error():
    async def go():
        body = _chunk(b"data: a\n\n") + _chunk(b"data: b\n\n")  # no final 0-chunk: cut short
        server = await _serve(HEAD + body)
        up = Upstream(_url(server), max_connections=4)
        got = b""
        try:
            resp = await up.send("GET", "/", Timeouts(total=10).client())
            # a lagging reader: the break arrives before it reads
            await _until(lambda: resp._conn.closed)
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


async def _serve_many(replies: list[bytes], close_after_first: bool = False):
    """A keep-alive server answering successive requests on one connection with ``replies``;
    ``close_after_first``: it closes the connection after the first answer. Counts
    connections in ``server.accepted``."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        for reply in replies:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            writer.write(reply)
            await writer.drain()
            if close_after_first:
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    server.accepted = accepted  # type: ignore[attr-defined]
    return server


def test_connection_is_reused_and_bodies_are_framed():
    """Content-Length, chunked (split anywhere, with extensions and trailers) and an empty
    body, three exchanges on one pooled connection."""
    chunked = HEAD + b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
        chunked,
        b"HTTP/1.1 204 No Content\r\n\r\n",
    ]

    async def go():
        server = await _serve_many(replies)
        up = Upstream(_url(server), max_connections=4)
        try:
            first = await up.fetch("GET", "/a", Timeouts(total=5).client())
            resp = await up.send("POST", "/b", Timeouts(total=5).client(), {"x": 1})
            parts = [c async for c in resp.chunks()]
            resp.close()
            third = await up.fetch("GET", "/c", Timeouts(total=5).client())
        finally:
            await up.close()
            server.close()
        return first, b"".join(parts), third, len(server.accepted)

    first, second, third, connections = asyncio.run(go())
    assert first == (200, b"abc")
    assert second == b"hello world"
    assert third == (204, b"")
    assert connections == 1


def test_pooled_connection_closed_by_the_engine_is_retried_on_a_fresh_one():
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def go():
        server = await _serve_many([reply, reply], close_after_first=True)
        up = Upstream(_url(server), max_connections=4)
        try:
            first = await up.fetch("GET", "/", Timeouts(total=5).client())
            await _until(lambda: up._idle[0].closed)  # the engine closed the pooled connection
            second = await up.fetch("GET", "/", Timeouts(total=5).client())
        finally:
            await up.close()
            server.close()
        return first, second, len(server.accepted)

    first, second, connections = asyncio.run(go())
    assert first == second == (200, b"ok")
    assert connections == 2


def test_an_answer_that_is_not_http_is_disconnected():
    async def go():
        server = await _serve(b"SSH-2.0-OpenSSH\r\n\r\n")
        up = Upstream(_url(server), max_connections=4)
        try:
            with pytest.raises(UpstreamError) as info:
                await up.fetch("GET", "/", Timeouts(total=5).client())
        finally:
            await up.close()
            server.close()
        return info.value

    error = asyncio.run(go())
    assert error.kind == "disconnected" and error.down


def test_total_timeout_bounds_a_trickling_body():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD)
        for _ in range(50):
            writer.write(_chunk(b"data: x\n\n"))
            await asyncio.sleep(0.05)
        writer.close()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        up = Upstream(_url(server), max_connections=4)
        try:
            with pytest.raises(UpstreamError) as info:
                await up.fetch("GET", "/", Timeouts(total=0.5, read=5).client())
        finally:
            await up.close()
            server.close()
        return info.value

    error = asyncio.run(go())
    assert error.kind == "timeout" and not error.down


def test_a_sink_takes_pieces_in_order_and_what_it_takes_counts_as_read():
    """Pieces the sink takes never reach ``chunks`` and wake nobody, yet keep the read
    timeout from firing while they flow; what it refuses, and what follows until ``chunks``
    yields it, comes through ``chunks``; a silence past the read timeout still ends it."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD)
        for i in range(8):  # 0.8 s of events, each gap well under the 0.6 s read timeout
            writer.write(_chunk(b"data: %d\n\n" % i))
            await asyncio.sleep(0.1)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(2)  # then silence past it
        writer.close()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        up = Upstream(_url(server), max_connections=4)
        taken: list[bytes] = []
        got: list[bytes] = []

        sink = _sink_into(taken, refuse=b"data: 5\n\n")
        try:
            resp = await up.send("GET", "/", Timeouts(read=0.6).client())
            resp.set_sink(sink)
            with pytest.raises(UpstreamError) as info:
                async for chunk in resp.chunks():
                    got.append(chunk)
            resp.close()
        finally:
            await up.close()
            server.close()
        return taken, got, info.value

    taken, got, error = asyncio.run(go())
    # every event once (the first may come with the head, before the sink was set); all
    # eight arrived, over 0.8 s, before the read timeout ended the stream
    events = [e + b"\n\n" for e in b"".join(got).split(b"\n\n")[:-1]]
    assert sorted(taken + events) == [b"data: %d\n\n" % i for i in range(8)]
    assert b"data: 5\n\n" in events and len(taken) >= 5
    assert taken == sorted(taken)
    assert error.kind == "read_timeout"


def test_what_a_sink_takes_never_reads_past_the_exchanges_total_limit():
    """A stream the sink takes whole, with events well inside the read timeout, for longer
    than the exchange's total limit: it ends with the total limit (``timeout``), before the
    engine stops sending."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD)
        with contextlib.suppress(ConnectionError):
            for i in range(60):  # 3 s of events, each gap well under the 0.3 s read timeout
                writer.write(_chunk(b"data: %d\n\n" % i))
                await writer.drain()
                await asyncio.sleep(0.05)
        writer.close()  # cut, without the body's end: a disconnect, unless it ended before

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        up = Upstream(_url(server), max_connections=4)
        taken: list[bytes] = []
        try:
            resp = await up.send("GET", "/", Timeouts(total=0.6, read=0.3).client())
            resp.set_sink(_sink_into(taken, refuse=None))
            with pytest.raises(UpstreamError) as info:
                async for _ in resp.chunks():
                    pass
            resp.close()
        finally:
            await up.close()
            server.close()
        return info.value, taken

    error, taken = asyncio.run(go())
    assert error.kind == "timeout" and not error.down
    assert len(taken) < 60  # ended before the stream did


def test_a_chunked_body_cut_anywhere_between_two_reads_parses_to_the_same_payload():
    """Whole chunks in one read are taken at once, cut ones piece by piece: the payload is
    the same wherever the cut falls, and a chunk not followed by CRLF is an error both
    ways."""
    body = _chunk(b"data: a\n\n") + _chunk(b"data: bb\n\n") + b"0\r\n\r\n"
    bad = _chunk(b"data: a\n\n")[:-2] + b"XX" + b"0\r\n\r\n"

    async def go(reply: bytes, cut: int) -> _Conn:
        conn = _Conn(asyncio.get_running_loop())
        conn.data_received(HEAD + reply[:cut])
        conn.data_received(reply[cut:])
        return conn

    for cut in range(len(body) + 1):
        conn = asyncio.run(go(body, cut))
        assert (conn.take(), conn.state, conn.error) == (b"data: a\n\ndata: bb\n\n", _DONE, None)
    for cut in range(len(bad) + 1):
        conn = asyncio.run(go(bad, cut))
        assert "chunk not followed by CRLF" in str(conn.error), cut


def test_a_sink_gets_one_piece_per_read_and_once_it_refuses_one_later_reads_stay_in_order():
    """The chunks one read completes reach the sink together, as one piece (one write to
    the client); a piece it refuses stays in ``chunks``, and so does every later read until
    the reader has taken them. Fed to the connection's ``data_received`` directly, so what
    one read holds is fixed."""

    async def go():
        conn = _Conn(asyncio.get_running_loop())
        taken: list[bytes] = []
        conn.sink_on_ok = _sink_into(taken, refuse=b"data: c\n\n")
        conn.data_received(HEAD + _chunk(b"data: a\n\n") + _chunk(b"data: b\n\n"))
        conn.data_received(_chunk(b"data: c\n\n"))
        conn.data_received(_chunk(b"data: d\n\n") + b"0\r\n\r\n")
        left = conn.take()
        return taken, left, conn.chunks

    taken, left, chunks = asyncio.run(go())
    assert taken == [b"data: a\n\ndata: b\n\n"]
    assert left == b"data: c\n\ndata: d\n\n" and not chunks


def test_a_read_of_one_whole_chunk_reaches_the_sink_as_its_payload_whatever_its_size_line():
    """One read, one whole chunk (a streamed event as a rule) goes to the sink at once; a
    size line with an extension, or a read that is not exactly one chunk, takes the general
    parse and gives the sink the same payload."""

    async def go():
        conn = _Conn(asyncio.get_running_loop())
        taken: list[bytes] = []
        conn.sink_on_ok = _sink_into(taken, refuse=None)
        conn.data_received(HEAD)
        conn.data_received(_chunk(b"data: a\n\n"))
        conn.data_received(b"9;ext=1\r\ndata: b\n\n\r\n")
        conn.data_received(_chunk(b"data: c\n\n")[:5])
        conn.data_received(_chunk(b"data: c\n\n")[5:] + _chunk(b"data: d\n\n"))
        conn.data_received(b"0\r\n\r\n")
        return taken, conn.chunks, conn.state

    taken, chunks, state = asyncio.run(go())
    assert b"".join(taken) == b"data: a\n\ndata: b\n\ndata: c\n\ndata: d\n\n"
    assert taken[:2] == [b"data: a\n\n", b"data: b\n\n"] and not chunks and state == _DONE


def test_a_read_of_whole_chunks_with_the_body_end_reaches_the_sink_at_once_and_ends_it():
    """Several whole chunks in one read, the last chunk among them, go to the sink as one
    piece; the body is complete and whoever waits on the response is woken for its end.
    A piece the sink refuses from such a read stays for the reader, once."""

    async def go(refuse: bytes | None):
        loop = asyncio.get_running_loop()
        conn = _Conn(loop)
        taken: list[bytes] = []
        conn.sink_on_ok = _sink_into(taken, refuse=refuse)
        conn.data_received(HEAD + _chunk(b"data: a\n\n"))
        waiting = asyncio.ensure_future(conn.wait(5.0, None))
        await _until(lambda: conn.waiter is not None)
        conn.data_received(_chunk(b"data: b\n\n") + _chunk(b"data: c\n\n") + b"0\r\n\r\n")
        await asyncio.wait_for(waiting, 5.0)
        return taken, conn.take(), conn.state

    end = b"data: b\n\ndata: c\n\n"
    assert asyncio.run(go(None)) == ([b"data: a\n\n", end], b"", _DONE)
    assert asyncio.run(go(end)) == ([b"data: a\n\n"], end, _DONE)


def test_a_wait_keeps_its_own_read_limit_whatever_timer_an_earlier_wait_left():
    """The read timer outlives a wait: one left by a shorter, earlier wait does not cut a
    later, longer one short, and one left by a longer wait does not stretch a shorter one."""

    async def go():
        loop = asyncio.get_running_loop()
        conn = _Conn(loop)
        first = asyncio.ensure_future(conn.wait(0.05, None))
        await _until(lambda: conn.waiter is not None)
        conn._wake()
        await first  # bytes came: no timeout; its timer is still armed
        stale = conn.timer
        assert stale is not None
        second = asyncio.ensure_future(conn.wait(30.0, None))
        # the earlier wait's timer fires, finds the later limit and re-arms for it
        await _until(lambda: conn.timer is not stale and conn.timer is not None)
        assert not second.done()
        conn._wake()
        await second
        with pytest.raises(UpstreamError) as info:  # a timer due in 30 s, a limit of 0.05 s
            await asyncio.wait_for(conn.wait(0.05, None), 10.0)
        return info.value

    assert asyncio.run(go()).kind == "read_timeout"


def test_sink_on_ok_takes_the_body_that_comes_with_a_200_head_and_not_an_error_body():
    async def go():
        taken: dict[int, list[bytes]] = {200: [], 503: []}
        results: dict[int, tuple] = {}

        def into(pieces: list[bytes]):
            def sink(piece: bytes) -> bool:
                pieces.append(piece)
                return True

            return sink

        for status in (200, 503):
            head = HEAD if status == 200 else HEAD.replace(b"200 OK", b"503 Unavailable")
            server = await _serve(head + _chunk(b"data: a\n\n") + b"0\r\n\r\n", False)
            up = Upstream(_url(server), max_connections=4)
            try:
                resp = await up.send(
                    "POST",
                    "/",
                    Timeouts(total=10).client(),
                    b"{}",
                    sink_on_ok=into(taken[status]),
                )
                # Taken as the head was parsed, before send() returned to this task.
                results[status] = (resp.status, list(taken[status]))
                rest = b"" if status == 200 else await asyncio.wait_for(resp.read(), 5)
                results[status] += (rest,)
                resp.close()
            finally:
                await up.close()
                server.close()
        return results

    results = asyncio.run(go())
    assert results[200][:2] == (200, [b"data: a\n\n"])
    assert results[503] == (503, [], b"data: a\n\n")  # an error body stays for read()


def test_send_with_sink_on_ok_returns_once_the_sink_leaves_bytes_or_the_body_ends():
    """A stream the sink takes whole needs no task woken: ``send`` returns at the body's end
    (or at the first piece the sink refuses), not at the head."""

    async def go(refuse: bytes | None):
        a_taken, finish = asyncio.Event(), asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD + _chunk(b"data: a\n\n"))
            await writer.drain()
            await a_taken.wait()  # the second event arrives on its own
            writer.write(_chunk(b"data: b\n\n"))
            await writer.drain()
            await finish.wait()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        up = Upstream(_url(server), max_connections=4)
        taken: list[bytes] = []
        left: list[bytes] = []

        sink = _sink_into(taken, refuse)
        try:
            sending = asyncio.ensure_future(
                up.send("POST", "/", Timeouts(read=10).client(), b"{}", sink_on_ok=sink)
            )
            await _until(lambda: taken == [b"data: a\n\n"])
            a_taken.set()
            if refuse is None:
                await _until(lambda: len(taken) == 2)
                for _ in range(20):  # what the sink took wakes nobody: send has not returned
                    await asyncio.sleep(0)
            else:
                await _until(sending.done)  # the refused piece wakes send, before the end
            returned_before_end = sending.done()
            finish.set()
            resp = await asyncio.wait_for(sending, 5)
            async for chunk in resp.chunks():
                left.append(chunk)
            resp.close()
        finally:
            await up.close()
            server.close()
        return returned_before_end, resp.status, taken, b"".join(left)

    assert asyncio.run(go(None)) == (False, 200, [b"data: a\n\n", b"data: b\n\n"], b"")
    assert asyncio.run(go(b"data: b\n\n")) == (True, 200, [b"data: a\n\n"], b"data: b\n\n")
