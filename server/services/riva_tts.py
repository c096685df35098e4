"""NVIDIA Riva's `nvidia.riva.tts.RivaSpeechSynthesis` on rtmedia's TTS lane (Piper voices).

`Synthesize` splits the text into clauses by the streaming rule (docs/protocol.md#streaming-tts),
has them synthesised on the TTS lane one after another (`server/lanes/clauses.py`: a stream's
items are stepped in order, its resampler state runs from clause to clause) and returns the
joined audio.
`SynthesizeOnline` is a bidirectional stream: each request's text is appended
as it comes (append-only deltas, as from a language model, so whitespace
between requests is the client's), cut into clauses as soon as they are
complete (the same `Clauses`), and each clause's audio is sent as it is
synthesised.

Audio is LINEAR_PCM (PCM16 mono, no header) at `sample_rate_hz` (0: the
voice's native rate), resampled by the voice's streaming resampler. Voice
names are rtmedia's (`GetRivaSynthesisConfig`, `rtmedia voices`); an empty one
is the default voice. Options rtmedia does not serve are rejected by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from riva.client.proto import riva_audio_pb2, riva_tts_pb2, riva_tts_pb2_grpc
from rtmedia.engines.tts.piper import TtsStream, unsupported_rate_message
from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.lanes.clauses import Clauses
from rtmedia.server.services.riva_common import (
    INVALID,
    UNIMPLEMENTED,
    Rejected,
    abort_rejected,
    check_custom_configuration,
    check_language,
)
from rtmedia.server.services.speech import text_problem, unknown_voice

ENCODINGS = (riva_audio_pb2.ENCODING_UNSPECIFIED, riva_audio_pb2.LINEAR_PCM)


class RivaTtsService(riva_tts_pb2_grpc.RivaSpeechSynthesisServicer):
    def __init__(self, access: EngineAccess, max_text_chars: int = 5000) -> None:
        self.tts = access.tts
        self.max_text_chars = max_text_chars
        self.metrics = access.metrics

    async def GetRivaSynthesisConfig(self, request, context):
        configs = [
            riva_tts_pb2.RivaSynthesisConfigResponse.Config(model_name=voice.name, parameters={
                "type": "online", "engine": "piper", "language_code": voice.language, "voice_name": voice.name,
                "sample_rate": str(voice.native_rate),
                "supported_sample_rates": ",".join(map(str, voice.supported_rates)),
                "encodings": "LINEAR_PCM", "default": str(voice.name == self.tts.default_voice).lower(),
            })
            for voice in self.tts.voices.values() if request.model_name in ("", voice.name)
        ]
        return riva_tts_pb2.RivaSynthesisConfigResponse(model_config=configs)

    async def Synthesize(self, request, context):
        started = time.perf_counter()
        try:
            stream = self._open(request)
            self._check_text(request.text, complete=True)
        except Rejected as exc:
            await abort_rejected(context, exc)
        clauses = Clauses(stream, self.tts.synthesize)
        chunks = clauses.whole(request.text.strip())
        try:
            audio = b"".join([clause.audio async for clause in clauses])
        finally:
            clauses.cancel()
        self.metrics.tts_first_audio_seconds.observe(time.perf_counter() - started)
        self.metrics.bytes_total.labels("out").inc(len(audio))
        meta = riva_tts_pb2.SynthesizeSpeechResponseMetadata(text=request.text, processed_text=" ".join(chunks))
        return riva_tts_pb2.SynthesizeSpeechResponse(audio=audio, meta=meta, id=request.id)

    async def SynthesizeOnline(self, request_iterator, context) -> None:
        started = time.perf_counter()
        first = await anext(aiter(request_iterator), None)
        try:
            if first is None:
                raise Rejected(INVALID, "EMPTY_STREAM", "the stream ended before its first request")
            stream = self._open(first)
        except Rejected as exc:
            await abort_rejected(context, exc)
        clauses = Clauses(stream, self.tts.synthesize)
        reader = asyncio.create_task(self._read_text(first, request_iterator, clauses), name="riva-tts-reader")
        sent = 0
        try:
            async for clause in clauses:
                if not clause.audio:
                    continue
                if not sent:
                    self.metrics.tts_first_audio_seconds.observe(time.perf_counter() - started)
                sent += len(clause.audio)
                self.metrics.bytes_total.labels("out").inc(len(clause.audio))
                meta = riva_tts_pb2.SynthesizeSpeechResponseMetadata(text=clause.text, processed_text=clause.text)
                await context.write(riva_tts_pb2.SynthesizeSpeechResponse(audio=clause.audio, meta=meta, id=first.id))
        except Rejected as exc:
            await abort_rejected(context, exc)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            clauses.cancel()

    async def _read_text(self, first: riva_tts_pb2.SynthesizeSpeechRequest, requests: AsyncIterator,
                         clauses: Clauses) -> None:
        """Feed the requests' text to `clauses` as it arrives (each clause is queued once complete);
        a Rejected request ends them with its error."""
        text, number = first.text, 0
        try:
            self._check_text(text, complete=False)
            clauses.feed(text)
            settings = _settings(first)
            async for request in requests:
                number += 1
                if _settings(request) != settings:
                    raise Rejected(INVALID, "SETTINGS_CHANGED", f"request {number} changes the synthesis settings; "
                                   "only text may differ after the first request")
                text += request.text
                self._check_text(text, complete=False)
                clauses.feed(request.text)
            self._check_text(text, complete=True)
            clauses.end()
        except Rejected as exc:
            clauses.end(exc)

    def _open(self, request: riva_tts_pb2.SynthesizeSpeechRequest) -> TtsStream:
        """A TTS stream for the request's voice and rate, or Rejected naming the option not served."""
        if request.encoding not in ENCODINGS:
            known = request.encoding in riva_audio_pb2.AudioEncoding.values()
            name = riva_audio_pb2.AudioEncoding.Name(request.encoding) if known else str(request.encoding)
            raise Rejected(UNIMPLEMENTED if known else INVALID, "UNSUPPORTED_ENCODING",
                           f"encoding={name} is not supported for synthesis; supported: LINEAR_PCM")
        check_language(request.language_code)
        try:
            voice = self.tts.voice(request.voice_name)
        except KeyError:
            raise Rejected(INVALID, "UNKNOWN_VOICE",
                           f"voice_name: {unknown_voice(request.voice_name, self.tts.voices)}") from None
        rate = request.sample_rate_hz
        if rate < 0 or (rate and rate not in voice.supported_rates):
            raise Rejected(INVALID, "UNSUPPORTED_SAMPLE_RATE",
                           f"sample_rate_hz: {unsupported_rate_message(rate, voice)}")
        unimplemented = {
            "zero_shot_data (voice cloning)": request.HasField("zero_shot_data"),
            "custom_dictionary": bool(request.custom_dictionary),
            "enable_word_time_offsets": request.enable_word_time_offsets,
        }
        for option, value in unimplemented.items():
            if value:
                raise Rejected(UNIMPLEMENTED, "UNSUPPORTED_OPTION", f"{option} is not supported by rtmedia")
        check_custom_configuration(request.custom_configuration)
        return self.tts.open(voice.name, rate)

    def _check_text(self, text: str, complete: bool) -> None:
        if (problem := text_problem(text, self.max_text_chars, complete)) is not None:
            raise Rejected(INVALID, *problem)


def _settings(request: riva_tts_pb2.SynthesizeSpeechRequest) -> bytes:
    """The request without its text and id: what must stay the same along a SynthesizeOnline stream."""
    settings = riva_tts_pb2.SynthesizeSpeechRequest()
    settings.CopyFrom(request)
    settings.ClearField("text")
    settings.ClearField("id")
    return settings.SerializeToString(deterministic=True)
