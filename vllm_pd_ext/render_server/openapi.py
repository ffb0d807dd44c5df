"""The server's OpenAPI document, with the request bodies the routes read.

The routes read and validate their bodies themselves (so every client mistake becomes an OpenAI
error body, never FastAPI's 422), which leaves FastAPI's generated document without request
bodies. This fills them in from the same pydantic models the routes validate with, so clients
and schema fuzzers (schemathesis) see what each route takes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from vllm_pd_ext.render_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DerenderChatRequest,
    DerenderChatStreamRequest,
    DerenderCompletionRequest,
    DerenderCompletionStreamRequest,
)

#: The body each POST route accepts (a derender route takes its batch or its streaming form).
BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/v1/chat/completions/render": (ChatCompletionRequest,),
    "/v1/completions/render": (CompletionRequest,),
    "/v1/chat/completions/derender": (DerenderChatRequest, DerenderChatStreamRequest),
    "/v1/completions/derender": (DerenderCompletionRequest, DerenderCompletionStreamRequest),
}

_ERROR = {
    "description": "OpenAI error body",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type", "param", "code"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": "integer"},
                        },
                    }
                },
            }
        }
    },
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for ``app`` plus request bodies and error responses (cached)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, models in BODIES.items():
        operation = doc.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        refs = []
        for model in models:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
            refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
        body = refs[0] if len(refs) == 1 else {"anyOf": refs}
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
        operation["responses"].update({"400": _ERROR, "404": _ERROR})
    app.openapi_schema = doc
    return doc
