"""NVIDIA Riva's `nvidia.riva.asr.RivaSpeechRecognition` on rtmedia's engines.

A recognition (streaming or offline) is a `VadRecognition` (server/hearing/vad_recognition.py: the
duplex sessions' input path, the VAD finding utterances) whose `HistoryEndpointer` follows the
request's `EndpointingConfig` (server/hearing/endpointing.py gives the mapping): its partials become
interim results, its finals final results with word offsets in the stream's time.

Options rtmedia does not serve are rejected with a status naming them
(`RecognitionOptions.from_config`); one alternative is returned whatever
`max_alternatives` allows; transcripts are always in spoken form
(`verbatim_transcripts` false is accepted, as it is the proto default); with
`enable_automatic_punctuation` a final transcript has the recogniser's casing and punctuation
(Whisper's own; sentence case and a closing period where the recogniser gives none), without
it lowercase words without punctuation, as Riva gives them. The one model is named after
the server's recogniser (`riva_model`). `language_code` is checked against the recogniser's
languages (`Asr.language`: "en-US" on an English-only one; "fr-FR", "fr", ... on a multilingual
one, whose empty `language_code` detects each utterance's) and goes to the recognition; a
final's alternative carries its language (`language_code`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc, riva_audio_pb2
from rtmedia.engines.asr.contract import ENGLISH, AsrEvent, language_code, normal_words
from rtmedia.protocol.errors import shown
from rtmedia.server.hearing.endpointing import DEFAULTS, check_endpointing
from rtmedia.server.hearing.recognition import MAX_PROMPT_CHARS, Turn
from rtmedia.server.hearing.vad_recognition import VadRecognition
from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.server.security.interceptors import UndecodableRequest
from rtmedia.server.services.riva_common import (
    INVALID,
    UNIMPLEMENTED,
    Rejected,
    abort_rejected,
    check_custom_configuration,
    listed,
)
from rtmedia.server.session.config import ALAW, PCM16, ULAW

log = logging.getLogger(__name__)
RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
ENCODINGS = {  # Riva encoding -> (rtmedia encoding, sample rates it may have)
    riva_audio_pb2.ENCODING_UNSPECIFIED: (PCM16, RATES),
    riva_audio_pb2.LINEAR_PCM: (PCM16, RATES),
    riva_audio_pb2.MULAW: (ULAW, (8000,)),
    riva_audio_pb2.ALAW: (ALAW, (8000,)),
}
INTERIM_STABILITY = 0.9  # interim words are never retracted, but the final may still differ


@dataclass(frozen=True)
class RecognitionOptions:
    encoding: int  # rtmedia's AudioEncoding (the decoder)
    sample_rate: int
    word_offsets: bool
    punctuation: bool
    endpointing: dict[str, float]
    prompt: str = ""  # the speech contexts' phrases, as the recogniser's previous-text prompt
    language: str = ""  # the ISO 639-1 code of language_code ("" detects each utterance's)
    language_code: str = ""  # as the request named it

    @classmethod
    def from_config(cls, config: riva_asr_pb2.RecognitionConfig, model: str, wav_rate: int = 0,
                    prompted: bool = True, languages: tuple[str, ...] = ENGLISH) -> RecognitionOptions:
        """The options of `config`, or Rejected naming the first one not served. `wav_rate`: the
        rate of a WAV header in the audio (Recognize), which stands in for `sample_rate_hertz`;
        `prompted`: whether the recogniser takes a prompt (speech contexts are refused if not);
        `languages`: the recogniser's (ISO 639-1)."""
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
        try:
            language = language_code(config.language_code, languages, "language_code")
        except ValueError as exc:
            raise Rejected(INVALID, "UNSUPPORTED_LANGUAGE", str(exc)) from None
        if config.model not in ("", model):
            raise Rejected(INVALID, "UNKNOWN_MODEL", f"model={shown(config.model)} is not served; models: {model}")
        if config.max_alternatives < 0:
            raise Rejected(INVALID, "BAD_OPTION", f"max_alternatives={config.max_alternatives} is negative")
        if config.audio_channel_count not in (0, 1):
            raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION",
                           f"audio_channel_count={config.audio_channel_count}: only mono audio is recognised")
        unimplemented = {
            "profanity_filter": config.profanity_filter,
            "speech_contexts (word boosting) with this recogniser": not prompted and len(config.speech_contexts),
            "enable_separate_recognition_per_channel": config.enable_separate_recognition_per_channel,
            "diarization_config.enable_speaker_diarization": config.diarization_config.enable_speaker_diarization,
        }
        for option, value in unimplemented.items():
            if value:
                raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION", f"{option} is not supported by rtmedia")
        check_custom_configuration(config.custom_configuration)
        return cls(encoding, rate, config.enable_word_time_offsets, config.enable_automatic_punctuation,
                   _endpointing(config), _context_prompt(config.speech_contexts), language, config.language_code)


def _context_prompt(contexts: Any) -> str:
    """Speech contexts as Whisper's previous-text prompt: their phrases, comma-separated. Whisper
    has no per-word weights: any positive boost puts a phrase in the prompt; a negative one
    (keeping a word out) cannot be served."""
    phrases = []
    for n, context in enumerate(contexts):
        if context.boost < 0:
            raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION", f"speech_contexts[{n}].boost={context.boost:g}: "
                           "negative boosting (keeping words out) is not supported by rtmedia")
        phrases += [p.strip() for p in context.phrases if p.strip()]
    prompt = ", ".join(phrases)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise Rejected(INVALID, "PROMPT_TOO_LONG", f"speech_contexts hold {len(prompt)} characters of phrases; "
                       f"at most {MAX_PROMPT_CHARS}")
    return prompt


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


def riva_model(recogniser: str, languages: tuple[str, ...] = ENGLISH) -> str:
    """The Riva model name of the server's recogniser, e.g. whisper-tiny-en-US-asr-streaming
    (English-only), whisper-small-multi-asr-streaming (multilingual)."""
    return f"{recogniser}-{'en-US' if tuple(languages) == ENGLISH else 'multi'}-asr-streaming"


def result_language(options: RecognitionOptions, event: AsrEvent) -> list[str]:
    """A final's language for its alternative's `language_code`: the request's tag or code where
    it is that language's ("fr-FR", "fr"), else the recogniser's ISO 639-1 code ("fr": detected,
    or asked for by name); none when unknown."""
    if not event.language:
        return []
    asked = options.language_code.strip()
    tagged = asked.lower().replace("_", "-").split("-")[0] == event.language
    return [asked if tagged else event.language]


def punctuate(text: str) -> str:
    """The text as punctuated as the recogniser made it, else sentence case and a closing period."""
    if not text or text.rstrip("\"')").endswith((".", "?", "!")):
        return text
    return f"{text[0].upper()}{text[1:]}."


def plain(text: str) -> str:
    """Lowercase words without punctuation: a transcript without automatic punctuation."""
    return " ".join(normal_words(text))


def riva_result(options: RecognitionOptions, interim: bool, event: AsrEvent, turn: Turn
                ) -> riva_asr_pb2.StreamingRecognitionResult | None:
    """A recogniser's partial or final as Riva's result (None: not sent)."""
    if not event.text or not (event.is_final or interim):
        return None
    shift = turn.shift_ms
    alternative = riva_asr_pb2.SpeechRecognitionAlternative(
        transcript=event.text if options.punctuation else plain(event.text))
    if event.is_final:
        alternative.language_code.extend(result_language(options, event))
        if options.punctuation:
            alternative.transcript = punctuate(event.text)
        if event.words:
            alternative.confidence = sum(w[3] for w in event.words) / len(event.words)
        if options.word_offsets:
            alternative.words.extend(
                riva_asr_pb2.WordInfo(word=w if options.punctuation else plain(w), start_time=s + shift,
                                      end_time=e + shift, confidence=c)
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

    @property
    def model(self) -> str:
        """The one model's name (the recogniser is loaded once the server serves)."""
        return riva_model(self.access.asr.model, self.access.asr.languages)

    def _options(self, config: riva_asr_pb2.RecognitionConfig, wav_rate: int = 0) -> RecognitionOptions:
        asr = self.access.asr
        return RecognitionOptions.from_config(config, self.model, wav_rate, asr.takes_prompt, asr.languages)

    def _recognition(self, options: RecognitionOptions, interim: bool, priority: Priority) -> VadRecognition:
        return VadRecognition(self.access, options.encoding, options.sample_rate,
                              functools.partial(riva_result, options, interim), options.endpointing, priority,
                              "riva-recognition", partials=interim, prompt=options.prompt, language=options.language)

    async def GetRivaSpeechRecognitionConfig(self, request, context):
        configs = []
        model, languages = self.model, self.access.asr.languages
        if request.model_name in ("", model):
            # Riva's one language_code for an English-only model; a multilingual one's every code
            served = "en-US" if languages == ENGLISH else ",".join(languages)
            configs.append(riva_asr_pb2.RivaSpeechRecognitionConfigResponse.Config(model_name=model, parameters={
                "type": "online", "streaming": "true", "offline": "true", "language_code": served,
                "languages": ",".join(languages),
                "language_detection": "true" if languages != ENGLISH else "false",
                "engine": self.access.asr.model, "endpointing": "silero-vad",
                "sample_rates": ",".join(map(str, RATES)), "encodings": "LINEAR_PCM,MULAW,ALAW",
                "verbatim_transcripts": "always", "automatic_punctuation": "the recogniser's, else sentence case and a final period",
                "max_alternatives": "1", "word_time_offsets": "true",
                **{f"endpointing.{k}": f"{v:g}" for k, v in DEFAULTS.items()},
            }))
        return riva_asr_pb2.RivaSpeechRecognitionConfigResponse(model_config=configs)

    async def Recognize(self, request, context):
        audio, wav_rate = request.audio, 0
        try:
            if audio[:4] == b"RIFF" and audio[8:12] == b"WAVE":
                audio, wav_rate = parse_wav(audio)
            options = self._options(request.config, wav_rate)
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
            options = self._options(first.streaming_config.config)
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

    async def _read(self, recognition: VadRecognition, requests: AsyncIterator) -> None:
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
