"""Helpers shared by the render server's tests."""

from __future__ import annotations

from typing import Any


def derender_chat_stream(
    client: Any, ids: list[int], size: int, chat_request: dict, prompt_token_ids: list[int]
) -> list[dict]:
    """Derender ``ids`` on ``/v1/chat/completions/derender`` as a stream of ``size``-token
    chunks (the last one finishing with "stop"), each call carrying the stream state the one
    before answered; every answer's JSON, in order. Fails the test on an answer other than 200.
    """
    state, answers = None, []
    for pos in range(0, len(ids), size):
        last = pos + size >= len(ids)
        chunk = {"token_ids": ids[pos : pos + size], "finish_reason": "stop" if last else None}
        resp = client.post(
            "/v1/chat/completions/derender",
            json={
                "stream": True,
                "generate_chunk": {"choices": [chunk]},
                "stream_state": state,
                "chat_request": chat_request,
                "prompt_token_ids": prompt_token_ids,
            },
        )
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        state = answer["stream_state"]
        answers.append(answer)
    return answers
