"""The OpenAI-style event stream of Dynamo's frontend (and of the proxy in front of it), as the benchmarks read it
line by line."""

from __future__ import annotations

import json


def sse_json(line: bytes, where: str) -> dict | None:
    """The JSON object of one ``data: {...}`` line (None for any other line: ``data: [DONE]``, a comment, a blank);
    RuntimeError naming ``where`` for an error event."""
    line = line.strip()
    if not line.startswith(b"data: {"):
        return None
    obj = json.loads(line[6:])
    if "error" in obj:
        raise RuntimeError(f"{where}: {obj['error']}")
    return obj
