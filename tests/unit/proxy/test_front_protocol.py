"""The proxy's server protocol: the lean cycle for the completion routes and uvicorn's path
for everything else, on one keep-alive connection, as a raw HTTP/1.1 client sees them; and
the fence around uvicorn's internals (checked at start-up, the plain path otherwise)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from typing import Any

import pytest
import uvicorn

from vllm_pd_ext.proxy import front_protocol as front_protocol_module
from vllm_pd_ext.proxy.app import create_app
from vllm_pd_ext.proxy.client_limits import ReadDeadlines
from vllm_pd_ext.proxy.config import ProxyConfig
from vllm_pd_ext.proxy.front_protocol import BodyBudget, front_protocol
from vllm_pd_ext.testing.fake_engine import ServerThread

LIMIT = 1000


async def app(scope, receive, send) -> None:
    """Echoes what it got: the cycle type, method, path, query and body size."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["query_string"] == b"boom=1":
        raise RuntimeError("boom")
    cycle = type(getattr(receive, "__self__", None)).__name__
    payload = json.dumps(
        {"cycle": cycle, "method": scope["method"], "path": scope["path"], "size": len(body)}
    ).encode()
    if scope["query_string"] == b"stream=1":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"r1")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


@pytest.fixture(scope="module")
def server():
    with ServerThread(app, http=front_protocol(LIMIT)) as srv:
        yield srv


class Conn:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        self.buf += chunk

    def response(self) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            while len(self.buf) < n:
                self._fill()
            body, self.buf = self.buf[:n], self.buf[n:]
            return status, headers, body
        assert headers.get(b"transfer-encoding") == b"chunked"
        body = b""
        while True:
            while b"\r\n" not in self.buf:
                self._fill()
            size_line, _, rest = self.buf.partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                self._fill()
                size_line, _, rest = self.buf.partition(b"\r\n")
            self.buf = rest[size + 2 :]
            if size == 0:
                return status, headers, body
            body += rest[:size]

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except (ConnectionError, TimeoutError):
            return True


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%b\r\n%b" % (path.encode(), len(body), extra, body)
    )


def test_fast_and_uvicorn_routes_share_one_keep_alive_connection(server):
    c = Conn(server.port)
    seen: list[Any] = []
    for path, method in [
        ("/v1/completions", "POST"),
        ("/v1/models", "GET"),
        ("/v1/chat/completions", "POST"),
        ("/v1/completions?stream=1", "POST"),
        ("/v1/completions", "POST"),
    ]:
        if method == "POST":
            c.send(post(path, b'{"prompt": "hi"}'))
        else:
            c.send(b"GET %b HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode())
        status, headers, body = c.response()
        assert status == 200
        assert b"date" in headers and b"server" in headers  # uvicorn's default headers
        seen.append(body if b"stream" in path.encode() else json.loads(body))
    assert [s["cycle"] for s in seen if isinstance(s, dict)] == [
        "FastCycle",
        "RequestResponseCycle",
        "FastCycle",
        "FastCycle",
    ]
    assert seen[0]["size"] == len(b'{"prompt": "hi"}')
    assert seen[3] == b"data: 1\n\ndata: 2\n\n"


def test_pipelined_requests_are_answered_in_order(server):
    c = Conn(server.port)
    c.send(
        post("/v1/completions", b"{}")
        + post("/v1/chat/completions", b'{"a": 1}')
        + b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    answers = [json.loads(c.response()[2]) for _ in range(3)]
    assert [a["path"] for a in answers] == ["/v1/completions", "/v1/chat/completions", "/v1/models"]
    assert [a["size"] for a in answers] == [2, 8, 0]


def test_chunked_body_arrives_whole_and_an_oversized_one_is_cut_past_the_limit(server):
    c = Conn(server.port)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    c.send(head + b"5\r\nhello\r\n")
    c.send(b"6\r\n world\r\n0\r\n\r\n")
    assert json.loads(c.response()[2])["size"] == 11
    big = b"x" * (LIMIT + 500)
    c.send(head + b"%x\r\n%b\r\n0\r\n\r\n" % (len(big), big))
    answer = json.loads(c.response()[2])
    assert answer["cycle"] == "FastCycle" and answer["size"] == LIMIT + 1  # the app says 413


def test_declared_oversized_body_goes_uvicorns_way(server):
    c = Conn(server.port)
    big = b"x" * (LIMIT + 1)
    c.send(post("/v1/completions", big))
    answer = json.loads(c.response()[2])
    assert answer["cycle"] == "RequestResponseCycle" and answer["size"] == LIMIT + 1


def test_connection_close_and_app_errors(server):
    c = Conn(server.port)
    c.send(post("/v1/completions", b"{}", b"connection: close\r\n"))
    status, headers, _ = c.response()
    assert status == 200 and headers[b"connection"] == b"close"
    assert c.closed()

    c = Conn(server.port)
    c.send(post("/v1/completions?boom=1", b"{}"))
    status, headers, body = c.response()
    assert status == 500 and body == b"Internal Server Error"
    assert c.closed()


def test_the_installed_uvicorn_has_every_internal_the_fast_path_uses():
    assert front_protocol_module.missing_internals() == []


def test_a_uvicorn_lacking_an_internal_serves_the_plain_path_after_one_log_line(
    monkeypatch, caplog
):
    needs = dict(front_protocol_module._NEEDS)
    needs["RequestResponseCycle"] = (*needs["RequestResponseCycle"], "renamed_in_a_release")
    monkeypatch.setattr(front_protocol_module, "_NEEDS", needs)
    monkeypatch.setattr(front_protocol_module, "_CHECKED", [])
    config = ProxyConfig.model_validate({"instances": [{"url": "http://127.0.0.1:9"}]})
    with caplog.at_level("WARNING"):
        assert front_protocol(LIMIT) is None
        app = create_app(config)
        assert front_protocol(LIMIT) is None
    protocol = app.server_protocol()
    assert app.fast_path is False
    assert isinstance(protocol, type) and issubclass(protocol, ReadDeadlines)
    lines = [r for r in caplog.records if "renamed_in_a_release" in r.getMessage()]
    assert len(lines) == 1 and "fast path off" in lines[0].getMessage()


def test_fast_path_false_serves_uvicorns_own_protocol():
    config = ProxyConfig.model_validate(
        {"instances": [{"url": "http://127.0.0.1:9"}], "fast_path": False}
    )
    app = create_app(config)
    assert app.fast_path is False and app.service.fast_path is False
    protocol = app.server_protocol()  # uvicorn's own, within the read deadlines
    assert isinstance(protocol, type) and issubclass(protocol, ReadDeadlines)
    fast = create_app(config.model_copy(update={"fast_path": True})).server_protocol()
    assert isinstance(fast, type) and getattr(fast, "pdx_front", False)


@pytest.mark.parametrize(
    ("sent", "answer"),
    [
        (b"", None),  # connects and says nothing
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", None),  # a head that never ends
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", 408),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", None),  # uvicorn's path too
    ],
    ids=["silent", "head", "body", "other-route"],
)
def test_a_client_that_trickles_its_request_is_closed(sent, answer):
    """A request's head must arrive within the head timeout and its body within the body
    timeout, else the connection is closed (unanswered, or with a 408 for a completion
    request's late body): slow clients hold no connection."""
    with ServerThread(app, http=front_protocol(LIMIT, 0.3, 0.3)) as srv:
        conn = Conn(srv.port)
        conn.send(sent)
        conn.sock.settimeout(10)  # the test's own bound; the server closes at ~0.3 s
        if answer is not None:
            status, headers, body = conn.response()
            assert status == answer and headers[b"connection"] == b"close"
            assert json.loads(body)["error"]["code"] == "body_timeout"
            assert conn.buf == b""
        assert conn.sock.recv(1) == b""
        # a prompt client on the same server is served
        ok = Conn(srv.port)
        ok.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert ok.response()[0] == 200


def test_bodies_held_at_once_stay_within_the_budget():
    """Two clients each start a 600-byte body under an 800-byte budget: the first is held,
    the second (which would pass the budget) is answered 503 with an OpenAI error body once
    its body is in, and keeps nothing; when the first completes it is served, and the budget
    is whole again for the next request."""
    import time

    protocol = front_protocol(LIMIT, 10, 10, BodyBudget(800))
    assert protocol is not None
    budget: BodyBudget = protocol.body_budget  # type: ignore[attr-defined]
    with ServerThread(app, http=protocol) as srv:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 600\r\n\r\n"
        first, second = Conn(srv.port), Conn(srv.port)
        first.send(head + b"a" * 300)  # half its body: held, waiting for the rest
        deadline = time.monotonic() + 10
        while budget.used != 300:
            assert time.monotonic() < deadline, "the first half body was never held"
            time.sleep(0.01)
        second.send(head + b"b" * 600)
        status, headers, body = second.response()
        assert status == 503, body
        assert json.loads(body)["error"]["type"] == "ServiceUnavailableError"
        assert headers.get(b"connection") == b"close"
        first.send(b"a" * 300)
        status, _, body = first.response()
        assert status == 200 and json.loads(body)["size"] == 600
        third = Conn(srv.port)
        third.send(head + b"c" * 600)
        status, _, body = third.response()
        assert status == 200 and json.loads(body)["size"] == 600
        assert budget.used == 0


def _serve_in_a_thread(server) -> threading.Thread:
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return thread


def test_the_quiet_server_ends_its_tick_at_once_on_an_exit_signal(monkeypatch):
    """The proxy's server ticks once a second; a signal to exit does not wait for the tick
    (one an hour here: the server is gone long before it)."""
    monkeypatch.setattr(front_protocol_module, "TICK_S", 3600.0)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = front_protocol_module.quiet_server(config)
    assert type(server).__name__ == "QuietServer"
    thread = _serve_in_a_thread(server)
    server.handle_exit(signal.SIGTERM, None)  # as the signal handler is called
    thread.join(30)
    assert not thread.is_alive()


def test_a_uvicorn_server_lacking_what_the_quiet_one_overrides_is_uvicorns_own(monkeypatch):
    monkeypatch.setattr(front_protocol_module, "_SERVER_NEEDS", ("renamed_in_a_release",))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off")
    assert type(front_protocol_module.quiet_server(config)) is uvicorn.Server
