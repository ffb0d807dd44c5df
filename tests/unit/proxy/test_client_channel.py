"""The client connection's transport wrapper: a response head leaves with the first body
part, in one write."""

from __future__ import annotations

import asyncio

from vllm_pd_ext.proxy.client_channel import _HeadWithBody


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
        t = _HeadWithBody(inner, asyncio.get_running_loop())
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
        t = _HeadWithBody(inner, asyncio.get_running_loop())
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
