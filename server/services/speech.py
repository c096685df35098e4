"""SpeechService: ListVoices, streaming Synthesize, streaming Transcribe and DescribeRecognizer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable

import grpc
import numpy as np
from rtmedia.engines.asr.contract import AsrEvent, AsrItem
from rtmedia.engines.audio.resample import (
    float_to_pcm16,
    make_resampler,
)
from rtmedia.engines.base import EngineError
from rtmedia.engines.tts.piper import MAX_SPEED, MIN_SPEED, unsupported_rate_message
from rtmedia.engines.tts.text_chunks import is_speakable
from rtmedia.protocol.errors import abort, shown
from rtmedia.protocol.wav import wav_stream_header
from rtmedia.server.hearing.audio_input import DECODERS
from rtmedia.server.hearing.recognition import MAX_PROMPT_CHARS, Turn, token_infos
from rtmedia.server.hearing.vad_recognition import VadRecognition
from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.lanes.clauses import Clauses
from rtmedia.server.lanes.faults import abort_fault
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.server.services.riva_common import Rejected
from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
READ_AHEAD_REQUESTS = 256  # Transcribe requests read ahead of the recogniser (then grpc's flow control holds the client)
ASR_RATE = 16000
TRANSCRIBE_RATES = {
    common_pb2.AUDIO_ENCODING_PCM16: (8000, 16000, 24000, 48000),
    common_pb2.AUDIO_ENCODING_G711_ULAW: (8000,),
    common_pb2.AUDIO_ENCODING_G711_ALAW: (8000,),
}


def unknown_voice(name: str, voices: Iterable[str]) -> str:
    """The message for a voice name no voice has (the name shown cut short: clients choose it)."""
    return f"voice {shown(name)} is not known; voices: {', '.join(sorted(voices))}"


def text_problem(text: str, max_chars: int, complete: bool = True) -> tuple[str, str] | None:
    """Why a text to synthesise is refused, as (ErrorInfo reason, message), or None. With
    `complete` false (a streaming client's text, still growing) only its length is checked."""
    if complete and not text.strip():
        return "EMPTY_TEXT", "text is empty"
    if len(text) > max_chars:
        return "TEXT_TOO_LONG", f"text has {len(text)} characters; the limit is {max_chars}"
    if complete and not is_speakable(text):
        return "NOTHING_TO_SPEAK", "text has no letters or digits to speak"
    return None


class SpeechService(speech_pb2_grpc.SpeechServiceServicer):
    def __init__(self, access: EngineAccess, max_text_chars: int = 5000) -> None:
        self.access = access
        self.tts = access.tts
        self.asr = access.asr
        self.max_text_chars = max_text_chars
        self.metrics = access.metrics

    async def ListVoices(self, request, context):
        voices = [
            speech_pb2.Voice(
                name=v.name,
                language=v.language,
                native_sample_rate=v.native_rate,
                supported_sample_rates=v.supported_rates,
                engine="piper",
            )
            for v in self.tts.voices.values()
        ]
        return speech_pb2.ListVoicesResponse(voices=voices, max_text_chars=self.max_text_chars)

    async def DescribeRecognizer(self, request, context):
        described = self.asr.describe
        return speech_pb2.DescribeRecognizerResponse(
            name=described["model"], languages=described["languages"], runtime=described["runtime"],
            compute_type=described["compute_type"], multilingual=described["multilingual"])

    async def Synthesize(self, request, context) -> AsyncIterator[speech_pb2.SynthesizeResponse]:
        started = time.perf_counter()
        if (problem := text_problem(request.text, self.max_text_chars)) is not None:
            await abort(context, INVALID, *problem)
        text = request.text.strip()
        if request.framing not in speech_pb2.AudioFraming.values():
            await abort(context, INVALID, "BAD_FRAMING", f"framing={request.framing} is not an AudioFraming value")
        try:
            voice = self.tts.voice(request.voice)
        except KeyError:
            await abort(context, INVALID, "UNKNOWN_VOICE", unknown_voice(request.voice, self.tts.voices),
                        voice=request.voice)
        if request.sample_rate < 0 or (request.sample_rate and request.sample_rate not in voice.supported_rates):
            await abort(context, INVALID, "UNSUPPORTED_SAMPLE_RATE",
                        unsupported_rate_message(request.sample_rate, voice))
        speed = request.speed or 1.0
        if not MIN_SPEED <= speed <= MAX_SPEED:  # NaN fails too
            await abort(context, INVALID, "BAD_SPEED", f"speed={request.speed:g} is out of range: "
                        f"{MIN_SPEED:g} to {MAX_SPEED:g} (0 means 1.0)")
        stream = self.tts.open(voice.name, request.sample_rate, speed=speed)
        wav = request.framing == speech_pb2.AUDIO_FRAMING_WAV
        # The next clause is synthesised while this one is sent, and no further ahead: the client's
        # reading paces the synthesis.
        clauses = Clauses(stream, self.tts.synthesize, ahead=1)
        clauses.whole(text)
        index = samples_sent = 0
        try:
            async for clause in clauses:
                audio = clause.audio
                if not audio:  # resampled to nothing: skipped, nothing to frame
                    continue
                offset_ms = samples_sent * 1000 // stream.output_rate
                samples_sent += len(audio) // 2
                if wav and index == 0:
                    audio = wav_stream_header(stream.output_rate, 1) + audio
                if index == 0:
                    self.metrics.tts_first_audio_seconds.observe(time.perf_counter() - started)
                self.metrics.bytes_total.labels("out").inc(len(audio))
                yield speech_pb2.SynthesizeResponse(
                    audio=audio, sample_rate=stream.output_rate, channels=1, chunk_index=index,
                    text=clause.text, audio_offset_ms=offset_ms, is_final=clause.final,
                )
                index += 1
        except EngineError as exc:  # an engine fault, never the client's (server/lanes/faults.py)
            await abort_fault(context, exc, "synthesis failed")
        finally:
            clauses.cancel()

    async def Transcribe(self, request_iterator, context) -> AsyncIterator[speech_pb2.TranscribeResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            await abort(context, INVALID, "EMPTY_STREAM", "the stream ended before its first request (the config)")
        if first.WhichOneof("request") != "config":
            await abort(context, INVALID, "CONFIG_FIRST", "the first TranscribeRequest must carry config")
        decode, resampler, partials, language = await self._transcribe_setup(first.config, context)
        if first.config.vad_segmentation or not self.asr.finds_utterances:
            async for response in self._transcribe_by_vad(first.config, partials, language, request_iterator,
                                                          context):
                yield response
            return
        try:
            stream = self.asr.open(language=language)
        except EngineError as exc:  # no recogniser worker is up
            await abort_fault(context, exc, "transcription failed")
        # What the client sent while the last piece was being recognised goes to the recogniser as
        # one piece: a client of many small requests costs a lane round trip per piece, not per request.
        queue: asyncio.Queue[speech_pb2.TranscribeRequest | None] = asyncio.Queue(READ_AHEAD_REQUESTS)
        reader = asyncio.create_task(_read_into(request_iterator, queue), name="transcribe-reader")
        try:
            chunk_no, ended = 0, False
            while not ended:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                pieces = []
                for request in batch:
                    if request is None:  # the stream's end, or how it failed (raised here, as before)
                        ended = True
                        await reader
                        break
                    chunk_no += 1
                    if request.WhichOneof("request") != "audio":
                        await abort(context, INVALID, "CONFIG_TWICE",
                                    f"request {chunk_no} carries config again; only the first request may")
                    self.metrics.bytes_total.labels("in").inc(len(request.audio))
                    try:
                        pieces.append(resampler.process(decode(request.audio)))
                    except ValueError as exc:
                        await abort(context, INVALID, "BAD_AUDIO", f"audio in request {chunk_no}: {exc}")
                samples = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
                if len(samples):
                    for event in await self._asr(stream, float_to_pcm16(samples), False, context):
                        if event.is_final or partials:
                            yield _transcript(event)
            tail = float_to_pcm16(resampler.flush())
            for event in await self._asr(stream, tail, True, context):
                if event.is_final or partials:
                    yield _transcript(event)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            await self.asr.close(stream)

    async def _transcribe_by_vad(self, config, partials: bool, language: str, requests,
                                 context) -> AsyncIterator[speech_pb2.TranscribeResponse]:
        """Transcribe with `vad_segmentation`: the VAD cuts the utterances (server/hearing/vad_recognition.py);
        results are in the input's time."""
        def convert(event: AsrEvent, turn: Turn) -> speech_pb2.TranscribeResponse | None:
            return _transcript(event, turn.shift_ms) if event.is_final or partials else None

        fmt = config.audio_format
        # A recording comes faster than real time: its utterances are decoded side by side.
        recognition = VadRecognition(self.access, fmt.encoding or common_pb2.AUDIO_ENCODING_PCM16,
                                     fmt.sample_rate or 24000, convert, priority=Priority.INTERACTIVE,
                                     name="transcribe-vad", parallel=self.access.asr.workers, partials=partials,
                                     prompt=config.prompt, language=language)
        reader = asyncio.create_task(self._feed(recognition, requests), name="transcribe-vad-reader")
        try:
            while (result := await recognition.results.get()) is not None:
                if isinstance(result, Rejected):
                    await abort(context, result.code, result.reason, result.message)
                yield result
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await recognition.close()

    async def _feed(self, recognition: VadRecognition, requests) -> None:
        chunk_no = 0
        try:
            async for request in requests:
                chunk_no += 1
                if request.WhichOneof("request") != "audio":
                    raise Rejected(INVALID, "CONFIG_TWICE", f"request {chunk_no} carries config again; only the "
                                   "first request may")
                self.metrics.bytes_total.labels("in").inc(len(request.audio))
                try:
                    await recognition.feed(request.audio)
                except Rejected as exc:
                    raise Rejected(exc.code, exc.reason, f"audio in request {chunk_no}: {exc.message}") from None
            await recognition.finish()
        except Rejected as exc:
            recognition.fail(exc)

    async def _asr(self, stream, pcm: bytes, end: bool, context) -> list[AsrEvent]:
        try:
            return await self.asr.recognize(AsrItem(stream, pcm, end))
        except EngineError as exc:  # an engine fault, never the client's (server/lanes/faults.py)
            await abort_fault(context, exc, "transcription failed")

    async def _transcribe_setup(self, config, context):
        fmt = config.audio_format
        encoding = fmt.encoding or common_pb2.AUDIO_ENCODING_PCM16
        rate = fmt.sample_rate or 24000
        if encoding not in TRANSCRIBE_RATES:
            await abort(context, INVALID, "BAD_ENCODING", f"audio_format.encoding={fmt.encoding} is not supported")
        if rate not in TRANSCRIBE_RATES[encoding]:
            allowed = ", ".join(map(str, TRANSCRIBE_RATES[encoding]))
            await abort(context, INVALID, "BAD_SAMPLE_RATE",
                        f"audio_format.sample_rate={fmt.sample_rate} is not supported for "
                        f"{common_pb2.AudioEncoding.Name(encoding)}; supported: {allowed}")
        if fmt.channels not in (0, 1):
            await abort(context, INVALID, "BAD_CHANNELS", f"audio_format.channels={fmt.channels}: only mono is accepted")
        if len(config.prompt) > MAX_PROMPT_CHARS:
            await abort(context, INVALID, "PROMPT_TOO_LONG",
                        f"prompt has {len(config.prompt)} characters; at most {MAX_PROMPT_CHARS}")
        try:
            language = self.asr.language(config.language)
        except ValueError as exc:
            await abort(context, INVALID, "BAD_LANGUAGE", str(exc), language=config.language)
        return DECODERS[encoding], make_resampler(rate, ASR_RATE), not config.disable_partial_results, language


def _transcript(event: AsrEvent, shift_ms: int = 0) -> speech_pb2.TranscribeResponse:
    """A recogniser's result; `shift_ms` moves its offsets from the recogniser's time to the input's."""
    return speech_pb2.TranscribeResponse(
        utterance_index=event.utterance_index, is_final=event.is_final, text=event.text, delta=event.delta,
        start_ms=event.start_ms + shift_ms, end_ms=event.end_ms + shift_ms,
        words=[common_pb2.WordInfo(word=w, start_ms=s + shift_ms, end_ms=e + shift_ms, confidence=c)
               for w, s, e, c in event.words],
        tokens=token_infos(event.tokens), no_speech_prob=event.no_speech_prob, language=event.language,
    )


async def _read_into(requests, queue: asyncio.Queue) -> None:
    """A stream's requests into `queue`, then None (also when the stream fails: the call then ends)."""
    try:
        async for request in requests:
            await queue.put(request)
    finally:
        await queue.put(None)
