"""NVIDIA Riva's `nvidia.riva.asr.RivaSpeechRecognition` on rtmedia's engines.

A recognition (streaming or offline) is the duplex sessions' input path: its
audio goes through an `AudioInput` on the shared VAD tick lane (decode,
resample to 16 kHz, batched Silero VAD), whose turn detector is a
`HistoryEndpointer` following the request's `EndpointingConfig`
(server/endpointing.py gives the mapping). Each utterance it finds is decoded
on the ASR lane (PocketSphinx worker processes, one utterance per turn) by the
`Recognizer` the duplex sessions use too (server/recognition.py): its partials
become interim results, its final a final result with word offsets in the
stream's time.

Options rtmedia does not serve are rejected with a status naming them
(`RecognitionOptions.from_config`); one alternative is returned whatever
`max_alternatives` allows; transcripts are always in spoken form
(`verbatim_transcripts` false is accepted, as it is the proto default:
PocketSphinx has no inverse text normalisation); `enable_automatic_punctuation`
gives each final transcript sentence case and a closing period.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc, riva_audio_pb2
from rtmedia.engines.asr import AsrEvent
from rtmedia.protocol.errors import shown
from rtmedia.server.audio_input import WINDOW_MS, Action, AudioInput
from rtmedia.server.endpointing import DEFAULTS, HistoryEndpointer, check_endpointing
from rtmedia.server.engine_access import EngineAccess
from rtmedia.server.interceptors import UndecodableRequest
from rtmedia.server.recognition import Recognizer, Turn
from rtmedia.server.riva_common import (
    INVALID,
    UNIMPLEMENTED,
    Rejected,
    abort_rejected,
    check_custom_configuration,
    check_language,
    listed,
)
from rtmedia.server.scheduler import Priority
from rtmedia.server.session_config import ALAW, PCM16, ULAW, SessionSettings

log = logging.getLogger(__name__)
MODEL = "pocketsphinx-en-US-asr-streaming"
RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
ENCODINGS = {  # Riva encoding -> (rtmedia encoding, sample rates it may have)
    riva_audio_pb2.ENCODING_UNSPECIFIED: (PCM16, RATES),
    riva_audio_pb2.LINEAR_PCM: (PCM16, RATES),
    riva_audio_pb2.MULAW: (ULAW, (8000,)),
    riva_audio_pb2.ALAW: (ALAW, (8000,)),
}
# Audio is taken in pieces of at most this much; a piece waits while the previous one is still
# queued for the VAD tick, so a client sending faster than real time is slowed by flow control
# (never dropped) and one tick decodes at most ~2 pieces of one stream.
PIECE_MS = 500
INTERIM_STABILITY = 0.9  # interim words are never retracted, but the final may still differ


@dataclass(frozen=True)
class RecognitionOptions:
    encoding: int  # rtmedia's AudioEncoding (the decoder)
    sample_rate: int
    word_offsets: bool
    punctuation: bool
    endpointing: dict[str, float]

    @classmethod
    def from_config(cls, config: riva_asr_pb2.RecognitionConfig, wav_rate: int = 0) -> RecognitionOptions:
        """The options of `config`, or Rejected naming the first one not served. `wav_rate`: the
        rate of a WAV header in the audio (Recognize), which stands in for `sample_rate_hertz`."""
        name = riva_audio_pb2.AudioEncoding.Name(config.encoding) \
            if config.encoding in riva_audio_pb2.AudioEncoding.values() else str(config.encoding)
        if config.encoding not in ENCODINGS:
            code = UNIMPLEMENTED if config.encoding in riva_audio_pb2.AudioEncoding.values() else INVALID
            raise Rejected(code, "UNSUPPORTED_ENCODING",
                           f"encoding={name} is not supported; supported: LINEAR_PCM, MULAW, ALAW")
        encoding, rates = ENCODINGS[config.encoding]
        rate = config.sample_rate_hertz or wav_rate
        if wav_rate and config.sample_rate_hertz not in (0, wav_rate):
            raise Rejected(INVALID, "BAD_SAMPLE_RATE", f"sample_rate_hertz={config.sample_rate_hertz} "
                           f"differs from the WAV header's {wav_rate} Hz")
        if rate not in rates:
            raise Rejected(INVALID, "BAD_SAMPLE_RATE", f"sample_rate_hertz={config.sample_rate_hertz} is not "
                           f"supported for {name}; supported: {', '.join(map(str, rates))}")
        check_language(config.language_code)
        if config.model not in ("", MODEL):
            raise Rejected(INVALID, "UNKNOWN_MODEL", f"model={shown(config.model)} is not served; models: {MODEL}")
        if config.max_alternatives < 0:
            raise Rejected(INVALID, "BAD_OPTION", f"max_alternatives={config.max_alternatives} is negative")
        if config.audio_channel_count not in (0, 1):
            raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION",
                           f"audio_channel_count={config.audio_channel_count}: only mono audio is recognised")
        unimplemented = {
            "profanity_filter": config.profanity_filter,
            "speech_contexts (word boosting)": len(config.speech_contexts),
            "enable_separate_recognition_per_channel": config.enable_separate_recognition_per_channel,
            "diarization_config.enable_speaker_diarization": config.diarization_config.enable_speaker_diarization,
        }
        for option, value in unimplemented.items():
            if value:
                raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION", f"{option} is not supported by rtmedia")
        check_custom_configuration(config.custom_configuration)
        return cls(encoding, rate, config.enable_word_time_offsets, config.enable_automatic_punctuation,
                   _endpointing(config))

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.encoding == PCM16 else 1


def _endpointing(config: riva_asr_pb2.RecognitionConfig) -> dict[str, float]:
    params: dict[str, float] = dict(DEFAULTS)
    if not config.HasField("endpointing_config"):
        return params
    ep = config.endpointing_config
    for eou in ("stop_history_eou", "stop_threshold_eou"):
        if ep.HasField(eou):
            raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION",
                           f"endpointing_config.{eou} is not supported (no first-pass end-of-utterance)")
    params.update({name: getattr(ep, name) for name in DEFAULTS if ep.HasField(name)})
    try:
        check_endpointing(**params)
    except ValueError as exc:
        raise Rejected(INVALID, "BAD_ENDPOINTING", str(exc)) from None
    return params


def parse_wav(audio: bytes) -> tuple[bytes, int]:
    """(samples, rate) of a PCM16 mono WAV file; Rejected says what else it is."""
    try:
        with wave.open(io.BytesIO(audio)) as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            samples = w.readframes(w.getnframes())
    except Exception as exc:  # the wave module raises whatever a malformed header provokes (RuntimeError, ...)
        raise Rejected(INVALID, "BAD_AUDIO", f"audio is not a readable WAV file: "
                                             f"{type(exc).__name__}: {exc}") from None
    if width != 2:
        raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_ENCODING", f"WAV audio has {8 * width}-bit samples; only 16-bit")
    if channels != 1:
        raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION", f"WAV audio has {channels} channels; only mono")
    return samples, rate


def punctuate(text: str) -> str:
    """Sentence case and a closing period: the utterance-level punctuation rtmedia offers."""
    return f"{text[0].upper()}{text[1:]}." if text else text


@dataclass
class Recognition:
    """One recognition: audio in (`feed`, `finish`), results out (`results`, None at the end)."""

    access: EngineAccess
    options: RecognitionOptions
    interim: bool
    priority: Priority = Priority.REALTIME
    results: asyncio.Queue[riva_asr_pb2.StreamingRecognitionResult | Rejected | None] = field(
        default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        endpointer = HistoryEndpointer(**self.options.endpointing)  # type: ignore[arg-type]
        settings = SessionSettings(
            input_encoding=self.options.encoding, input_rate=self.options.sample_rate, turn_type="server_vad",
            threshold=endpointer.threshold, prefix_padding_ms=endpointer.prefix_padding_ms,
            silence_duration_ms=endpointer.silence_duration_ms,
        )
        # Whole samples: at a rate such as 11025 Hz half a second is not (the VAD tick decodes the
        # inbox as samples).
        width = self.options.bytes_per_sample
        self.piece = self.options.sample_rate * PIECE_MS // 1000 * width
        self.input = AudioInput(settings, 4 * PIECE_MS, self._on_actions, self.access.vad.open(),
                                make_detector=lambda _settings: endpointer)
        self._turn: Turn | None = None  # the utterance being spoken
        self._asr_ms = 0  # audio sent to the recogniser
        self.recognizer = Recognizer(self.access.asr, priority=self.priority, on_event=self._on_event)
        self.access.vad.attach(self.input)
        self._task = self.recognizer.start("riva-recognition")
        self._task.add_done_callback(self._recognised)

    async def feed(self, audio: bytes) -> None:
        """Queue audio for the VAD tick, piece by piece, waiting while a piece is still queued."""
        if len(audio) % self.options.bytes_per_sample:
            raise Rejected(INVALID, "BAD_AUDIO", f"audio has {len(audio)} bytes: not whole 16-bit samples")
        for start in range(0, len(audio), self.piece):
            # the tick takes the inbox on its own 32 ms clock, with no event to wait on
            while len(self.input.inbox) >= self.piece:  # noqa: ASYNC110
                await asyncio.sleep(WINDOW_MS / 1000)
            self.input.append(audio[start:start + self.piece])

    async def finish(self) -> None:
        """The audio is complete: once the tick has taken all of it, end an open utterance."""
        taken = asyncio.get_running_loop().create_future()
        self.input.after_input(lambda: taken.set_result(None))
        await taken
        self._end()
        self.recognizer.stop()

    def fail(self, exc: Rejected) -> None:
        self.results.put_nowait(exc)

    async def close(self) -> None:
        self.access.vad.detach(self.input)
        await self.recognizer.close()

    # ---- VAD tick results (on the loop) ----------------------------------------
    def _on_actions(self, actions: list[Action]) -> None:
        for kind, value in actions:
            if kind == "audio":
                offset_ms, pcm = value
                if self._turn is None:  # the first audio of a turn: its start, prefix included
                    self._turn = Turn(input_offset_ms=offset_ms, asr_offset_ms=self._asr_ms)
                self._asr_ms += len(pcm) // 32
                self.recognizer.send("audio", self._turn, pcm)
            elif kind == "stopped":
                self._end()
            elif kind == "marker":
                value()

    def _end(self) -> None:
        """The utterance ended: the recogniser finishes it (nothing to do if it had no audio)."""
        turn, self._turn = self._turn, None
        if turn is not None:
            self.recognizer.send("end", turn)

    # ---- recognition ----------------------------------------------------------
    def _recognised(self, task: asyncio.Task[None]) -> None:
        """The recogniser's task ended: after the last result (None), or failed."""
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:  # an engine failure ends the call with a status
            log.error("riva recognition failed", exc_info=exc)
            self.fail(Rejected(grpc.StatusCode.INTERNAL, "ENGINE_FAILED", f"recognition failed: {exc}"))
        else:
            self.results.put_nowait(None)

    def _on_event(self, turn: Turn, event: AsrEvent) -> None:
        result = self._result(event, turn)
        if result is not None:
            self.results.put_nowait(result)

    def _result(self, event: AsrEvent, turn: Turn) -> riva_asr_pb2.StreamingRecognitionResult | None:
        if not event.text or not (event.is_final or self.interim):
            return None
        shift = turn.shift_ms
        alternative = riva_asr_pb2.SpeechRecognitionAlternative(transcript=event.text)
        if event.is_final:
            if self.options.punctuation:
                alternative.transcript = punctuate(event.text)
            if event.words:
                alternative.confidence = sum(w[3] for w in event.words) / len(event.words)
            if self.options.word_offsets:
                alternative.words.extend(
                    riva_asr_pb2.WordInfo(word=w, start_time=s + shift, end_time=e + shift, confidence=c)
                    for w, s, e, c in event.words
                )
        return riva_asr_pb2.StreamingRecognitionResult(
            alternatives=[alternative], is_final=event.is_final, channel_tag=1,
            stability=1.0 if event.is_final else INTERIM_STABILITY,
            audio_processed=(event.end_ms + shift) / 1000,
        )


class RivaAsrService(riva_asr_pb2_grpc.RivaSpeechRecognitionServicer):
    def __init__(self, access: EngineAccess) -> None:
        self.access = access
        self.bytes_in = access.metrics.bytes_total.labels("in")

    def _recognition(self, options: RecognitionOptions, interim: bool, priority: Priority) -> Recognition:
        return Recognition(self.access, options, interim, priority)

    async def GetRivaSpeechRecognitionConfig(self, request, context):
        configs = []
        if request.model_name in ("", MODEL):
            configs.append(riva_asr_pb2.RivaSpeechRecognitionConfigResponse.Config(model_name=MODEL, parameters={
                "type": "online", "streaming": "true", "offline": "true", "language_code": "en-US",
                "engine": "pocketsphinx", "endpointing": "silero-vad",
                "sample_rates": ",".join(map(str, RATES)), "encodings": "LINEAR_PCM,MULAW,ALAW",
                "verbatim_transcripts": "always", "automatic_punctuation": "sentence case and final period",
                "max_alternatives": "1", "word_time_offsets": "true",
                **{f"endpointing.{k}": f"{v:g}" for k, v in DEFAULTS.items()},
            }))
        return riva_asr_pb2.RivaSpeechRecognitionConfigResponse(model_config=configs)

    async def Recognize(self, request, context):
        audio, wav_rate = request.audio, 0
        try:
            if audio[:4] == b"RIFF" and audio[8:12] == b"WAVE":
                audio, wav_rate = parse_wav(audio)
            options = RecognitionOptions.from_config(request.config, wav_rate)
        except Rejected as exc:
            await abort_rejected(context, exc)
        self.bytes_in.inc(len(request.audio))
        recognition = self._recognition(options, interim=False, priority=Priority.INTERACTIVE)
        try:
            await recognition.feed(audio)
            await recognition.finish()
            results = []
            while (result := await recognition.results.get()) is not None:
                if isinstance(result, Rejected):  # the recogniser failed
                    raise result
                results.append(riva_asr_pb2.SpeechRecognitionResult(
                    alternatives=result.alternatives, channel_tag=1, audio_processed=result.audio_processed))
        except Rejected as exc:
            await abort_rejected(context, exc)
        finally:
            await recognition.close()
        return riva_asr_pb2.RecognizeResponse(results=results, id=request.id)

    async def StreamingRecognize(self, request_iterator, context) -> None:
        first = await anext(aiter(request_iterator), None)
        try:
            if first is None or first.WhichOneof("streaming_request") != "streaming_config":
                raise Rejected(INVALID, "CONFIG_FIRST", "the first StreamingRecognizeRequest must carry "
                               "streaming_config")
            _check_runtime_config(first, 0)
            options = RecognitionOptions.from_config(first.streaming_config.config)
        except Rejected as exc:
            await abort_rejected(context, exc)
        recognition = self._recognition(options, first.streaming_config.interim_results, Priority.REALTIME)
        reader = asyncio.create_task(self._read(recognition, request_iterator), name="riva-asr-reader")
        try:
            while (result := await recognition.results.get()) is not None:
                if isinstance(result, Rejected):
                    await abort_rejected(context, result)
                await context.write(riva_asr_pb2.StreamingRecognizeResponse(results=[result], id=first.id))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await recognition.close()

    async def _read(self, recognition: Recognition, requests: AsyncIterator) -> None:
        number = 0
        try:
            async for request in requests:
                number += 1
                _check_runtime_config(request, number)
                if request.WhichOneof("streaming_request") == "streaming_config":
                    raise Rejected(INVALID, "CONFIG_TWICE",
                                   f"request {number} carries streaming_config again; only the first may")
                self.bytes_in.inc(len(request.audio_content))
                await recognition.feed(request.audio_content)
            await recognition.finish()
        except Rejected as exc:
            recognition.fail(exc)
        except UndecodableRequest:
            raise  # the interceptor ends the call (INVALID_ARGUMENT)
        except Exception:
            log.exception("riva recognition: reading requests failed")
            recognition.fail(Rejected(grpc.StatusCode.INTERNAL, "REQUEST_READ_FAILED",
                                      f"reading request {number + 1} failed"))


def _check_runtime_config(request: riva_asr_pb2.StreamingRecognizeRequest, number: int) -> None:
    if request.runtime_config:
        keys = listed(sorted(request.runtime_config))
        raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION",
                       f"runtime_config (request {number}: {keys}) is not supported by rtmedia")
