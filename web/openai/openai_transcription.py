"""POST /v1/audio/transcriptions: OpenAI's transcription API on the rtmedia server's recogniser.

The request is multipart/form-data, read with aiohttp's streaming multipart reader: the `file`
part is spooled (in memory, then a temporary file) and the whole body is bounded by the front's
`max_upload_bytes` (over it: 413 at once, the rest unread). The other fields: `model`
(required: one of the aliases or the recogniser's own name), `language` (what the audio is said
in, ISO 639-1 or BCP-47, as the server's recogniser serves it: the server refuses another, asked
on a call of its own before the file is opened (`check_language`), a 400 `unsupported_language`
naming what it serves; empty: English, or detected on a multilingual recogniser), `response_format` (json, text, verbose_json, srt,
vtt), `timestamp_granularities[]` (segment, word), `stream`, `prompt` (its last 1000
characters go to the recogniser as the text said before), `include[]` (`logprobs`: the
recogniser's tokens with their log-probabilities; any other value is a 400), and `temperature`
(it must be a number; decoding is greedy). Other fields are ignored.

The file is decoded by PyAV (rtmedia.web.audio_decode) off the event loop, piece by piece, into
PCM16 mono at 16 kHz, which goes to the server's `SpeechService.Transcribe` as fast as the call
takes it, with `vad_segmentation` (the VAD cuts the recording into utterances). A short lead-in
of silence goes first, because the recogniser's endpointer can clip a word that starts at the
very first sample; every offset answered is moved back by it. The file is checked before the
call starts: one PyAV cannot open, without an audio stream, or from which nothing decodes is a
400 naming PyAV's reason. A file cut short is transcribed as far as it decodes (the log line
says where decoding stopped); so is one with a few damaged packets, which are skipped.

Answers, per `response_format`: json `{"text", "usage"}` (usage: the audio's duration, whole
seconds rounded up, as OpenAI bills); text (the text and a newline); verbose_json (task,
language, duration, text, usage, and `segments` unless only word timestamps were
asked, `words` when they were); srt and vtt, one cue per utterance. The text is the utterances'
final texts joined by spaces. verbose_json's language is the one most of the utterances were
recognised in (asked for, or detected), named as OpenAI names it ("english", "french"). A verbose segment is an utterance: its start and end are its
first and last words' (the utterance's own bounds when it has no word timings), `seek` is where
its decoding began in hundredths of a second (Whisper's frames), `tokens` its text tokens' ids,
`avg_logprob` their mean natural log-probability, `no_speech_prob` the model's probability that
it held no speech, `compression_ratio` Whisper's (text bytes over their zlib size), and
`temperature` 0 (decoding is greedy). With `include[]=logprobs`, the json answer has `logprobs`:
every token of the text as OpenAI gives them (`token`, `logprob`, `bytes`); another
response_format with it is a 400, as at OpenAI. (With `--asr pocketsphinx` there are no tokens:
`logprobs` is empty, `avg_logprob` the mean log of the words' confidences.)

`stream=true` (for every model, whatever the response_format; OpenAI ignores it for whisper-1)
answers text/event-stream: `transcript.text.delta` events, then `transcript.text.done`. The
response starts with the first event, so a failure before it (the server refusing the call) is still an HTTP error; a failure
after it ends the stream with an `error` event carrying OpenAI's error object, which the SDK
raises as APIError. A delta is one utterance's final text (after a space, but the first), sent as
soon as the recogniser has finished that utterance, so the deltas concatenate exactly to the done
text, which is the json answer's text; with `include[]=logprobs`, each delta has its
utterance's `logprobs`, and the done event all of them. Partial results are not streamed: the
final decode may still revise words a partial had, and a delta cannot be taken back.

A client that goes away while its file is being transcribed ends the server's call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.multipart import BodyPartReader
from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc
from rtmedia.web.audio_decode import RATE, SAMPLE_BYTES, AudioDecodeError, PcmDecoder
from rtmedia.web.openai.openai_errors import OpenAIError, from_rpc
from rtmedia.web.openai.openai_models import TRANSCRIPTION_MODELS, check_model
from rtmedia.web.openai.sse import sse
from rtmedia.web.subtitles import Cue, srt, vtt

if TYPE_CHECKING:  # the front mounts these handlers; they only name its type
    from rtmedia.web.openai.openai_api import OpenAIFront

log = logging.getLogger("rtmedia.web")
T = TypeVar("T")

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
MAX_LANGUAGE_CHARS = 64  # a language code or name; a longer value is a 400 here, before the call
GRANULARITIES = ("segment", "word")
INCLUDES = ("logprobs",)
PROMPT_CHARS = 1000  # the server's limit on TranscribeConfig.prompt
PIECE_BYTES = RATE * SAMPLE_BYTES  # PCM16 per Transcribe request: one second
LEAD_IN_MS = 500  # silence sent before the file's audio (see the module docstring)
MAX_FIELD_BYTES = 64 * 1024  # one form field other than the file
SPOOL_MEMORY_BYTES = 1024 * 1024  # an upload larger than this is spooled to a temporary file
READ_BYTES = 64 * 1024
WATCH_S = 0.25  # how often a transcription looks whether its client is still connected
LIST_FIELDS = ("timestamp_granularities", "include")  # sent as `name[]`, repeated


class ClientGone(Exception):
    """The client closed its connection while its file was being transcribed."""


# ---- the form ---------------------------------------------------------------------------------------
@dataclass
class Upload:
    """A request's form: the spooled file and the other fields (lists for LIST_FIELDS)."""

    file: BinaryIO | None = None
    file_bytes: int = 0
    body_bytes: int = 0
    fields: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@dataclass(frozen=True)
class Options:
    """The request's checked fields."""

    model: str
    response_format: str
    stream: bool
    words: bool  # word timestamps asked
    segments: bool  # segment timestamps asked (or no granularity named)
    prompt: str = ""  # its last PROMPT_CHARS characters, the recogniser's context
    logprobs: bool = False  # include[]=logprobs
    language: str = ""  # as asked (the server checks it)


async def read_upload(request: web.Request, limit: int) -> Upload:
    """The multipart body, streamed: the file spooled, fields kept; the body over `limit`
    bytes is a 413, and a body that is not multipart form data a 400."""
    if request.content_type != "multipart/form-data":
        raise OpenAIError(400, "the request body must be multipart/form-data with the fields file and model; "
                               f"its Content-Type is {request.content_type[:100]!r}", code="invalid_content_type")
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    upload = Upload()
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise OpenAIError(400, "the form holds a nested multipart part; send flat form fields",
                                  code="invalid_multipart")
            await _read_part(part, upload, limit)
    except (ValueError, HttpProcessingError, ConnectionError, EOFError) as exc:  # includes aiohttp's parse errors
        upload.close()
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise OpenAIError(400, f"the multipart body could not be read: {why}", code="invalid_multipart") from None
    except BaseException:
        upload.close()
        raise
    return upload


async def _read_part(part: BodyPartReader, upload: Upload, limit: int) -> None:
    name = part.name or ""
    if name == "file":
        if upload.file is not None:
            raise OpenAIError(400, "the form has more than one file field; send one file", param="file",
                              code="invalid_value")
        upload.file = tempfile.SpooledTemporaryFile(SPOOL_MEMORY_BYTES)  # closed by Upload.close
        while chunk := await part.read_chunk(READ_BYTES):
            upload.body_bytes += len(chunk)
            if upload.body_bytes > limit:
                raise _too_large(limit)
            upload.file.write(chunk)
            upload.file_bytes += len(chunk)
        return
    raw = bytearray()
    while chunk := await part.read_chunk(READ_BYTES):
        raw += chunk
        upload.body_bytes += len(chunk)
        if upload.body_bytes > limit:
            raise _too_large(limit)
        if len(raw) > MAX_FIELD_BYTES:
            raise OpenAIError(400, f"the form field {name[:50]!r} is longer than {MAX_FIELD_BYTES} bytes",
                              param=name[:50], code="invalid_value")
    try:
        value = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise OpenAIError(400, f"the form field {name[:50]!r} is not UTF-8 text", param=name[:50],
                          code="invalid_value") from None
    key = name.removesuffix("[]")
    if key in LIST_FIELDS:
        upload.fields.setdefault(key, []).append(value)
    else:
        upload.fields[key] = value


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"the upload is larger than the limit of {limit} bytes ({limit / 2**20:.4g} MiB); "
                            "send a shorter or more compressed file", param="file", code="file_too_large")


def check_options(upload: Upload, models: tuple[str, ...] = TRANSCRIPTION_MODELS) -> Options:
    """The fields checked, in OpenAI's errors: 400 naming the field (404 for a model not in
    `models`). The language is the server's to check (the call's BAD_LANGUAGE)."""
    fields = upload.fields
    if upload.file is None:
        raise OpenAIError(400, "file is required: the audio to transcribe, as the form's file field", param="file",
                          code="missing_file")
    if upload.file_bytes == 0:
        raise OpenAIError(400, "the file is empty", param="file", code="empty_file")
    model = check_model(fields.get("model"), models)
    language = fields.get("language", "").strip()
    if len(language) > MAX_LANGUAGE_CHARS:
        raise OpenAIError(400, f"language {language[:50]!r}... is not a language: send an ISO 639-1 code such as "
                               "en or fr, or leave it out", param="language", code="unsupported_language")
    response_format = fields.get("response_format", "") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise OpenAIError(400, f"response_format {response_format[:50]!r} is not supported; supported: "
                               + ", ".join(RESPONSE_FORMATS), param="response_format", code="invalid_value")
    if (temperature := fields.get("temperature", "").strip()) and not _is_number(temperature):
        raise OpenAIError(400, f"temperature {temperature[:50]!r} is not a number", param="temperature",
                          code="invalid_type")
    granularities = set(fields.get("timestamp_granularities", []))
    if unknown := granularities - set(GRANULARITIES):
        raise OpenAIError(400, f"timestamp_granularities {sorted(unknown)[0][:50]!r} is not one of "
                               + ", ".join(GRANULARITIES), param="timestamp_granularities", code="invalid_value")
    stream = fields.get("stream", "false").strip().lower()
    if stream not in ("true", "false", "1", "0", ""):
        raise OpenAIError(400, f"stream {stream[:50]!r} is not a boolean (true or false)", param="stream",
                          code="invalid_type")
    include = set(fields.get("include", []))
    if unknown := include - set(INCLUDES):
        raise OpenAIError(400, f"include {sorted(unknown)[0][:50]!r} is not one of " + ", ".join(INCLUDES),
                          param="include", code="invalid_value")
    streamed = stream in ("true", "1")
    if include and response_format != "json" and not streamed:
        raise OpenAIError(400, f"include logprobs needs response_format json (or stream true), not "
                               f"{response_format}", param="include", code="invalid_value")
    return Options(model, response_format, streamed, "word" in granularities,
                   not granularities or "segment" in granularities, fields.get("prompt", "")[-PROMPT_CHARS:],
                   "logprobs" in include, language)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


# ---- the recognition --------------------------------------------------------------------------------
MAX_LANGUAGES_KEPT = 256  # accepted `language` values the front remembers


async def check_language(front: OpenAIFront, request: web.Request, language: str) -> None:
    """A language the server's recogniser does not serve is the server's refusal (BAD_LANGUAGE: a
    400 `unsupported_language` naming what it serves), asked on a call that carries the config
    alone: a call the server ends while the client is still writing audio can lose the server's
    status to that write (grpc's asyncio client reports INTERNAL instead). A value once accepted
    is not asked again."""
    if not language or language in front.languages:
        return
    stub = speech_pb2_grpc.SpeechServiceStub(front.upstream.channel())
    call = stub.Transcribe(metadata=front.upstream.metadata(request))
    try:
        await call.write(speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
            audio_format=common_pb2.AudioFormat(encoding=common_pb2.AUDIO_ENCODING_PCM16, sample_rate=RATE,
                                                channels=1), language=language, disable_partial_results=True)))
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:  # no audio, so no results
            pass
    except grpc.aio.AioRpcError as exc:
        raise from_rpc(exc) from None
    finally:
        call.cancel()
    if len(front.languages) >= MAX_LANGUAGES_KEPT:
        front.languages.clear()
    front.languages.add(language)


class Recognition:
    """One `Transcribe` call fed by a decoder: `results()` yields the server's results while a
    task writes the audio and another watches the client's connection (a client that left ends
    the call). The decoder's first piece was read already (the file is checked before the call)."""

    def __init__(self, front: OpenAIFront, request: web.Request, decoder: PcmDecoder, first: bytes,
                 prompt: str = "", language: str = "") -> None:
        self.front, self.request, self.decoder, self.first = front, request, decoder, first
        self.prompt, self.language = prompt, language
        self._failure: BaseException | None = None  # why a helper task cancelled the call

    async def results(self) -> AsyncIterator[speech_pb2.TranscribeResponse]:
        """The server's results in order. Raises OpenAIError for a failed call, ClientGone when
        the client left."""
        stub = speech_pb2_grpc.SpeechServiceStub(self.front.upstream.channel())
        call = stub.Transcribe(metadata=self.front.upstream.metadata(self.request))
        helpers = [asyncio.create_task(self._write(call), name="transcription-writer"),
                   asyncio.create_task(self._watch(call), name="transcription-watch")]
        try:
            while True:
                try:
                    result = await call.read()
                except (asyncio.CancelledError, grpc.aio.AioRpcError):
                    current = asyncio.current_task()
                    if self._failure is not None and not (current and current.cancelling()):
                        raise self._failure from None
                    raise
                if result is grpc.aio.EOF:
                    break
                yield result
        except grpc.aio.AioRpcError as exc:
            raise from_rpc(exc) from None
        finally:
            call.cancel()
            for task in helpers:
                task.cancel()
            await asyncio.wait(helpers)  # a cancellation of this task still propagates from here

    def _fail(self, call: Any, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        call.cancel()

    async def _watch(self, call: Any) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            transport = self.request.transport
            if transport is None or transport.is_closing():
                self._fail(call, ClientGone())
                return

    async def _write(self, call: Any) -> None:
        config = speech_pb2.TranscribeConfig(
            audio_format=common_pb2.AudioFormat(encoding=common_pb2.AUDIO_ENCODING_PCM16, sample_rate=RATE,
                                                channels=1),
            language=self.language, disable_partial_results=True, vad_segmentation=True, prompt=self.prompt)
        limit = self.front.config.max_audio_seconds
        try:
            await call.write(speech_pb2.TranscribeRequest(config=config))
            await call.write(speech_pb2.TranscribeRequest(audio=bytes(LEAD_IN_MS * RATE // 1000 * SAMPLE_BYTES)))
            piece = self.first
            while piece:
                await call.write(speech_pb2.TranscribeRequest(audio=piece))
                piece = await self._decode()
                if self.decoder.seconds > limit:
                    self._fail(call, OpenAIError(400, f"the file's audio is longer than the limit of {limit:g} s",
                                                 param="file", code="audio_too_long"))
                    return
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call ended (the reader reports how)
        except Exception as exc:  # the decoder's or this code's fault: the call ends with it
            self._fail(call, exc)

    async def _decode(self) -> bytes:
        return await blocking(self.decoder.read, PIECE_BYTES)


async def blocking(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a thread. Cancelled, it still waits for the thread to end before the
    cancellation goes on, so the upload and its decoder are never closed while a thread uses
    them; a decoder the thread made meanwhile is closed."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        if not future.cancelled() and future.exception() is None and isinstance(future.result(), PcmDecoder):
            future.result().close()
        raise


@dataclass
class Utterance:
    """A final result, its offsets in seconds in the file's time."""

    text: str
    start: float
    end: float
    seek_s: float
    words: list[tuple[str, float, float, float]]  # word, start, end, confidence
    tokens: list[common_pb2.TokenInfo] = field(default_factory=list)
    no_speech_prob: float = 0.0
    language: str = ""  # ISO 639-1, "" when unknown


def utterance(result: speech_pb2.TranscribeResponse, duration: float) -> Utterance:
    def at(ms: int) -> float:
        return min(duration, max(0.0, (ms - LEAD_IN_MS) / 1000))

    words = [(w.word, at(w.start_ms), at(w.end_ms), w.confidence) for w in result.words]
    start, end = (words[0][1], words[-1][2]) if words else (at(result.start_ms), at(result.end_ms))
    return Utterance(result.text.strip(), start, max(start, end), at(result.start_ms), words, list(result.tokens),
                     result.no_speech_prob, result.language)


def spoken_language(utterances: list[Utterance]) -> str:
    """The language (ISO 639-1) most of the spoken utterances were recognised in; "" when none says."""
    codes = [u.language for u in utterances if u.text and u.language]
    return max(codes, key=codes.count) if codes else ""


def language_name(code: str) -> str:
    """A language code as OpenAI's verbose_json names it: Whisper's lowercase name ("english",
    "french"); English when none is known (an English-only recogniser's); the code itself for
    one Whisper has no name for."""
    if code in ("", "en"):
        return "english"
    from transformers.models.whisper.tokenization_whisper import LANGUAGES  # a large import: off the loop

    return LANGUAGES.get(code, code)


def logprobs(tokens: list[common_pb2.TokenInfo]) -> list[dict[str, Any]]:
    """Tokens as OpenAI's `logprobs` entries."""
    return [{"token": t.token, "logprob": round(t.logprob, 6), "bytes": list(t.bytes)} for t in tokens]


# ---- the answers ------------------------------------------------------------------------------------
def render(options: Options, utterances: list[Utterance], duration: float, language: str = "english"
           ) -> web.Response:
    """The answer in `options.response_format`; `language`: verbose_json's name of it."""
    spoken = [u for u in utterances if u.text]
    text = " ".join(u.text for u in spoken)
    usage = {"type": "duration", "seconds": math.ceil(duration)}
    fmt = options.response_format
    if fmt == "json":
        body = {"text": text, "usage": usage}
        if options.logprobs:
            body["logprobs"] = logprobs([t for u in spoken for t in u.tokens])
        return web.json_response(body)
    if fmt == "text":
        return web.Response(text=text + "\n", content_type="text/plain")
    if fmt in ("srt", "vtt"):
        cues: list[Cue] = [(u.start, u.end, u.text) for u in spoken]
        if fmt == "srt":
            return web.Response(text=srt(cues), content_type="text/plain")
        return web.Response(text=vtt(cues), content_type="text/vtt")
    body: dict[str, Any] = {"task": "transcribe", "language": language, "duration": round(duration, 3),
                            "text": text, "usage": usage}
    if options.segments:
        body["segments"] = [_segment(n, u) for n, u in enumerate(spoken)]
    if options.words:
        body["words"] = [{"word": w, "start": round(s, 3), "end": round(e, 3)} for u in spoken for w, s, e, _ in u.words]
    return web.json_response(body)


def _segment(n: int, u: Utterance) -> dict[str, Any]:
    encoded = u.text.encode()
    scores = [t.logprob for t in u.tokens] or [math.log(max(c, 1e-4)) for *_, c in u.words]
    return {"id": n, "seek": round(u.seek_s * 100), "start": round(u.start, 3), "end": round(u.end, 3),
            "text": u.text, "tokens": [t.id for t in u.tokens], "temperature": 0.0,
            "avg_logprob": round(sum(scores) / len(scores), 4) if scores else 0.0,
            "compression_ratio": round(len(encoded) / len(zlib.compress(encoded)), 4),
            "no_speech_prob": round(u.no_speech_prob, 4)}


async def stream_events(request: web.Request, recognition: Recognition, facts: dict[str, Any],
                        with_logprobs: bool = False) -> web.StreamResponse:
    """The SSE answer; it starts with its first event (see the module docstring). How it ended
    goes into `facts` (the request's log line)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    text = ""
    tokens: list[common_pb2.TokenInfo] = []

    async def send(event: dict[str, Any]) -> None:
        if not response.prepared:
            await response.prepare(request)
        await response.write(sse(event))

    try:
        try:
            async for result in recognition.results():
                if result.is_final and (said := result.text.strip()):
                    delta = f" {said}" if text else said
                    text += delta
                    event: dict[str, Any] = {"type": "transcript.text.delta", "delta": delta}
                    if with_logprobs:
                        event["logprobs"] = logprobs(list(result.tokens))
                        tokens.extend(result.tokens)
                    await send(event)
            done: dict[str, Any] = {"type": "transcript.text.done", "text": text}
            if with_logprobs:
                done["logprobs"] = logprobs(tokens)
            await send(done)
        except OpenAIError as exc:
            if not response.prepared:
                raise
            facts["error"] = f"after the stream started: {exc.status} {exc.message[:200]}"
            await send({"type": "error", "error": exc.body()["error"]})
        await response.write_eof()
    except (ConnectionError, ClientGone):  # the client went away: nothing to answer
        facts["error"] = "the client went away"
    facts["deltas_chars"] = len(text)
    return response


# ---- the handler ------------------------------------------------------------------------------------
async def create_transcription(request: web.Request, front: OpenAIFront) -> web.StreamResponse:
    started = time.perf_counter()
    facts: dict[str, Any] = {"model": None, "response_format": None, "stream": None, "bytes": 0, "audio_s": 0.0}
    upload: Upload | None = None
    decoder: PcmDecoder | None = None
    try:
        upload = await read_upload(request, front.config.max_upload_bytes)
        facts["bytes"] = upload.file_bytes
        options = check_options(upload, await front.transcription_models(request))
        facts.update(model=options.model, response_format=options.response_format, stream=options.stream)
        await check_language(front, request, options.language)
        decoder, first = await open_audio(upload)
        facts["codec"] = decoder.codec
        recognition = Recognition(front, request, decoder, first, options.prompt, options.language)
        if options.stream:
            response = await stream_events(request, recognition, facts, options.logprobs)
        else:
            finals = [r async for r in recognition.results() if r.is_final]
            duration = decoder.seconds
            facts["utterances"] = sum(1 for r in finals if r.text.strip())
            utterances = [utterance(r, duration) for r in finals]
            name = "english"
            if options.response_format == "verbose_json":
                name = await asyncio.to_thread(language_name, spoken_language(utterances))
            response = render(options, utterances, duration, name)
        facts["status"] = 200
        return response
    except OpenAIError as exc:
        facts["status"] = exc.status
        facts["error"] = exc.message[:200]
        raise
    except ClientGone:
        facts["status"] = 499  # nginx's "client closed request": nothing is sent
        return web.Response(status=499)
    finally:
        if decoder is not None:
            facts["audio_s"] = round(decoder.seconds, 3)
            facts["decode_problem"] = decoder.problem
            decoder.close()
        if upload is not None:
            upload.close()
        facts["wall_ms"] = round((time.perf_counter() - started) * 1000)
        log.info("openai transcription", extra=facts)


async def open_audio(upload: Upload) -> tuple[PcmDecoder, bytes]:
    """The decoder of the upload and its first piece of PCM; a file that does not decode is a 400."""
    assert upload.file is not None
    upload.file.seek(0)
    try:
        decoder = await blocking(PcmDecoder, upload.file)
    except AudioDecodeError as exc:
        raise OpenAIError(400, str(exc), param="file", code="invalid_file") from None
    try:
        first = await blocking(decoder.read, PIECE_BYTES)
    except AudioDecodeError as exc:
        decoder.close()
        raise OpenAIError(400, str(exc), param="file", code="invalid_file") from None
    except BaseException:
        decoder.close()
        raise
    return decoder, first
