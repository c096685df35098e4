"""POST /v1/audio/speech: OpenAI's text-to-speech API on rtmedia's SpeechService.Synthesize.

The JSON body is OpenAI's (`model`, `input`, `voice`, `instructions`, `response_format`,
`speed`, `stream_format`) plus rtmedia's `sample_rate`: any rate the voice's ListVoices entry
offers, else the API's own rate (OUTPUT_RATE). OpenAI's voice names speak with the server's
default voice; rtmedia's voice names choose that voice; `instructions` is accepted and
ignored. Unknown fields are ignored; a missing, mistyped or out-of-range field is a 400
naming it, in OpenAI's words and shape (rtmedia.web.openai.openai_errors).

The answer streams: the server synthesises clause by clause, each clause is encoded as it
arrives (rtmedia.web.audio_encode, on a worker thread) and its bytes are written at once, as
chunked audio in `response_format` or, with `stream_format: sse`, as `speech.audio.delta`
events (the same bytes, base64) closed by `speech.audio.done` with its usage. Usage counts the
input's words as input tokens and the audio as output tokens, one per AUDIO_TOKEN_MS.

The first clause is read before the response starts, so whatever the server refuses (an
unknown voice, a sample rate the voice lacks, text with nothing to speak, a full server) is an
HTTP error with its status. Once the response has started its status cannot change: a failure
after that (the server or its engine failing mid-stream) is logged and ends the stream by
closing the connection before the chunked body's last chunk, so a client sees a truncated body
and never mistakes it for a whole file; an SSE stream first gets an `error` event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from rtmedia.v1 import speech_pb2, speech_pb2_grpc
from rtmedia.web.audio_encode import FORMATS, StreamEncoder, rate_problem
from rtmedia.web.openai.openai_errors import SERVER_ERROR, OpenAIError, from_rpc
from rtmedia.web.openai.openai_models import SPEECH_MODELS, check_model
from rtmedia.web.openai.sse import sse as sse_event

if TYPE_CHECKING:  # the front mounts these handlers; they only name its type
    from rtmedia.web.openai.openai_api import OpenAIFront

log = logging.getLogger("rtmedia.web")

MAX_INPUT_CHARS = 5000
OUTPUT_RATE = 24000  # OpenAI's speech audio rate
SPEED_RANGE = (0.25, 4.0)
DEFAULT_FORMAT = "mp3"
STREAM_FORMATS = ("audio", "sse")
# OpenAI offers SSE only on its newer speech models.
NO_SSE_MODELS = ("tts-1", "tts-1-hd")
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
# The first clause's first audio is encoded and sent alone: a codec's time grows with the audio
# it is given, and a first clause may hold seconds of it.
FIRST_PIECE_MS = 200
AUDIO_TOKEN_MS = 50  # output audio per usage token, as OpenAI counts a model's audio output


@dataclass(frozen=True)
class SpeechParams:
    """A validated request. `voice` is the server's voice name ("" for its default)."""

    model: str
    text: str
    voice: str
    response_format: str
    speed: float
    stream_format: str
    sample_rate: int


async def create_speech(request: web.Request, front: OpenAIFront) -> web.StreamResponse:
    started = time.perf_counter()
    params = parse_params(await _json_body(request))
    stub = speech_pb2_grpc.SpeechServiceStub(front.upstream.channel())
    call = stub.Synthesize(speech_pb2.SynthesizeRequest(
        text=params.text, voice=params.voice, sample_rate=params.sample_rate,
        framing=speech_pb2.AUDIO_FRAMING_PCM16, speed=params.speed), metadata=front.upstream.metadata(request))
    try:
        return await _answer(request, params, call, started)
    finally:
        call.cancel()  # a no-op once the stream has ended


async def _answer(request: web.Request, params: SpeechParams, call: Any, started: float) -> web.StreamResponse:
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise _refusal(exc) from None
    if first is not grpc.aio.EOF and first.sample_rate not in (0, params.sample_rate):
        raise OpenAIError(502, f"the server answered with audio at {first.sample_rate} Hz for a request for "
                               f"{params.sample_rate} Hz", SERVER_ERROR, code="bad_upstream_audio")
    encoder = StreamEncoder(params.response_format, params.sample_rate)
    sse = params.stream_format == "sse"
    stats = {"bytes": 0, "first_byte_ms": None}
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream" if sse else FORMATS[params.response_format].content_type,
        "Cache-Control": "no-cache",
    })
    response.enable_chunked_encoding()

    async def send(data: bytes) -> None:
        if not data:
            return
        if stats["first_byte_ms"] is None:
            stats["first_byte_ms"] = round((time.perf_counter() - started) * 1000)
        stats["bytes"] += len(data)
        if sse:
            data = sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        await response.write(data)

    try:
        await response.prepare(request)
        chunk = first
        if chunk is not grpc.aio.EOF:  # the first audio leaves before the rest of its clause is encoded
            lead = params.sample_rate * FIRST_PIECE_MS // 1000 * 2
            await send(await _encode(encoder, chunk.audio[:lead]))
            await send(await _encode(encoder, chunk.audio[lead:]))
            chunk = await call.read()
        while chunk is not grpc.aio.EOF:
            await send(await _encode(encoder, chunk.audio))
            chunk = await call.read()
        await send(await _encode(encoder, None))
        if sse:
            await response.write(sse_event({"type": "speech.audio.done", "usage": _usage(params.text, encoder)}))
        await response.write_eof()
    except grpc.aio.AioRpcError as exc:  # the server failed after the response started
        _log(params, encoder, stats, started, failed=f"{exc.code().name}: {exc.details()}")
        await _cut(request, response, sse, from_rpc(exc))
        return response
    except ConnectionError:  # the client went away: nobody to answer
        _log(params, encoder, stats, started, failed="client disconnected")
        return response
    except asyncio.CancelledError:
        _log(params, encoder, stats, started, failed="cancelled")
        raise
    finally:
        if not encoder.closed:
            asyncio.get_running_loop().run_in_executor(None, encoder.discard)
    _log(params, encoder, stats, started)
    return response


async def _encode(encoder: StreamEncoder, pcm16: bytes | None) -> bytes:
    """A clause's bytes (None: the file's last bytes), encoded off the loop where a codec runs."""
    work = encoder.close if pcm16 is None else (lambda: encoder.encode(pcm16))
    return await asyncio.to_thread(work) if encoder.spec.codec else work()


async def _cut(request: web.Request, response: web.StreamResponse, sse: bool, error: OpenAIError) -> None:
    """End a started response that cannot be completed: an SSE client gets the error as an
    event; then the connection closes without the chunked body's last chunk."""
    if sse:
        try:
            await response.write(sse_event({"type": "error", **error.body()}))
        except ConnectionError:
            pass
    if request.transport is not None:
        request.transport.close()


def _refusal(exc: grpc.aio.AioRpcError) -> OpenAIError:
    error = from_rpc(exc)
    if error.param == "voice":
        error.message += "; or one of OpenAI's voice names (" + ", ".join(OPENAI_VOICES) + \
                         "), which speak with the default voice"
    return error


def _usage(text: str, encoder: StreamEncoder) -> dict[str, int]:
    words = len(text.split())
    audio_tokens = math.ceil(encoder.samples * 1000 / encoder.rate / AUDIO_TOKEN_MS)
    return {"input_tokens": words, "output_tokens": audio_tokens, "total_tokens": words + audio_tokens}


def _log(params: SpeechParams, encoder: StreamEncoder, stats: dict[str, Any], started: float,
         failed: str | None = None) -> None:
    extra = {"model": params.model, "format": params.response_format, "stream_format": params.stream_format,
             "rate": encoder.rate, "chars": len(params.text), "bytes": stats["bytes"],
             "audio_ms": encoder.samples * 1000 // encoder.rate, "first_byte_ms": stats["first_byte_ms"],
             "total_ms": round((time.perf_counter() - started) * 1000)}
    if failed is None:
        log.info("openai speech", extra=extra)
    else:
        log.warning("openai speech ended early", extra={**extra, "error": failed})


# ---- the request ---------------------------------------------------------------------------------

async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        sent = request.headers.get("Content-Type")
        raise OpenAIError(400, f"unsupported content type: {sent[:100]!r}; this endpoint only accepts "
                               "'application/json' requests" if sent else
                               "the request has no Content-Type; this endpoint only accepts 'application/json'",
                          code="unsupported_content_type")
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, not {_json_type(body)}",
                          code="invalid_type")
    return body


def parse_params(body: dict[str, Any]) -> SpeechParams:
    """The request's fields, checked; a bad one is an OpenAIError naming it."""
    model = check_model(body.get("model"), SPEECH_MODELS)
    text = _required(body, "input", str, "a string")
    if not text:
        raise OpenAIError(400, "Invalid 'input': empty string. Expected a string with at least 1 character.",
                          param="input", code="empty_string")
    if len(text) > MAX_INPUT_CHARS:
        raise OpenAIError(400, f"Invalid 'input': string too long. Expected a string with at most "
                               f"{MAX_INPUT_CHARS} characters, but got {len(text)} characters.",
                          param="input", code="string_above_max_length")
    voice = _voice(body.get("voice"))
    _optional(body, "instructions", str, "a string", "")
    fmt = _choice(body, "response_format", tuple(FORMATS), DEFAULT_FORMAT)
    stream_format = _choice(body, "stream_format", STREAM_FORMATS, "audio")
    if stream_format == "sse" and model in NO_SSE_MODELS:
        raise OpenAIError(400, f"stream_format 'sse' is not supported with model {model!r}; use "
                               f"{', '.join(m for m in SPEECH_MODELS if m not in NO_SSE_MODELS)}",
                          param="stream_format", code="unsupported_value")
    speed = _speed(body)
    rate = _optional(body, "sample_rate", int, "an integer", OUTPUT_RATE)
    if (problem := rate_problem(fmt, rate)) is not None:
        raise OpenAIError(400, problem, param="sample_rate", code="unsupported_value")
    return SpeechParams(model, text, voice, fmt, speed, stream_format, rate)


def _voice(value: Any) -> str:
    """OpenAI's `voice`: a name, or a custom voice object `{"id": name}`; OpenAI's names map to
    the server's default voice, any other name goes to the server as it is (an unknown one
    comes back UNKNOWN_VOICE, a 400 naming voice)."""
    if isinstance(value, dict) and "id" in value:
        value = value["id"]
    if value is None or value == "":
        raise OpenAIError(400, "Missing required parameter: 'voice': one of OpenAI's voice names ("
                               + ", ".join(OPENAI_VOICES) + ") or an rtmedia voice name", param="voice",
                          code="missing_required_parameter")
    if not isinstance(value, str):
        raise OpenAIError(400, f"Invalid type for 'voice': expected a string or an object with an 'id', "
                               f"but got {_json_type(value)} instead.", param="voice", code="invalid_type")
    return "" if value in OPENAI_VOICES else value


def _speed(body: dict[str, Any]) -> float:
    speed = _optional(body, "speed", (int, float), "a number", 1.0)
    low, high = SPEED_RANGE
    if not low <= speed <= high:
        raise OpenAIError(400, f"Invalid 'speed': expected a value from {low} to {high}, but got {speed} instead.",
                          param="speed", code="decimal_above_max_value" if speed > high else
                          "decimal_below_min_value")
    return float(speed)


def _choice(body: dict[str, Any], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = _optional(body, name, str, "a string", default)
    if value not in allowed:
        raise OpenAIError(400, f"Invalid value for '{name}': {value[:100]!r}. Supported values are: "
                               + ", ".join(f"'{v}'" for v in allowed) + ".", param=name, code="invalid_value")
    return value


def _required(body: dict[str, Any], name: str, kind: type | tuple[type, ...], expected: str) -> Any:
    if body.get(name) is None:
        raise OpenAIError(400, f"Missing required parameter: '{name}'.", param=name,
                          code="missing_required_parameter")
    return _typed(body[name], name, kind, expected)


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], expected: str, default: Any) -> Any:
    """The field, or `default` when it is absent or null."""
    value = body.get(name)
    return default if value is None else _typed(value, name, kind, expected)


def _typed(value: Any, name: str, kind: type | tuple[type, ...], expected: str) -> Any:
    # JSON's true and false are Python ints: never a number here.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise OpenAIError(400, f"Invalid type for '{name}': expected {expected}, but got {_json_type(value)} "
                               "instead.", param=name, code="invalid_type")
    return value


_JSON_TYPES = ((bool, "a boolean"), (int, "an integer"), (float, "a decimal"), (str, "a string"),
               (list, "an array"), (dict, "an object"))  # bool before int: JSON's true is a Python int


def _json_type(value: Any) -> str:
    return next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), "null")
