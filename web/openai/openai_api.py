"""OpenAI's audio HTTP APIs on the web front, so the official `openai` SDK (and anything else
that speaks them) works against rtmedia by changing its base URL (docs/openai.md):

- `POST /v1/audio/speech` (rtmedia.web.openai.openai_speech): text to audio in wav, pcm, mp3, opus,
  aac or flac, streamed as it is synthesised, or as SSE events;
- `POST /v1/audio/transcriptions` (rtmedia.web.openai.openai_transcription): an uploaded file of any
  container PyAV reads to text, in json, text, verbose_json, srt or vtt, or streamed as SSE;
- `GET /v1/realtime` (rtmedia.web.openai.realtime_ws): the Realtime API over a WebSocket, one
  `Converse` session per socket;
- `GET /v1/models`, `GET /v1/models/{id}`: the model names these accept, the server's
  recogniser's own name among them (asked of `SpeechService.DescribeRecognizer` once).

Like the WebRTC bridge beside it, the front is a gRPC client of the rtmedia server
(SpeechService): the same engines, scheduler, limits and metrics. Keys are the web port's
tokens (the bridge's `authenticate` middleware); the presented token goes on to the server
as the bridge forwards it. Errors are in OpenAI's shape (rtmedia.web.openai.openai_errors), aiohttp's
own 404/405/413 and the front's 401 included.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from rtmedia.v1 import speech_pb2, speech_pb2_grpc
from rtmedia.web.openai.openai_errors import RETRY_AFTER_S, SERVER_ERROR, OpenAIError
from rtmedia.web.openai.openai_models import MODELS, TRANSCRIPTION_MODELS, check_model, model_entry
from rtmedia.web.openai.realtime_calls import ClientSecrets
from rtmedia.web.openai.realtime_ws import RealtimeLimits

log = logging.getLogger("rtmedia.web")
MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # OpenAI's own limit on a transcription upload
MAX_REQUESTS = 16  # concurrent requests on the front; one more is a 429
MAX_AUDIO_SECONDS = 3600.0  # a transcription's decoded audio (a small file of a low bitrate can hold hours)
DESCRIBE_TIMEOUT_S = 2.0  # DescribeRecognizer's wait; past it, the model lists go on without the recogniser


@dataclass(frozen=True)
class OpenAIConfig:
    """`max_upload_bytes`: the largest transcription upload (its multipart body);
    `max_audio_seconds`: the longest audio a transcription decodes; `max_requests`: requests
    served at once by the front (speech and transcriptions together; a Realtime session is bounded
    by the server's admission instead); `realtime`: the Realtime sockets' limits."""

    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_requests: int = MAX_REQUESTS
    max_audio_seconds: float = MAX_AUDIO_SECONDS
    realtime: RealtimeLimits = field(default_factory=RealtimeLimits)

    def __post_init__(self) -> None:
        if self.max_upload_bytes < 1024:
            raise ValueError(f"the OpenAI API's upload limit must be at least 1024 bytes, got {self.max_upload_bytes}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"the OpenAI API's audio limit must be positive, got {self.max_audio_seconds:g} s")
        if self.max_requests < 1:
            raise ValueError(f"the OpenAI API's request limit must be at least 1, got {self.max_requests}")


@dataclass(frozen=True)
class Upstream:
    """What a handler needs of the web front: the channel new calls to the server go on (it may
    change on a reload) and the gRPC metadata of a request's calls (its forwarded token)."""

    channel: Callable[[], grpc.aio.Channel]
    metadata: Callable[[web.Request], tuple[tuple[str, str], ...]]
    draining: Callable[[], bool] = lambda: False
    calls: Any = None  # the WebRTC bridge, for Realtime calls (answer, own_peer); None: no calls


class OpenAIFront:
    """The routes and the request bound of the OpenAI-compatible APIs."""

    def __init__(self, upstream: Upstream, config: OpenAIConfig | None = None) -> None:
        self.upstream = upstream
        self.config = config or OpenAIConfig()
        self.active = 0  # requests being served
        self.refused = 0  # requests answered 429 by the bound
        self.sockets = 0  # Realtime sessions open
        self.realtime = self.config.realtime
        self.secrets = ClientSecrets()
        self.recognizer: speech_pb2.DescribeRecognizerResponse | None = None  # asked once it answers
        self.languages: set[str] = set()  # transcription `language` values the server accepted

    async def describe_recognizer(self, request: web.Request) -> speech_pb2.DescribeRecognizerResponse | None:
        """The server's recogniser (SpeechService.DescribeRecognizer, with the request's token),
        kept once it answered; None while the server cannot say (the next request asks again)."""
        if self.recognizer is None:
            stub = speech_pb2_grpc.SpeechServiceStub(self.upstream.channel())
            try:
                self.recognizer = await stub.DescribeRecognizer(
                    speech_pb2.DescribeRecognizerRequest(), metadata=self.upstream.metadata(request),
                    timeout=DESCRIBE_TIMEOUT_S)
            except Exception as exc:  # an RPC error, or a channel closed by a reload: today's list
                why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                log.warning("DescribeRecognizer failed (%s); the model list goes on without the recogniser's name",
                            why)
        return self.recognizer

    async def recognizer_name(self, request: web.Request) -> str:
        """The recogniser's own name when it is not one of the aliases, else "" (also while the
        server cannot say)."""
        described = await self.describe_recognizer(request)
        return "" if described is None or described.name in MODELS else described.name

    async def transcription_models(self, request: web.Request) -> tuple[str, ...]:
        """The names transcriptions accept: the aliases, and the recogniser's own name."""
        own = await self.recognizer_name(request)
        return (*TRANSCRIPTION_MODELS, own) if own else TRANSCRIPTION_MODELS

    async def model_names(self, request: web.Request) -> tuple[str, ...]:
        transcription = await self.transcription_models(request)
        return (*MODELS, *transcription[len(TRANSCRIPTION_MODELS):])

    def add_routes(self, app: web.Application) -> None:
        from rtmedia.web.openai.openai_speech import create_speech
        from rtmedia.web.openai.openai_transcription import create_transcription
        from rtmedia.web.openai.realtime_calls import create_call, create_client_secret, hangup
        from rtmedia.web.openai.realtime_ws import realtime_socket

        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/audio/speech", self._bounded(create_speech))
        app.router.add_post("/v1/audio/transcriptions", self._bounded(create_transcription))
        # Realtime sessions are bounded by the server's admission, not by `max_requests`.
        app.router.add_get("/v1/realtime", functools.partial(realtime_socket, front=self))
        app.router.add_post("/v1/realtime/calls", functools.partial(create_call, front=self))
        app.router.add_post("/v1/realtime/calls/{call_id}/hangup", functools.partial(hangup, front=self))
        app.router.add_post("/v1/realtime/client_secrets", functools.partial(create_client_secret, front=self))

    def _bounded(self, handler: Callable[[web.Request, OpenAIFront], Any]) -> Callable[[web.Request], Any]:
        async def bounded(request: web.Request) -> web.StreamResponse:
            async with self.slot():
                return await handler(request, self)

        return bounded

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of `max_requests`; none free is a 429 with Retry-After, and a draining front a 503."""
        if self.upstream.draining():
            raise OpenAIError(503, "the server is shutting down (draining); retry on another replica or shortly",
                              SERVER_ERROR, code="draining", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.active >= self.config.max_requests:
            self.refused += 1
            raise OpenAIError(429, f"the server is at capacity: it serves {self.config.max_requests} audio requests "
                                   "at once; retry shortly", "requests", code="rate_limit_exceeded",
                              headers={"Retry-After": "1"})
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_entry(m) for m in await self.model_names(request)]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        check_model(name, MODELS if name in MODELS else await self.model_names(request))
        return web.json_response(model_entry(name))


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An OpenAIError a handler raised, as its answer."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
