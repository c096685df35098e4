"""The `openai` responder: any OpenAI-compatible chat-completions endpoint, streamed.

POSTs `{model, messages, stream: true, max_tokens}` to `<base_url>/chat/completions`
(OpenAI, vLLM, llama.cpp's server, Ollama, LM Studio, ...) and yields each
server-sent event's `choices[0].delta.content` until `data: [DONE]`; a reply whose
`finish_reason` is "length" (the token limit) ends with `Incomplete`. The messages
are the instructions (or the same default the local LMs use) as the system
message, then the conversation; camera frames,
when the request has any, go with the last user turn as `image_url` data URLs (a
text-only server may refuse them: pass `send_images=False`).

With tools (docs/protocol.md#tools) the body carries them as `tools` (functions) and
`tool_choice`, and the stream's `delta.tool_calls` become `CallDelta`s (the upstream's
`index` is the call's); the history's function calls go back as the assistant message's
`tool_calls`, each followed by its `tool` message (rtmedia.engines.responders.contract.chat_messages).

Every failure (a status other than 200, a malformed event, a refused connection, a
timeout, an error event in the stream) raises ResponderError naming the URL and the
problem, with the server's own error message when it sent one. Cancelling the task
that consumes `reply()` (barge-in) closes the HTTP response at once, so the server
sees the client go away and can stop generating.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from rtmedia.engines.lm.models import DEFAULT_INSTRUCTIONS
from rtmedia.engines.responders.contract import (
    CallDelta,
    Incomplete,
    ReplyRequest,
    ResponderError,
    chat_messages,
)

__all__ = ["OpenAIResponder", "ResponderError"]

_ERROR_BODY_LIMIT = 64 * 1024


class OpenAIResponder:
    """Replies from an OpenAI-compatible chat-completions server, streamed."""

    name = "openai"
    calls_tools = True

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 30,
        *,
        send_images: bool = True,
    ) -> None:
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.send_images = send_images

    def messages(self, request: ReplyRequest) -> list[dict[str, Any]]:
        """The request's `messages`: the instructions (DEFAULT_INSTRUCTIONS when empty, as for
        the local LMs) as the system message, then the history."""
        system = request.instructions if request.instructions.strip() else DEFAULT_INSTRUCTIONS
        out: list[dict[str, Any]] = [{"role": "system", "content": system}, *chat_messages(request.history)]
        if self.send_images and request.images:
            last_user = next((i for i in range(len(out) - 1, -1, -1) if out[i]["role"] == "user"), None)
            if last_user is not None:
                parts: list[dict[str, Any]] = [{"type": "text", "text": out[last_user]["content"]}]
                parts += [{"type": "image_url", "image_url": {"url": _data_url(image)}} for image in request.images]
                out[last_user] = {"role": "user", "content": parts}
        return out

    def body(self, request: ReplyRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(request), "stream": True}
        if request.max_output_tokens > 0:
            body["max_tokens"] = request.max_output_tokens
        if request.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.parameters}} for t in request.tools]
            choice = request.tool_choice
            body["tool_choice"] = choice if choice in ("auto", "none", "required") else \
                {"type": "function", "function": {"name": choice}}
        return body

    async def reply(self, request: ReplyRequest) -> AsyncIterator[str | Incomplete | CallDelta]:
        headers = {**request.headers, "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        # connect: reaching the server; sock_read: the longest silence between bytes (the first
        # token included). No total limit: a long reply that keeps streaming is fine.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_read=self.timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(self.url, json=self.body(request), headers=headers) as response:
                    try:
                        if response.status != 200:
                            raise ResponderError(await self._http_error(response))
                        ctype = response.headers.get("Content-Type", "")
                        if ctype.startswith("application/json"):  # the server ignored stream: true
                            body = await _json(self.url, response)
                            text = _message_content(self.url, body)
                            if text:
                                yield text
                            for delta in self._calls(body["choices"][0]["message"].get("tool_calls"), body):
                                yield delta
                            if _finish_reason(body) == "length":
                                yield Incomplete()
                            return
                        async for delta in self._events(response):
                            yield delta
                    except BaseException:
                        response.close()  # do not wait for the rest of the stream: drop the connection
                        raise
        except ResponderError:
            raise
        except TimeoutError:
            raise ResponderError(f"{self.url}: no response within {self.timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as e:
            raise ResponderError(f"{self.url}: cannot connect: {e.os_error or e}") from e
        except aiohttp.ClientResponseError as e:
            raise ResponderError(f"{self.url}: HTTP {e.status} {e.message}") from e
        except aiohttp.ClientError as e:
            raise ResponderError(f"{self.url}: {type(e).__name__}: {e}") from e
        except ValueError as e:  # e.g. a stream line over aiohttp's line-length limit
            raise ResponderError(f"{self.url}: unreadable response: {e}") from e

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncIterator[str | Incomplete | CallDelta]:
        """Text deltas from the SSE stream (then `Incomplete` if it finished for "length"). Each
        `data:` line is normally one JSON chunk; a chunk split over several `data:` lines of one
        event is joined at the blank line."""
        pending: list[str] = []  # data lines of an event that is not yet valid JSON
        finished = ""  # the finish_reason a chunk carried
        done = False  # `data: [DONE]` came
        while not done:
            raw = await response.content.readline()
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line:  # the end of an event, or of the stream
                if pending:
                    text, fin, calls = self._chunk("\n".join(pending))
                    pending.clear()
                    finished = fin or finished
                    if text:
                        yield text
                    for call in calls:
                        yield call
                if not raw:
                    break
                continue
            if not line.startswith("data:"):  # a comment (":"), event:, id:, retry:
                continue
            data = line[5:].removeprefix(" ")
            if not pending and data.strip() == "[DONE]":
                done = True
                continue
            if not pending:
                try:
                    chunk = json.loads(data)
                except ValueError:
                    pending.append(data)  # perhaps the first line of a multi-line event
                    continue
                text, fin, calls = self._handle(chunk)
                finished = fin or finished
                if text:
                    yield text
                for call in calls:
                    yield call
            else:
                pending.append(data)
        if not done and not finished:
            raise ResponderError(f"{self.url}: the stream ended before `data: [DONE]` or a finish_reason")
        if finished == "length":
            yield Incomplete()

    def _chunk(self, data: str) -> tuple[str, str, list[CallDelta]]:
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ResponderError(f"{self.url}: malformed stream event (not JSON): {data[:200]!r}") from None
        return self._handle(chunk)

    def _handle(self, chunk: Any) -> tuple[str, str, list[CallDelta]]:
        """(the chunk's text, the finish_reason it carries or "", its tool calls' deltas)."""
        if not isinstance(chunk, dict):
            raise ResponderError(f"{self.url}: malformed stream event (not an object): {str(chunk)[:200]!r}")
        if "error" in chunk:
            raise ResponderError(f"{self.url}: the server reported an error mid-stream: {_error_text(chunk)}")
        choices = chunk.get("choices") or []  # a usage-only chunk has none
        if not isinstance(choices, list):
            raise ResponderError(f"{self.url}: malformed stream event (choices is not a list): {str(chunk)[:200]!r}")
        if not choices or not isinstance(choices[0], dict):
            return "", "", []
        delta = choices[0].get("delta") or {}
        content = delta.get("content") if isinstance(delta, dict) else None
        reason = choices[0].get("finish_reason")
        calls = self._calls(delta.get("tool_calls") if isinstance(delta, dict) else None, chunk)
        return (content if isinstance(content, str) else ""), (str(reason) if reason else ""), calls

    def _calls(self, tool_calls: Any, chunk: Any) -> list[CallDelta]:
        """The `tool_calls` of a delta (or of a whole message) as CallDeltas."""
        if tool_calls is None:
            return []
        if not isinstance(tool_calls, list):
            raise ResponderError(f"{self.url}: malformed stream event (tool_calls is not a list): {str(chunk)[:200]!r}")
        out = []
        for n, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            index = call.get("index", n) if isinstance(call, dict) else None
            if not isinstance(function, dict) or isinstance(index, bool) or not isinstance(index, int):
                raise ResponderError(f"{self.url}: malformed tool call in the stream: {str(call)[:200]!r}")
            name, arguments = function.get("name") or "", function.get("arguments") or ""
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise ResponderError(f"{self.url}: malformed tool call in the stream: {str(call)[:200]!r}")
            out.append(CallDelta(index, name, arguments))
        return out

    async def _http_error(self, response: aiohttp.ClientResponse) -> str:
        head = f"{self.url}: HTTP {response.status} {response.reason or ''}".rstrip()
        try:
            raw = await response.content.read(_ERROR_BODY_LIMIT)
        except (aiohttp.ClientError, TimeoutError):
            return head
        text = raw.decode("utf-8", errors="replace").strip()
        try:
            detail = _error_text(json.loads(text))
        except ValueError:
            detail = text[:500]
        return f"{head}: {detail}" if detail else head


def _data_url(image: bytes) -> str:
    mime = "image/png" if image.startswith(b"\x89PNG") else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def _error_text(body: Any) -> str:
    """The message of an error body: OpenAI's {"error": {"message": ...}}, or {"error": "..."},
    {"detail": ...}, {"message": ...}; the JSON itself otherwise."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            for key in ("message", "detail", "error"):
                if isinstance(err.get(key), str):
                    return err[key]
        elif isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return json.dumps(body)[:500]


async def _json(url: str, response: aiohttp.ClientResponse) -> Any:
    try:
        return json.loads(await response.text())
    except ValueError:
        raise ResponderError(f"{url}: the response is not valid JSON") from None


def _finish_reason(body: Any) -> str:
    """`choices[0].finish_reason` of a whole (non-streamed) completion, or ""."""
    try:
        return str(body["choices"][0].get("finish_reason") or "")
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""


def _message_content(url: str, body: Any) -> str:
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        if isinstance(body, dict) and "error" in body:
            raise ResponderError(f"{url}: {_error_text(body)}") from None
        raise ResponderError(f"{url}: unexpected response: {json.dumps(body)[:200]}") from None
    return content or ""

