"""Server-sent events of the OpenAI APIs' streams (speech and transcriptions with
`stream: true`): one JSON object a `data:` line."""

from __future__ import annotations

import json
from typing import Any


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event of the APIs' streams; an `error` event is also named `error`, as
    OpenAI's are (the SDK raises it)."""
    prefix = "event: error\n" if event.get("type") == "error" else ""
    return f"{prefix}data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
