"""The gRPC doors: RealtimeService.Converse, SpeechService, VideoService.DecodeVideo, the Riva
speech API, raw bytes and oversize messages on every method, floods, and tokens."""

from __future__ import annotations

import asyncio
import math
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import strategies as st
from riva.client.proto import riva_asr_pb2, riva_audio_pb2, riva_tts_pb2
from rtmedia.protocol.events import client_event
from rtmedia.v1 import realtime_pb2, speech_pb2, video_pb2

from tests.reliability.doors.core import (
    CHANNELS_MARKER,
    CLOSE_S,
    END_S,
    ITEM_MARKER,
    LOST,
    RESPONSE_OPEN_MARKER,
    Outcome,
    Target,
    cancelling,
    door,
    ended,
    finish,
    lost_by_client,
    paced,
    rpc_status,
)
from tests.reliability.strategies import (
    RATES,
    UNSET,
    audio,
    blobs,
    header_values,
    integers,
    message,
    sometimes,
    strings,
    weighted,
)

# ---- RealtimeService.Converse -------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    request: realtime_pb2.ConverseRequest
    pause_ms: int


@dataclass(frozen=True)
class ConverseCase:
    steps: tuple[Step, ...]
    ending: str  # close (session.close), half_close (end the requests), cancel (cancel the call)


def _ids() -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.text(max_size=12), st.sampled_from(["x" * 257, "é" * 129, "0" * 300]))


def _refs(marker: str) -> st.SearchStrategy[str]:
    return weighted([st.just(marker), st.just(marker), _ids()])


def spoken_words() -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(["hello", "what", "is", "the", "time", "please", "tell", "me", ",", ".", "?"]),
                    max_size=12).map(" ".join)


def spoken_texts() -> st.SearchStrategy[str]:
    words = st.lists(st.sampled_from(["hello", "what", "is", "the", "time", "please", "tell", "me", ",", ".", "?"]),
                     max_size=12).map(" ".join)
    return weighted([words, words, strings()])


def _images() -> st.SearchStrategy[bytes]:
    jpeg, png = b"\xff\xd8\xff\xe0", b"\x89PNG\r\n\x1a\n"
    return st.one_of(
        st.builds(lambda head, body: head + body, st.sampled_from([jpeg, png]), st.binary(max_size=256)),
        st.binary(max_size=64),
        st.builds(lambda head, n: head + b"\0" * n, st.sampled_from([jpeg, png]),
                  st.integers(2 * 1024 * 1024 - 16, 2 * 1024 * 1024 + 16)),
    )


_SESSION = "session_update.session."
CONVERSE_HINTS: dict[str, st.SearchStrategy[Any]] = {
    "event_id": sometimes(_ids()),
    # appends twice as often as any other event: audio drives the turn state machine
    "event": st.sampled_from([None, "input_audio_buffer_append", "input_audio_buffer_append",
                              *(f.name for f in realtime_pb2.ConverseRequest.DESCRIPTOR.oneofs_by_name["event"].fields)]),
    "input_audio_buffer_append.audio": audio(),
    f"{_SESSION}input_audio_format.sample_rate": sometimes(st.one_of(st.sampled_from(RATES), integers(-1, 2**31 - 1))),
    f"{_SESSION}input_audio_format.channels": sometimes(st.sampled_from([0, 1, 2, -1, 8])),
    f"{_SESSION}output_sample_rate": sometimes(st.sampled_from(RATES)),
    f"{_SESSION}responder": sometimes(st.one_of(st.sampled_from(["echo", "echo", "llm", "openai", "", "none"]),
                                                strings())),
    f"{_SESSION}voice": sometimes(st.one_of(st.sampled_from(["", "en_US-joe-medium", "nobody"]), strings())),
    f"{_SESSION}instructions": sometimes(spoken_texts()),
    f"{_SESSION}turn_detection.threshold": sometimes(st.one_of(st.floats(0, 1, width=32),
                                                               st.sampled_from([math.nan, -1.0, 2.0]))),
    f"{_SESSION}turn_detection.prefix_padding_ms": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}turn_detection.silence_duration_ms": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}turn_detection.eagerness": sometimes(st.one_of(st.sampled_from([0, 1, 2, 3, 4]), integers(-1, 99))),
    f"{_SESSION}turn_detection.candidate_ms": sometimes(st.one_of(st.sampled_from([200, 2000, 199, 2001]),
                                                                  integers(-(2**31), 2**31 - 1))),
    f"{_SESSION}turn_detection.max_wait_ms": sometimes(st.one_of(st.sampled_from([500, 30000, 499, 30001]),
                                                                 integers(-(2**31), 2**31 - 1))),
    f"{_SESSION}max_output_tokens": sometimes(integers(-(2**31), 2**31 - 1)),
    f"{_SESSION}idle_timeout_s": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}max_session_s": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}tools.functions": sometimes(st.lists(st.builds(
        realtime_pb2.FunctionTool, name=st.one_of(st.sampled_from(["get_weather", "f", "", "bad name", "x" * 65]),
                                                  strings()),
        description=spoken_texts(), parameters=st.sampled_from(["", "{}", '{"type": "object"}', '{"type": "string"}',
                                                          "{not json", "[1]", "[" * 5000])), max_size=3)),
    f"{_SESSION}tool_choice.name": sometimes(st.sampled_from(["", "get_weather", "f", "missing"])),
    f"{_SESSION}tool_timeout_ms": sometimes(integers(-1, 2**31 - 1)),
    f"{_SESSION}tool_filler_ms": sometimes(integers(-1, 2**31 - 1)),
    "conversation_item_create.item.text": spoken_texts(),
    "conversation_item_create.item.type": sometimes(st.sampled_from(["", "message", "function_call",
                                                                     "function_call_output", "reasoning"])),
    "conversation_item_create.item.call_id": sometimes(st.one_of(st.sampled_from(["call_1", ""]), strings())),
    "conversation_item_create.item.output": sometimes(spoken_texts()),
    "conversation_item_create.item.arguments": sometimes(st.sampled_from(["{}", '{"city": "Paris"}', "not json"])),
    "conversation_item_create.item.role": sometimes(st.sampled_from(["", "user", "assistant", "system", "🙂"])),
    "conversation_item_truncate.item_id": _refs(ITEM_MARKER),
    "response_cancel.response_id": _refs(RESPONSE_OPEN_MARKER),
    "playback_ack.response_id": _refs(RESPONSE_OPEN_MARKER),
    "playback_ack.played_ms": integers(-(2**63), 2**63 - 1),
    "response_create.instructions": sometimes(spoken_texts()),
    "camera_frame.image": _images(),
}

CONVERSE_CASES = st.builds(
    ConverseCase,
    st.lists(st.builds(Step, message(realtime_pb2.ConverseRequest, CONVERSE_HINTS),
                       st.sampled_from([0, 0, 0, 0, 10, 40, 200, 700])), max_size=12).map(tuple),
    st.sampled_from(["close", "close", "half_close", "cancel"]),
)


class _Stream:
    """What a Converse case has seen on its stream: ids to refer to, error codes, whether a
    response is in progress."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.response_id = ""
        self.item_id = ""
        self.responding = False

    def resolve(self, request: realtime_pb2.ConverseRequest) -> realtime_pb2.ConverseRequest:
        kind = request.WhichOneof("event")
        event = getattr(request, kind) if kind else None
        for name, value in (("response_id", self.response_id), ("item_id", self.item_id)):
            if event is not None and name in event.DESCRIPTOR.fields_by_name and \
                    getattr(event, name) in (RESPONSE_OPEN_MARKER, ITEM_MARKER):
                request = type(request).FromString(request.SerializeToString())
                setattr(getattr(request, kind), name, value)
        return request

    def seen(self, event: realtime_pb2.ConverseResponse) -> None:
        kind = event.WhichOneof("event")
        if kind == "response_created":
            self.response_id, self.item_id = event.response_created.response_id, event.response_created.item_id
            self.responding = True
        elif kind == "response_done":
            self.responding = False
        elif kind == "error":
            error = event.error
            self.outcome.error_events[error.code or "<no code>"] += 1
            if error.code == "server_error":
                self.outcome.problems.append(f"error event server_error: {error.message[:300]}")
            elif not error.code or not error.message:
                self.outcome.problems.append(f"an error event without a code or message: {error}")


async def _queue_requests(queue: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    while (request := await queue.get()) is not None:
        yield request


@door("converse", CONVERSE_CASES)
async def converse(target: Target, case: ConverseCase) -> Outcome:
    from rtmedia.v1 import realtime_pb2_grpc

    outcome = Outcome()
    stream = _Stream(outcome)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    call = realtime_pb2_grpc.RealtimeServiceStub(target.channel).Converse(_queue_requests(queue),
                                                                          metadata=target.metadata)

    async def read() -> None:
        async for event in call:
            stream.seen(event)

    reader = asyncio.ensure_future(read())
    try:
        return await _converse_steps(case, queue, stream, call, reader, outcome)
    finally:
        queue.put_nowait(None)  # the request stream ends, whatever happened (its task must not linger)


async def _converse_steps(case: ConverseCase, queue: asyncio.Queue[Any], stream: _Stream, call: Any,
                          reader: asyncio.Future[None], outcome: Outcome) -> Outcome:
    for step in case.steps:
        if step.pause_ms:
            await asyncio.sleep(step.pause_ms / 1000)
        if reader.done():
            break
        queue.put_nowait(stream.resolve(step.request))
    if case.ending == "cancel":
        await asyncio.sleep(0.01)
        call.cancel()
    else:
        if case.ending == "close":
            queue.put_nowait(client_event("session.close", reason="fuzz"))
        queue.put_nowait(None)
    done, _ = await asyncio.wait([reader], timeout=CLOSE_S if case.ending == "close" else END_S)
    if not done:
        if case.ending == "half_close" and stream.responding:
            outcome.status("REPLY_PLAYING")  # a half-closed session answers in full: it is not stuck
        else:
            outcome.problems.append(f"the stream did not end within {CLOSE_S:g} s of {case.ending}")
        call.cancel()
    try:
        await reader
        code, reason, details = grpc.StatusCode.OK, "", ""
    except asyncio.CancelledError:
        if cancelling():
            raise
        code, reason, details = grpc.StatusCode.CANCELLED, "", "cancelled by the client"
    except grpc.aio.AioRpcError as exc:
        if lost_by_client(exc):
            outcome.status(LOST)
            return outcome
        code, reason, details = rpc_status(exc)
    if done or code != grpc.StatusCode.CANCELLED:
        outcome.grpc_status(code, reason, details, cancelled=case.ending == "cancel", where="Converse")
    return outcome


# ---- SpeechService ------------------------------------------------------------------------------------

def _streamed(cls: type[Message], oneof: str, first: list[str | None], later: list[str | None],
              hints: dict[str, st.SearchStrategy[Any]], max_size: int = 6) -> st.SearchStrategy[list[Message]]:
    """A stream of `cls` requests: the first's `oneof` member drawn from `first`, the rest's from `later`."""
    head = message(cls, {**hints, oneof: st.sampled_from(first)})
    tail = message(cls, {**hints, oneof: st.sampled_from(later)})
    return st.builds(lambda h, t: [h, *t], head, st.lists(tail, max_size=max_size))


TRANSCRIBE_HINTS = {
    "config.audio_format.sample_rate": sometimes(st.sampled_from(RATES)),
    "config.audio_format.channels": sometimes(st.sampled_from([0, 1, 2, -1])),
    "config.language": sometimes(st.sampled_from(["", "en-US", "en", "fr-FR", "x" * 300])),
    "audio": audio(max_huge=256 * 1024),
}
TRANSCRIBE_CASES = st.one_of(
    _streamed(speech_pb2.TranscribeRequest, "request", ["config", "config", "config", "audio", None],
              ["audio", "audio", "audio", "audio", "config", None], TRANSCRIBE_HINTS),
    st.just([]),
)


@door("transcribe", TRANSCRIBE_CASES)
async def transcribe(target: Target, requests: list[speech_pb2.TranscribeRequest]) -> Outcome:
    from rtmedia.v1 import speech_pb2_grpc

    outcome = Outcome()
    call = paced(speech_pb2_grpc.SpeechServiceStub(target.channel).Transcribe, requests, metadata=target.metadata)
    await finish(call, outcome, where="Transcribe")
    return outcome


SYNTHESIZE_HINTS = {
    "text": st.one_of(spoken_texts(), st.sampled_from(["", "   ", "!?.,", "x" * 5001, "a" * 5000 + " b"])),
    "voice": sometimes(st.one_of(st.sampled_from(["", "en_US-joe-medium", "nobody"]), strings())),
    "sample_rate": sometimes(st.one_of(st.sampled_from(RATES), integers(-(2**31), 2**31 - 1))),
}


def _short_text(request: Message, limit: int = 400) -> bool:
    """Texts the server would accept are kept short: a case is about the request, not synthesis time."""
    text = request.text.strip()
    return len(text) <= limit or len(request.text) > 5000


@door("synthesize", message(speech_pb2.SynthesizeRequest, SYNTHESIZE_HINTS).filter(_short_text))
async def synthesize(target: Target, request: speech_pb2.SynthesizeRequest) -> Outcome:
    from rtmedia.v1 import speech_pb2_grpc

    outcome = Outcome()
    await finish(speech_pb2_grpc.SpeechServiceStub(target.channel).Synthesize(request, metadata=target.metadata),
                 outcome, where="Synthesize")
    return outcome


# ---- VideoService.DecodeVideo ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LatentSpec:
    shape: tuple[int, ...]
    dtype: int
    data: str  # exact (finite values of the right length), nonfinite, short, long, random
    seed: int


# Per dimension of a latent (C, T, H, W): values a VAE takes, and values it must refuse.
_DIMS = {
    0: ([CHANNELS_MARKER], [1, 0, -1, 3]),
    1: ([1, 2, 3, 4, 5], [0, -1, 129, 2**40]),
    2: ([1, 2, 4, 8, 3], [0, -2, 161, 2**31]),
    3: ([1, 2, 4, 8, 5], [0, -2, 161, 2**31]),
}


def _dimension(i: int) -> st.SearchStrategy[int]:
    good, bad = _DIMS.get(i, ([1, 2], [0]))
    return st.sampled_from(good * 8 + bad)


LATENTS = st.sampled_from([4, 4, 4, 4, 4, 0, 1, 3, 5]).flatmap(lambda rank: st.builds(
    LatentSpec,
    st.tuples(*[_dimension(i) for i in range(rank)]),
    st.one_of(st.sampled_from([1, 1, 2, 3]), st.integers(-2, 9)),
    st.sampled_from(["exact", "exact", "exact", "nonfinite", "short", "long", "random"]),
    st.integers(0, 2**16),
))
VIDEO_HINTS = {
    "latent": st.just(UNSET),  # built from the LatentSpec by the runner
    "width": sometimes(st.sampled_from([0, 2, 4, 8, 16, 7, 33, -1, 10**6, 2**31 - 1])),
    "height": sometimes(st.sampled_from([0, 2, 4, 8, 16, 7, 33, -1, 10**6, 2**31 - 1])),
    "latent_steps_per_chunk": sometimes(st.sampled_from([0, 1, 2, 3, 100, -1, 2**31 - 1])),
    "fps": sometimes(st.one_of(st.sampled_from([0.0, 16.0, 0.1, 240.0, 0.09, 241.0, -1.0, math.nan, math.inf]),
                               st.floats(width=32))),
}
VIDEO_CASES = st.tuples(message(video_pb2.DecodeVideoRequest, VIDEO_HINTS), LATENTS)
DTYPE_SIZES = {video_pb2.TENSOR_DTYPE_FLOAT32: (np.float32, 4), video_pb2.TENSOR_DTYPE_FLOAT16: (np.float16, 2),
               video_pb2.TENSOR_DTYPE_BFLOAT16: (np.float32, 2)}
MAX_EXACT_BYTES = 2 * 1024 * 1024


def latent_tensor(spec: LatentSpec, channels: int) -> video_pb2.Tensor:
    shape = [channels if d == CHANNELS_MARKER else d for d in spec.shape]
    rng = np.random.default_rng(spec.seed)
    dtype, size = DTYPE_SIZES.get(spec.dtype, (np.float32, 4))
    count = math.prod(shape) if shape and all(d > 0 for d in shape) else 0
    if spec.data in ("exact", "nonfinite") and 0 < count * size <= MAX_EXACT_BYTES:
        values = rng.standard_normal(count).astype(np.float32)
        if spec.data == "nonfinite":
            values[int(rng.integers(count))] = rng.choice([np.nan, np.inf, -np.inf])
        if spec.dtype == video_pb2.TENSOR_DTYPE_BFLOAT16:  # the upper half of each float32
            data = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            data = values.astype(dtype).astype(dtype().dtype.newbyteorder("<")).tobytes()
    elif spec.data in ("short", "long") and 0 < count * size <= MAX_EXACT_BYTES:
        data = rng.bytes(count * size + (-1 if spec.data == "short" else 1) * int(rng.integers(1, 9)))
    else:
        data = rng.bytes(int(rng.integers(0, 4096)))
    return video_pb2.Tensor(shape=shape, dtype=spec.dtype, data=data)


@door("decode_video", VIDEO_CASES)
async def decode_video(target: Target, case: tuple[video_pb2.DecodeVideoRequest, LatentSpec]) -> Outcome:
    from rtmedia.v1 import video_pb2_grpc

    request, spec = case
    request = video_pb2.DecodeVideoRequest.FromString(request.SerializeToString())
    request.latent.CopyFrom(latent_tensor(spec, target.latent_channels))
    outcome = Outcome()
    await finish(video_pb2_grpc.VideoServiceStub(target.channel).DecodeVideo(request, metadata=target.metadata),
                 outcome, where="DecodeVideo")
    return outcome


# ---- the Riva speech API -------------------------------------------------------------------------------

def _wav(rate: int, width: int, channels: int, frames: bytes, truncate: int) -> bytes:
    out = BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(frames[: len(frames) - len(frames) % (width * channels)])
    data = out.getvalue()
    return data[:truncate] if truncate else data


RIVA_AUDIO = st.one_of(
    audio(max_huge=256 * 1024),
    st.builds(_wav, st.sampled_from([8000, 16000, 22050, 44100, 1]), st.sampled_from([2, 2, 1, 3]),
              st.sampled_from([1, 1, 2]), audio(max_huge=0), st.sampled_from([0, 0, 0, 12, 44, 45])),
    st.builds(lambda tail: b"RIFF\x24\x00\x00\x00WAVE" + tail, st.binary(max_size=64)),
)
RIVA_CONFIG_HINTS = {
    "encoding": sometimes(st.one_of(st.sampled_from(sorted(riva_audio_pb2.AudioEncoding.values())),
                                    st.integers(-1, 40)), 1, 2),
    "sample_rate_hertz": sometimes(st.sampled_from(RATES), 6, 1),
    "language_code": sometimes(st.sampled_from(["", "en-US", "en-us", "de-DE", "x" * 300]), 1, 2),
    "model": sometimes(st.sampled_from(["", "whisper-tiny-en-US-asr-streaming", "pocketsphinx-en-US-asr-streaming",
                                         "nope"]), 1, 3),
    "max_alternatives": sometimes(integers(-(2**31), 2**31 - 1), 1, 3),
    "audio_channel_count": sometimes(st.sampled_from([0, 1, 2, -1]), 1, 3),
    "profanity_filter": sometimes(st.booleans(), 1, 6),
    "enable_separate_recognition_per_channel": sometimes(st.booleans(), 1, 6),
    "speech_contexts": sometimes(st.lists(message(riva_asr_pb2.SpeechContext), max_size=2), 1, 6),
    "diarization_config": sometimes(message(riva_asr_pb2.SpeakerDiarizationConfig), 1, 6),
    "custom_configuration": sometimes(st.dictionaries(strings(), strings(), max_size=2), 1, 6),
    "endpointing_config": sometimes(message(riva_asr_pb2.EndpointingConfig, {
        "start_history": sometimes(integers(-1, 100000)), "stop_history": sometimes(integers(-1, 100000)),
        "start_threshold": sometimes(st.floats(-1, 2, width=32)), "stop_threshold": sometimes(st.floats(-1, 2, width=32)),
        "stop_history_eou": sometimes(integers(-1, 2000), 1, 4),
        "stop_threshold_eou": sometimes(st.floats(-1, 2, width=32), 1, 4),
    }), 1, 2),
}


RECOGNIZE_HINTS = {"audio": RIVA_AUDIO,
                   "config": sometimes(message(riva_asr_pb2.RecognitionConfig, RIVA_CONFIG_HINTS), 6, 1)}


@door("riva_recognize", message(riva_asr_pb2.RecognizeRequest, RECOGNIZE_HINTS), needs=["riva"])
async def riva_recognize(target: Target, request: riva_asr_pb2.RecognizeRequest) -> Outcome:
    from riva.client.proto import riva_asr_pb2_grpc

    outcome = Outcome()
    stub = riva_asr_pb2_grpc.RivaSpeechRecognitionStub(target.channel)
    await finish(stub.Recognize(request, metadata=target.metadata), outcome, where="Recognize")
    return outcome


STREAMING_HINTS = {
    "streaming_config.config": message(riva_asr_pb2.RecognitionConfig, RIVA_CONFIG_HINTS),
    "audio_content": audio(max_huge=256 * 1024),
    "runtime_config": sometimes(st.dictionaries(strings(), strings(), max_size=2), 1, 6),
}


@door("riva_streaming_recognize",
      _streamed(riva_asr_pb2.StreamingRecognizeRequest, "streaming_request",
                ["streaming_config", "streaming_config", "streaming_config", "audio_content", None],
                ["audio_content", "audio_content", "audio_content", "streaming_config", None], STREAMING_HINTS),
      needs=["riva"])
async def riva_streaming_recognize(target: Target, requests: list[riva_asr_pb2.StreamingRecognizeRequest]) -> Outcome:
    from riva.client.proto import riva_asr_pb2_grpc

    outcome = Outcome()
    stub = riva_asr_pb2_grpc.RivaSpeechRecognitionStub(target.channel)
    await finish(paced(stub.StreamingRecognize, requests, metadata=target.metadata), outcome,
                 where="StreamingRecognize")
    return outcome


RIVA_TTS_HINTS = {
    "text": st.one_of(spoken_texts(), st.sampled_from(["", "   ", "!?.,", "x" * 5001])),
    "language_code": sometimes(st.sampled_from(["", "en-US", "EN-us", "de-DE"]), 1, 2),
    "encoding": sometimes(st.one_of(st.sampled_from(sorted(riva_audio_pb2.AudioEncoding.values())),
                                    st.integers(-1, 40)), 1, 2),
    "sample_rate_hz": sometimes(st.sampled_from(RATES), 1, 1),
    "voice_name": sometimes(st.sampled_from(["", "en_US-joe-medium", "nobody"]), 1, 2),
    "zero_shot_data": sometimes(message(riva_tts_pb2.ZeroShotData, {"audio_prompt": blobs(1024)}), 1, 8),
    "custom_dictionary": sometimes(strings(), 1, 8),
    "enable_word_time_offsets": sometimes(st.booleans(), 1, 8),
    "custom_configuration": sometimes(st.dictionaries(strings(), strings(), max_size=2), 1, 8),
}


@door("riva_synthesize", message(riva_tts_pb2.SynthesizeSpeechRequest, RIVA_TTS_HINTS).filter(_short_text),
      needs=["riva"])
async def riva_synthesize(target: Target, request: riva_tts_pb2.SynthesizeSpeechRequest) -> Outcome:
    from riva.client.proto import riva_tts_pb2_grpc

    outcome = Outcome()
    stub = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(target.channel)
    await finish(stub.Synthesize(request, metadata=target.metadata), outcome, where="Synthesize")
    return outcome


def _online(first: riva_tts_pb2.SynthesizeSpeechRequest, later: list[tuple[bool, str, Message]]) -> list[Message]:
    """A SynthesizeOnline stream: after `first`, text deltas with the same settings (or, where
    the flag says so, any other request)."""
    requests: list[Message] = [first]
    for same, text, other in later:
        if same:
            request = riva_tts_pb2.SynthesizeSpeechRequest.FromString(first.SerializeToString())
            request.text = text
        else:
            request = other
        requests.append(request)
    return requests


RIVA_ONLINE_CASES = st.one_of(st.just([]), st.builds(
    _online, message(riva_tts_pb2.SynthesizeSpeechRequest, RIVA_TTS_HINTS).filter(_short_text),
    st.lists(st.tuples(st.sampled_from([True, True, True, False]),
                       st.one_of(spoken_words(), st.text(max_size=20), st.sampled_from(["", " ", "\n", "x" * 5001])),
                       message(riva_tts_pb2.SynthesizeSpeechRequest, RIVA_TTS_HINTS).filter(_short_text)),
             max_size=5),
))


@door("riva_synthesize_online", RIVA_ONLINE_CASES, needs=["riva"])
async def riva_synthesize_online(target: Target, requests: list[Message]) -> Outcome:
    from riva.client.proto import riva_tts_pb2_grpc

    outcome = Outcome()
    stub = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(target.channel)
    await finish(paced(stub.SynthesizeOnline, requests, metadata=target.metadata), outcome, where="SynthesizeOnline")
    return outcome


# ---- raw bytes on every method --------------------------------------------------------------------------

@dataclass(frozen=True)
class Method:
    path: str
    client_streaming: bool
    server_streaming: bool
    needs: frozenset[str]


def _methods() -> list[Method]:
    """Every method the server serves (but health's Watch, a stream that never ends by design)."""
    modules = [(realtime_pb2, ()), (speech_pb2, ()), (video_pb2, ()), (riva_asr_pb2, ("riva",)),
               (riva_tts_pb2, ("riva",)), (health_pb2, ()), (reflection_pb2, ())]
    methods = []
    for module, needs in modules:
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                path = f"/{service.full_name}/{m.name}"
                if path != "/grpc.health.v1.Health/Watch":
                    methods.append(Method(path, m.client_streaming, m.server_streaming, frozenset(needs)))
    return methods


METHODS = _methods()
GARBAGE = b"\xff\xff\xff\xff\x0f"  # a field header whose varint never ends
SESSION_CLOSE = client_event("session.close", reason="fuzz").SerializeToString()


def undecodable() -> st.SearchStrategy[bytes]:
    """Bytes no message decodes from: anything, then a length-delimited field cut short."""
    return st.one_of(st.just(GARBAGE), st.builds(lambda head: head + b"\x0a\xff\xff\x7f", st.binary(max_size=48)),
                     st.builds(lambda head: head + GARBAGE, st.binary(max_size=48)))


def _method_call(target: Target, method: Method, messages: list[bytes]) -> Any:
    kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
    factory = getattr(target.channel, kind)(method.path, request_serializer=None, response_deserializer=None)
    if method.client_streaming:
        return paced(factory, messages, metadata=target.metadata)
    return factory(messages[0], metadata=target.metadata)


RAW_CASES = st.tuples(st.sampled_from(METHODS), st.lists(st.one_of(undecodable(), undecodable(), blobs(256)),
                                                         min_size=1, max_size=3))


def _served(target: Target, method: Method) -> bool:
    return method.needs <= target.features


@door("raw_bytes", RAW_CASES)
async def raw_bytes(target: Target, case: tuple[Method, list[bytes]]) -> Outcome:
    method, messages = case
    outcome = Outcome()
    if not _served(target, method):
        return outcome
    if method.path.endswith("/Converse"):  # a stream whose bytes all decode still ends
        messages = [*messages, SESSION_CLOSE]
    await finish(_method_call(target, method, messages), outcome, where=method.path)
    return outcome


@dataclass(frozen=True)
class Oversize:
    method: Method
    over: int  # bytes over the receive limit
    second: bool  # a stream's second message (after an empty first one), else its first


@door("oversize", st.builds(Oversize, st.sampled_from(METHODS), st.integers(1, 1 << 20), st.booleans()))
async def oversize(target: Target, case: Oversize) -> Outcome:
    outcome = Outcome()
    if not _served(target, case.method):
        return outcome
    big = b"\x12" + _varint(target.max_receive_bytes + case.over) + bytes(target.max_receive_bytes + case.over)
    messages = [b"", big] if case.second and case.method.client_streaming else [big]
    await finish(_method_call(target, case.method, messages), outcome, where=case.method.path)
    return outcome


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# ---- floods ---------------------------------------------------------------------------------------------

FLOODS = ("list_voices", "converse_open_close", "converse_errors", "bad_synthesize", "transcribe_chunks",
          "health", "undecodable")


@door("flood", st.tuples(st.sampled_from(FLOODS), st.integers(2, 80), st.integers(0, 20), st.integers(1, 160)))
async def flood(target: Target, case: tuple[str, int, int, int]) -> Outcome:
    """Many calls at once, `spacing` ms apart (or one stream with very many requests, of `size`
    samples of audio or an event id of `size` characters)."""
    from grpc_health.v1 import health_pb2_grpc
    from rtmedia.v1 import realtime_pb2_grpc, speech_pb2_grpc

    kind, n, spacing, size = case
    outcome = Outcome()
    speech = speech_pb2_grpc.SpeechServiceStub(target.channel)
    realtime = realtime_pb2_grpc.RealtimeServiceStub(target.channel)
    md = target.metadata
    if kind == "converse_errors":  # one stream, each of its many events answered with an error
        events = [client_event("response.cancel", event_id=f"{i:0{size}d}") for i in range(n * 50)]
        events.append(client_event("session.close"))
        stream = _Stream(outcome)
        call = realtime.Converse(iter(events), metadata=md)
        for event in await finish(call, outcome, where="Converse"):
            stream.seen(event)
        return outcome
    if kind == "transcribe_chunks":
        chunks = [speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig())]
        chunks += [speech_pb2.TranscribeRequest(audio=b"\0\0" * size) for _ in range(n * 50)]
        await finish(speech.Transcribe(iter(chunks), metadata=md), outcome, where="Transcribe")
        return outcome

    def one() -> Any:
        if kind == "list_voices":
            return speech.ListVoices(speech_pb2.ListVoicesRequest(), metadata=md)
        if kind == "bad_synthesize":
            return speech.Synthesize(speech_pb2.SynthesizeRequest(text=""), metadata=md)
        if kind == "health":
            return health_pb2_grpc.HealthStub(target.channel).Check(health_pb2.HealthCheckRequest())
        if kind == "undecodable":
            method = next(m for m in METHODS if m.path.endswith("/Synthesize") and "riva" not in m.path)
            return _method_call(target, method, [GARBAGE])
        return realtime.Converse(iter([client_event("session.close")]), metadata=md)

    async def spaced(i: int) -> None:
        await asyncio.sleep(i * spacing / 1000)
        await finish(one(), outcome, where=kind)

    await asyncio.gather(*(spaced(i) for i in range(n)))
    return outcome


# ---- tokens ---------------------------------------------------------------------------------------------

CREDENTIALS = ("none", "wrong", "malformed", "basic", "empty_bearer", "good", "limited")
AUTH_METHODS = ("list_voices", "converse", "synthesize", "riva_config", "health", "decode_video")


@dataclass(frozen=True)
class AuthCall:
    credential: str
    method: str
    junk: str  # the malformed header value


def _authorization(target: Target, call: AuthCall) -> tuple[tuple[str, str], ...]:
    value = {
        "none": None, "wrong": "Bearer wrong-token-0123456789abcdef", "malformed": call.junk or "x",
        "basic": f"Basic {target.token}", "empty_bearer": "Bearer ", "good": f"Bearer {target.token}",
        "limited": f"Bearer {target.limited_token}",
    }[call.credential]
    return (("authorization", value),) if value else ()


AUTH_CASES = st.lists(st.builds(AuthCall, st.sampled_from(CREDENTIALS), st.sampled_from(AUTH_METHODS),
                                header_values(200)), min_size=1, max_size=40)


@door("auth", AUTH_CASES, needs=["auth"])
async def auth(target: Target, calls: list[AuthCall]) -> Outcome:
    """Floods of calls without a token, with a wrong or malformed one, or with a quota's, at once."""
    from grpc_health.v1 import health_pb2_grpc
    from riva.client.proto import riva_tts_pb2_grpc
    from rtmedia.v1 import realtime_pb2_grpc, speech_pb2_grpc, video_pb2_grpc

    outcome = Outcome()

    async def one(call: AuthCall) -> None:
        md = _authorization(target, call)
        if call.method == "list_voices":
            rpc = speech_pb2_grpc.SpeechServiceStub(target.channel).ListVoices(speech_pb2.ListVoicesRequest(),
                                                                               metadata=md)
        elif call.method == "converse":
            rpc = paced(realtime_pb2_grpc.RealtimeServiceStub(target.channel).Converse,
                        [client_event("session.close")], metadata=md)
        elif call.method == "synthesize":
            rpc = speech_pb2_grpc.SpeechServiceStub(target.channel).Synthesize(
                speech_pb2.SynthesizeRequest(text="hi", sample_rate=7), metadata=md)
        elif call.method == "riva_config" and "riva" in target.features:
            rpc = riva_tts_pb2_grpc.RivaSpeechSynthesisStub(target.channel).GetRivaSynthesisConfig(
                riva_tts_pb2.RivaSynthesisConfigRequest(), metadata=md)
        elif call.method == "decode_video":
            rpc = video_pb2_grpc.VideoServiceStub(target.channel).DecodeVideo(video_pb2.DecodeVideoRequest(),
                                                                              metadata=md)
        else:
            rpc = health_pb2_grpc.HealthStub(target.channel).Check(health_pb2.HealthCheckRequest(), metadata=md)
        _, status = await ended(rpc, outcome, where=f"{call.method} ({call.credential})")
        valid = call.credential in ("good", "limited")
        refused = status == "UNAUTHENTICATED/UNAUTHENTICATED"
        if call.method != "health" and not valid and not refused and status not in ("CLIENT_TIMEOUT", LOST):
            outcome.problems.append(f"{call.method} with credential {call.credential} was not refused: {status}")
        if valid and status.startswith("UNAUTHENTICATED"):
            outcome.problems.append(f"{call.method} with a valid token was refused: {status}")

    await asyncio.gather(*(one(call) for call in calls))
    return outcome
