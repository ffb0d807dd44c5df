"""JSON from bytes on a server's hot path: ``json.loads`` less the encoding guess for the
usual case."""

from __future__ import annotations

import json
from typing import Any

_DECODER = json.JSONDecoder()  # ``json.loads``'s own, for its default arguments


def loads(raw: bytes) -> Any:
    """``json.loads(raw)``: the same value and the same errors. A body that starts with
    ``{`` not followed by a NUL byte is the UTF-8 that ``json.detect_encoding`` would name
    (it looks at the second byte only when the first is not NUL), so
    it is decoded as such without asking (two Python calls and ~180 bytecode instructions
    fewer a body); anything else goes to ``json.loads``."""
    if raw.startswith(b"{") and raw[1:2] != b"\x00":
        return _DECODER.decode(raw.decode("utf-8", "surrogatepass"))
    return json.loads(raw)
