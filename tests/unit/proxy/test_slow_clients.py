"""Clients that trickle, stall or send too much, against the real proxy on loopback, on both
server paths: the fast path (``front_protocol``) and the plain one (``fast_path: false``:
uvicorn's own protocol within ``client_limits``' read deadlines, the body read through ASGI).
Each attack is a raw socket; the proxy must close it, answer it, or refuse it within its
limits, and keep serving everyone else."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.unit.proxy.helpers import fleet, metric, wait_until
from tests.unit.proxy.test_front_protocol import Conn
from vllm_pd_ext.proxy.app import FrontDoor, create_app
from vllm_pd_ext.proxy.client_limits import MAX_HEAD_BYTES, ReadDeadlines, _Framing, read_deadlines
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.testing.fake_engine import ServerThread

HEAD_S = 0.3
BODY_S = 0.3
LIMIT = 2048  # max_body_bytes
BUDGET = 1024  # max_buffered_body_bytes

PATHS = pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "plain"])


@contextmanager
def proxy(fast_path: bool, instances: list[dict], **overrides) -> Iterator[tuple[FrontDoor, int]]:
    """The real proxy app, served as ``vllm-pd proxy`` serves it, with small limits."""
    config = ProxyConfig.model_validate(
        {
            "instances": instances,
            "health_interval_s": 0.2,
            "fast_path": fast_path,
            "client_header_timeout_s": HEAD_S,
            "client_body_timeout_s": BODY_S,
            "max_body_bytes": LIMIT,
            "max_buffered_body_bytes": BUDGET,
            **overrides,
        }
    )
    app = create_app(config)
    assert app.fast_path is fast_path
    # idle keep-alive connections outlive every bound below: what closes one is ours
    with ServerThread(app, timeout_keep_alive=60, **app.server_settings()) as server:
        yield app, server.port


#: No engine behind it: for attacks that never reach one.
NOWHERE = [{"url": "http://127.0.0.1:9"}]


def closed_unanswered(conn: Conn) -> bool:
    """Waits (at most 10 s, the test's own bound: a TimeoutError past it) for the server to
    close the connection; True when it closed it without sending anything (more)."""
    conn.sock.settimeout(10)
    try:
        return conn.buf == b"" and conn.sock.recv(1) == b""
    except ConnectionResetError:
        return True


def completion(size: int) -> bytes:
    """A completion request body of exactly ``size`` bytes."""
    body = json.dumps({"model": "m", "prompt": "", "max_tokens": 2}).encode()
    return body.replace(b'"prompt": ""', b'"prompt": "%b"' % (b"x" * (size - len(body))))


def post(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%b\r\n%b" % (len(body), extra, body)
    )


@PATHS
@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects and says nothing
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # half a head, then nothing
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ",  # another route
    ],
    ids=["silent", "half-head", "other-route"],
)
def test_a_client_whose_head_stalls_is_closed(fast_path, sent):
    with proxy(fast_path, NOWHERE) as (_, port):
        conn = Conn(port)
        conn.send(sent)
        assert closed_unanswered(conn)


@PATHS
def test_a_kept_alive_connection_whose_next_head_stalls_is_closed(fast_path):
    """The head deadline runs again from the first byte of each request: after a complete
    request on the connection, and behind a pipelined one."""
    with proxy(fast_path, NOWHERE) as (_, port):
        conn = Conn(port)
        conn.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.response()[0] == 503  # no healthy decode instance: answered
        conn.send(b"GET /health HTTP/1.1\r\nHo")
        assert closed_unanswered(conn)

        conn = Conn(port)
        conn.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHo")
        assert conn.response()[0] == 503
        assert closed_unanswered(conn)


@PATHS
def test_a_completion_whose_body_stalls_gets_408_and_is_closed(fast_path):
    with proxy(fast_path, NOWHERE) as (_, port):
        conn = Conn(port)
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        conn.sock.settimeout(10)
        status, headers, body = conn.response()
        assert status == 408
        assert json.loads(body)["error"]["code"] == "body_timeout"
        assert headers[b"connection"] == b"close"
        assert closed_unanswered(conn)


@PATHS
def test_another_route_whose_body_stalls_is_closed(fast_path):
    """Routes that never read the body: the connection's own deadline closes it."""
    with proxy(fast_path, NOWHERE) as (_, port):
        conn = Conn(port)
        conn.send(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        conn.sock.settimeout(10)
        assert conn.response()[0] == 405  # answered without reading the body
        assert closed_unanswered(conn)  # then closed: the rest never came


@PATHS
def test_a_body_trickled_chunk_by_chunk_does_not_hold_the_connection(fast_path):
    """A chunked body on a route that never reads it, half a chunk every half body timeout
    and never its end: the deadline counts from the head, not from each piece of framing, so
    the connection is closed (within the body timeout and its grace), not held for as long as
    pieces come."""
    with proxy(fast_path, NOWHERE) as (_, port):
        conn = Conn(port)
        conn.send(b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.sock.settimeout(10)
        assert conn.response()[0] == 405  # answered without reading the body
        deadline = time.monotonic() + 10  # far past BODY_S and its grace
        closed = False
        conn.sock.settimeout(BODY_S / 2)  # the trickle's pace: one chunk per wait below
        pieces = itertools.cycle([b"1\r\n", b"a\r\n"])  # each ends in another framing phase
        while not closed and time.monotonic() < deadline:
            try:
                conn.send(next(pieces))
                closed = conn.sock.recv(1) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed


@PATHS
def test_a_declared_body_over_max_body_bytes_gets_413_unread_and_the_connection_closed(fast_path):
    with proxy(fast_path, NOWHERE) as (_, port):
        conn = Conn(port)
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        conn.sock.settimeout(10)
        status, headers, body = conn.response()
        assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
        assert headers[b"connection"] == b"close"
        assert closed_unanswered(conn)


@PATHS
def test_a_chunked_body_over_max_body_bytes_gets_413(fast_path):
    with proxy(fast_path, NOWHERE, max_buffered_body_bytes=1 << 20) as (_, port):
        conn = Conn(port)
        big = b"x" * (LIMIT + 10)
        conn.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(big), big)
        )
        conn.sock.settimeout(10)
        status, _, body = conn.response()
        assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"


@PATHS
def test_a_body_that_would_pass_the_budget_gets_503_and_the_budget_is_whole_again(
    fast_path, engines
):
    """The first client holds 700 of its 900 bytes; the second's 900 would pass the
    1024-byte budget: 503, connection closed, nothing kept. The first is then served, and
    the budget is whole again for a third."""
    with proxy(fast_path, fleet(engines), client_body_timeout_s=30) as (app, port):
        budget = app.body_budget
        wait_until(lambda: app.service.fleet.healthy("decode"))
        body = completion(900)
        first, second = Conn(port), Conn(port)
        first.send(post(body)[:-200])
        wait_until(lambda: budget.used == 700, timeout=10)
        second.send(post(completion(900)))
        second.sock.settimeout(10)
        status, headers, answer = second.response()
        assert status == 503, answer
        assert json.loads(answer)["error"]["code"] == "body_budget"
        assert headers[b"connection"] == b"close"
        assert closed_unanswered(second)
        first.send(body[-200:])
        first.sock.settimeout(30)
        status, _, answer = first.response()
        assert status == 200, answer
        wait_until(lambda: budget.used == 0, timeout=10)
        third = Conn(port)
        third.send(post(completion(900)))
        third.sock.settimeout(30)
        assert third.response()[0] == 200
        wait_until(lambda: budget.used == 0, timeout=10)


@PATHS
def test_a_client_that_leaves_mid_body_gives_its_bytes_back(fast_path):
    with proxy(fast_path, NOWHERE, client_body_timeout_s=30) as (app, port):
        conn = Conn(port)
        conn.send(post(completion(900))[:-200])
        wait_until(lambda: app.body_budget.used == 700, timeout=10)
        conn.sock.close()
        wait_until(lambda: app.body_budget.used == 0, timeout=10)


@PATHS
def test_requests_on_a_kept_alive_connection_are_served(fast_path, engines):
    """Prompt clients are unaffected: requests on one connection, with an idle gap longer
    than the head timeout between them (the keep-alive timeout governs idle connections),
    and pipelined ones."""
    with proxy(fast_path, fleet(engines)) as (app, port):
        wait_until(lambda: app.service.fleet.healthy("decode"))
        conn = Conn(port)
        conn.sock.settimeout(30)
        conn.send(post(completion(200)))
        status, _, answer = conn.response()
        assert status == 200 and json.loads(answer)["choices"]
        deadline = time.monotonic() + 3 * HEAD_S
        while time.monotonic() < deadline:  # idle, as the scenario says (not a wait for sync)
            time.sleep(0.05)
        conn.send(post(completion(300)) + post(completion(400)))
        assert [conn.response()[0] for _ in range(2)] == [200, 200]
        wait_until(lambda: app.body_budget.used == 0, timeout=10)


def _hold_the_only_slot(app: FrontDoor, port: int) -> Conn:
    """A client whose request holds the proxy's only admission slot (the engines answer
    after a second); the caller reads its answer."""
    wait_until(lambda: app.service.fleet.healthy("decode"))
    holder = Conn(port)
    holder.send(post(completion(200)))
    wait_until(lambda: app.service.admission.in_flight == 1, timeout=10)
    return holder


@PATHS
def test_a_full_proxy_answers_429_from_the_head_without_reading_the_body(fast_path, engines):
    """All slots taken and no queue: a request is answered 429 as soon as its head is in,
    while its body has not even been sent, and nothing of it is held."""
    for d in ("d1", "d2"):
        engines[d].behavior.delay_s = 1.0
    with proxy(
        fast_path, fleet(engines), max_in_flight=1, max_queued=0, client_body_timeout_s=30
    ) as (app, port):
        holder = _hold_the_only_slot(app, port)
        late = Conn(port)
        late.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n")
        late.sock.settimeout(10)  # far below the body timeout: only a head-time answer fits
        status, headers, answer = late.response()
        assert status == 429 and json.loads(answer)["error"]["code"] == "queue_full"
        assert headers[b"connection"] == b"close"
        holder.sock.settimeout(30)
        assert holder.response()[0] == 200
        base = f"http://127.0.0.1:{port}"
        assert metric(base, "vllm_pd_rejected_total", reason="queue_full") == 1


@PATHS
def test_a_request_without_the_api_key_is_answered_401_before_its_body(fast_path):
    with proxy(fast_path, NOWHERE, api_key="sekret", client_body_timeout_s=30) as (app, port):
        conn = Conn(port)
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        conn.sock.settimeout(10)
        status, _, answer = conn.response()
        assert status == 401 and json.loads(answer)["error"]["code"] == "invalid_api_key"
        # the body it sends then is dropped, never held; behind it, the next request is
        # answered (the plain path keeps the connection) or the connection ends (the fast one)
        conn.send(b"x" * 1000 + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        if fast_path:  # answered from the head: the connection ends with the body
            with pytest.raises(ConnectionError):
                conn.response()
        else:
            assert conn.response()[0] == 503  # no healthy decode instance
        assert app.body_budget.used == 0


def test_a_connection_refused_from_its_head_is_closed_soon_when_its_body_does_not_come():
    """Fast path: the answer (401) is out at once; a body that then never comes holds the
    connection for REFUSED_BODY_S (2 s), not for the body timeout (30 s here)."""
    with proxy(True, NOWHERE, api_key="sekret", client_body_timeout_s=30) as (_, port):
        conn = Conn(port)
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        conn.sock.settimeout(10)
        assert conn.response()[0] == 401
        assert closed_unanswered(conn)  # its own bound is 10 s: far below the body timeout


@PATHS
def test_a_stalled_head_pipelined_behind_a_served_request_gets_no_408_in_its_place(
    fast_path, engines
):
    """A complete request is being served when the next request's head, pipelined behind
    it, stalls: the connection is closed, and no 408 is written as the first request's
    answer (its body had arrived in full)."""
    for d in ("d1", "d2"):
        engines[d].behavior.delay_s = 1.0
    with proxy(fast_path, fleet(engines)) as (app, port):
        wait_until(lambda: app.service.fleet.healthy("decode"))
        conn = Conn(port)
        conn.send(post(completion(200)) + b"POST /v1/completions HTTP/1.1\r\nHo")
        conn.sock.settimeout(10)
        received = b""
        try:
            while chunk := conn.sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert b" 408 " not in received


# -- ReadDeadlines around each of uvicorn's protocols, on an echo app --------------------------


async def echo(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = json.dumps({"path": scope["path"], "size": size}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _inner(name: str) -> type[asyncio.Protocol]:
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


@pytest.mark.parametrize("inner", ["h11", "httptools"])
def test_read_deadlines_wrap_each_of_uvicorns_protocols(inner):
    protocol = read_deadlines(_inner(inner), HEAD_S, BODY_S)
    assert issubclass(protocol, ReadDeadlines)
    with ServerThread(echo, http=protocol) as server:
        conn = Conn(server.port)
        chunked = (
            b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nx-trailer: 1\r\n\r\n"
        )
        conn.send(post(b"{}") + chunked + b"GET /g HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = [json.loads(conn.response()[2]) for _ in range(3)]
        assert answers == [
            {"path": "/v1/completions", "size": 2},
            {"path": "/c", "size": 5},
            {"path": "/g", "size": 0},
        ]
        conn.send(b"GET /g HTTP/1.1\r\n")  # the next head stalls
        assert closed_unanswered(conn)
        conn = Conn(server.port)
        conn.send(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nabc")  # and a body
        assert closed_unanswered(conn)
        conn = Conn(server.port)
        conn.sock.settimeout(10)
        try:  # h11 refuses it itself (431); either way the connection ends
            conn.send(b"GET /g HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n")
            while conn.sock.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass


# -- the framing the deadlines follow, byte by byte ---------------------------------------------

STREAM = (
    b"\r\nPOST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"4;x=y\r\nwxyz\r\n10\r\n" + b"z" * 16 + b"\r\n0\r\nTrailer: t\r\n\r\n"
    b"GET /c HTTP/1.1\nHost: x\n\n"  # bare LF line ends
    b"POST /d HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
)


@pytest.mark.parametrize("piece", [1, 2, 7, len(STREAM)])
def test_framing_follows_pipelined_requests_in_any_pieces(piece):
    framing = _Framing()
    stages = []
    for i in range(0, len(STREAM), piece):
        assert framing.feed(STREAM[i : i + piece])
        stages.append(framing.stage)
    assert framing.requests == 4 and framing.stage == "idle"
    if piece == 1:
        assert "body" in stages and "head" in stages


@pytest.mark.parametrize(
    "head",
    [
        b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES,
    ],
    ids=["bad-length", "two-lengths", "not-chunked", "bad-chunk-size", "chunk-overrun", "huge"],
)
def test_framing_refuses_what_cannot_be_framed(head):
    assert _Framing().feed(head) is False


PAUSED_HEAD_S = 1.0


async def slow_echo(scope, receive, send) -> None:
    """``echo``, answering ``/slow`` only after a few head timeouts (the scenario's slow
    answer, not a wait for synchronisation)."""
    if scope.get("path") == "/slow":
        await asyncio.sleep(2.5 * PAUSED_HEAD_S)
    await echo(scope, receive, send)


def test_a_deadline_does_not_run_while_the_server_has_paused_reading():
    """h11 stops reading behind a request in progress: the pipelined head's deadline then
    waits (the client cannot be blamed for bytes nobody reads) and runs a whole period once
    the server reads again; the rest of the head, sent then, is served."""
    protocol = read_deadlines(_inner("h11"), PAUSED_HEAD_S, BODY_S)
    with ServerThread(slow_echo, http=protocol) as server:
        conn = Conn(server.port)
        conn.sock.settimeout(10)
        conn.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /g HTTP/1.1\r\n")
        assert json.loads(conn.response()[2])["path"] == "/slow"
        conn.send(b"Host: x\r\n\r\n")
        assert json.loads(conn.response()[2])["path"] == "/g"


def test_without_uvicorns_auto_module_the_plain_path_serves_as_it_is_after_a_warning(
    monkeypatch, caplog
):
    import sys

    from vllm_pd_ext.proxy.client_limits import plain_protocol

    monkeypatch.setitem(sys.modules, "uvicorn.protocols.http.auto", None)  # import fails
    with caplog.at_level("WARNING"):
        assert plain_protocol(HEAD_S, BODY_S) == "auto"
    assert any("no header or body read timeouts" in r.getMessage() for r in caplog.records)


BUSY = b"Service Unavailable"  # uvicorn's answer past limit_concurrency


def answer(port: int, request: bytes) -> tuple[int, bytes]:
    conn = Conn(port)
    try:
        conn.send(request)
        status, _, body = conn.response()
        return status, body
    finally:
        conn.sock.close()


@PATHS
def test_requests_beyond_max_connections_get_503_on_either_path(fast_path):
    """A cap of three, two connections held open: a completion request on a third is
    answered 503 by the server (uvicorn counts the connection asking), never reaching the
    service; once one of the two goes, it is served."""
    with proxy(fast_path, NOWHERE, max_connections=3) as (_, port):
        held = [Conn(port), Conn(port)]
        for conn in held:  # answered: the server counts both
            conn.send(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            conn.response()
        assert answer(port, post(completion(64))) == (503, BUSY)
        held.pop().sock.close()
        wait_until(lambda: answer(port, post(completion(64)))[1] != BUSY, timeout=10)
        held[0].sock.close()
