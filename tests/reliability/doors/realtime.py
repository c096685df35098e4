"""OpenAI's Realtime API on the web port (web/openai/realtime_ws.py): a WebSocket handshake,
then fuzzed client events, raw frames and spoken turns."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from tests.reliability.doors.core import (
    CLOSE_S,
    END_S,
    ITEM_MARKER,
    RESPONSE_OPEN_MARKER,
    SETTLE_S,
    Outcome,
    Target,
    door,
    settled,
)
from tests.reliability.doors.services import spoken_texts, spoken_words
from tests.reliability.doors.web_port import openai_error
from tests.reliability.strategies import (
    UNSET,
    audio,
    floats,
    header_values,
    json_values,
    sometimes,
    speech_pcm,
    weighted,
)

# ---- OpenAI's Realtime API on the web port (web/openai/realtime_ws.py) --------------------------------------------

RT_PATH = "/v1/realtime"
# A valid key in three cases of four (in the header, or as a browser's subprotocol), else a wrong or no key.
RT_CREDENTIALS = ("bearer",) * 10 + ("protocol",) * 3 + ("rtmedia_protocol", "wrong", "wrong_protocol",
                                                         "empty_protocol", "none", "malformed")
RT_MODELS = ("gpt-realtime", "gpt-realtime-mini", "rtmedia-realtime", "gpt-4o-realtime-preview", "gpt-realtime-2.1")
RT_BAD_MODELS = ("", "no-such-model", "tts-1", "whisper-1", "GPT-REALTIME", "gpt-realtime ", "é" * 40, "x" * 300)
RT_TRANSCRIBERS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "rtmedia-asr")
OWN_IDS = ("rtmedia.front.initial", "rtmedia.front.update.1", "rtmedia.front.response.2")  # the front's own ids
RT_SILENCE_S = 1.0  # after a spoken turn, so that server VAD ends it
RT_LOG_GRACE_S = 0.15  # after a socket's session has ended, for the front's log of it


@dataclass(frozen=True)
class Pcm:
    """PCM a case appends, resolved (base64-encoded) when the frame is sent: a slice of real
    speech at 24 kHz, a whole spoken turn, any of `audio()`'s, or bytes that are no PCM16."""

    kind: str  # slice, turn, other
    start: float = 0.0
    length: int = 0
    odd: bool = False
    other: bytes = b""

    def pcm(self) -> bytes:
        if self.kind == "turn":
            return spoken_turn()
        if self.kind == "slice":
            return _speech_24k(self.start, self.length, self.odd)
        return self.other

    def __repr__(self) -> str:
        return f"Pcm({self.kind}, {self.start:.3f}, {self.length}, odd={self.odd}, other={len(self.other)} bytes)"


@dataclass(frozen=True)
class B64:
    """An `audio` value: `pcm` base64-encoded (how: valid, urlsafe, unpadded, with garbage, not base64)."""

    pcm: Pcm
    how: str = "valid"

    def encode(self) -> str:
        import base64

        data = self.pcm.pcm()
        text = base64.b64encode(data).decode()
        if self.how == "urlsafe":
            return base64.urlsafe_b64encode(data).decode()
        if self.how == "unpadded":
            return text.rstrip("=")
        if self.how == "spaces":
            return " ".join(text[i:i + 76] for i in range(0, len(text), 76))
        if self.how == "garbage":
            return text[: len(text) // 2] + "%%%" + text[len(text) // 2:]
        if self.how == "empty":
            return ""
        return text


def _speech_24k(start: float, length: int, odd: bool) -> bytes:
    pcm = speech_pcm(24000)
    offset = int(start * len(pcm)) // 2 * 2
    piece = pcm[offset:offset + length]
    return piece + b"\x01" if odd else piece


@functools.cache
def spoken_turn() -> bytes:
    """The test sentence at 24 kHz with silence around it: server VAD commits it, and a response follows."""
    return bytes(24000 * 2 * 3 // 10) + speech_pcm(24000) + bytes(int(24000 * 2 * RT_SILENCE_S))


@dataclass(frozen=True)
class Turn:
    """The spoken turn (spoken_turn()) as a client streams it: appends of `chunk_ms` each, sent
    `pace` times faster than real time (one append of it all is over the server's input inbox)."""

    chunk_ms: int
    pace: float

    def appends(self) -> list[str]:
        import base64

        pcm, step = spoken_turn(), 48 * self.chunk_ms  # 24 kHz PCM16: 48 bytes a millisecond
        return [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
                for i in range(0, len(pcm), step)]


RT_TURNS = st.builds(Turn, st.sampled_from([100, 200, 200, 500]), st.sampled_from([8.0, 8.0, 4.0, 50.0]))
RT_PCM = weighted([
    st.builds(Pcm, st.just("slice"), st.floats(0, 1), st.integers(0, 96000), st.booleans()),
    st.builds(Pcm, st.just("slice"), st.floats(0, 1), st.integers(0, 96000), st.booleans()),
    st.builds(Pcm, st.just("slice"), st.floats(0, 1), st.integers(0, 96000), st.just(False)),
    st.builds(lambda data: Pcm("other", other=data), audio(max_huge=0)),
    st.builds(lambda data: Pcm("other", other=data), st.binary(min_size=1, max_size=7)),
])
RT_AUDIO = weighted([st.builds(B64, RT_PCM)] * 6 + [st.builds(B64, RT_PCM, st.sampled_from(
    ["urlsafe", "unpadded", "spaces", "garbage", "empty"]))])


def _junk() -> st.SearchStrategy[Any]:
    """Any JSON value (NaN and the infinities too: Python's json writes and reads them)."""
    return st.one_of(json_values(3), st.sampled_from([math.nan, math.inf, -math.inf, 10**30, -1, 0, "", True]))


def _often(good: st.SearchStrategy[Any], times: int = 3) -> st.SearchStrategy[Any]:
    """`good` `times` in `times + 1`, else any JSON value."""
    return weighted([good] * times + [_junk()])


def _formats() -> st.SearchStrategy[Any]:
    return _often(st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["audio/pcm", "audio/pcm", "audio/pcmu", "audio/pcma"])},
                              optional={"rate": st.sampled_from([24000, 24000, 8000, 16000, 0, "24000", 24000.0])}),
        st.sampled_from([{"type": "audio/opus"}, {"type": "audio/pcm", "rate": 24000, "channels": 1}, {},
                         "audio/pcm", "pcm16", "g711_ulaw"])))


RT_TURN_DETECTION = weighted([st.none(), st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["server_vad", "server_vad", "server_vad", "semantic_vad", "none", ""]),
    "threshold": st.one_of(st.sampled_from([0.5, 0.05, 0.95, 0.04, 0.96, 0, 1, math.nan]), floats()),
    "prefix_padding_ms": st.sampled_from([0, 300, 2000, 2001, -1, 1.5, None]),
    "silence_duration_ms": st.sampled_from([100, 200, 500, 5000, 99, 5001, 10**12, None]),
    "create_response": _often(st.booleans()),
    "interrupt_response": _often(st.booleans()),
    "idle_timeout_ms": st.sampled_from([None, 5000, 30000, 4999, 30001, 0]),
    "eagerness": st.sampled_from(["auto", "low", "medium", "high", "eager", "", None, 1]),
}), st.fixed_dictionaries({}, optional={
    "type": st.just("server_vad"), "silence_duration_ms": st.sampled_from([100, 200, 500]),
    "create_response": st.booleans()}), _junk()])
RT_TRANSCRIPTION = weighted([st.none(), st.just({}), st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.sampled_from(RT_TRANSCRIBERS), st.sampled_from(["tts-1", "", "gpt-realtime"]), _junk()),
    "language": st.sampled_from([None, "en", "en", "fr", "", "EN", "en-US"]),
    "prompt": st.sampled_from([None, "", "names: Ada", 5]),
    "delay": st.sampled_from([None, "", 1]),
    "keywords": st.sampled_from([[], ["milk"], None]),
}), _junk()])
RT_SESSION_AUDIO = st.fixed_dictionaries({}, optional={
    "input": _often(st.fixed_dictionaries({}, optional={
        "format": _formats(), "transcription": RT_TRANSCRIPTION, "turn_detection": RT_TURN_DETECTION,
        "noise_reduction": st.sampled_from([None, None, {"type": "near_field"}, "x"]),
        "no_such_field": st.just(1)})),
    "output": _often(st.fixed_dictionaries({}, optional={
        "format": _formats(), "voice": _often(st.sampled_from(["alloy", "verse", "marin", "en_US-joe-medium",
                                                               "nobody", "", {"id": "voice_1"}])),
        "speed": st.one_of(st.sampled_from([0.25, 1, 1.0, 1.5, 0.24, 1.51, 4, math.nan]), _junk())})),
})
RT_TOOLS = st.sampled_from([[], [], [{"type": "function", "name": "f", "parameters": {}}], [{"type": "mcp"}], {},
                            None])
RT_TOOL_CHOICE = st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}, "", None])
RT_MAX_TOKENS = st.one_of(st.sampled_from(["inf", "inf", 1, 3, 4096, 4097, 0, -1, 1.5, 2.0, "Inf", "4", None,
                                           math.inf, math.nan, 10**30]), _junk())
RT_MODALITIES = st.one_of(st.sampled_from([["audio"], ["text"], ["audio"], ["text", "audio"], [], ["video"],
                                           "audio", None]), _junk())
RT_SESSION_FIELDS = {
    "model": st.one_of(st.sampled_from(RT_MODELS), st.sampled_from(RT_BAD_MODELS), _junk()),
    "instructions": _often(spoken_texts()),
    "output_modalities": RT_MODALITIES,
    "max_output_tokens": RT_MAX_TOKENS,
    "audio": _often(RT_SESSION_AUDIO, 6),
    "tools": RT_TOOLS,
    "tool_choice": RT_TOOL_CHOICE,
    "tracing": st.sampled_from([None, "auto", {"workflow_name": "x"}]),
    "truncation": st.sampled_from(["auto", "disabled", {"type": "retention_ratio"}, None]),
    "include": st.sampled_from([None, [], ["item.input_audio_transcription.logprobs"]]),
    "prompt": st.sampled_from([None, {"id": "pmpt_1"}]),
    "parallel_tool_calls": _often(st.booleans(), 1),
    "reasoning": st.sampled_from([None, {"effort": "low"}]),
    "no_such_field": _junk(),
}
RT_SESSION = weighted([
    st.builds(lambda kind, rest: {**kind, **rest},
              st.sampled_from([{"type": "realtime"}] * 4 + [{"type": "transcription"}, {}, {"type": "x"},
                                                             {"type": None}]),
              st.fixed_dictionaries({}, optional=RT_SESSION_FIELDS)),
    st.builds(lambda kind, rest: {**kind, **rest},
              st.sampled_from([{"type": "realtime"}, {"type": "transcription"}]),
              st.fixed_dictionaries({}, optional={"audio": RT_SESSION_AUDIO})),
    st.builds(lambda kind, rest: {**kind, **rest},  # few fields: most updates apply
              st.sampled_from([{"type": "realtime"}, {"type": "transcription"}]),
              st.fixed_dictionaries({}, optional={"instructions": spoken_words(), "output_modalities":
                                                  st.sampled_from([["audio"], ["text"]]),
                                                  "max_output_tokens": st.sampled_from(["inf", 3, 50])})),
    _junk(),
])


def _ids_ref(marker: str) -> st.SearchStrategy[Any]:
    """An id: the last one the server named (the marker, resolved when sent), made up, or not a string."""
    return weighted([st.just(marker)] * 4 + [st.sampled_from(["item_nope", "resp_nope", "", "x" * 300, "🙂"]),
                                             _junk()])


def _part(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    if kind == "input_audio":
        return st.fixed_dictionaries({"type": st.just(kind)}, optional={
            "audio": weighted([RT_AUDIO] * 3 + [_junk()]), "transcript": st.one_of(st.none(), spoken_words())})
    if kind == "output_audio":
        return st.fixed_dictionaries({"type": st.just(kind)}, optional={
            "transcript": _often(spoken_words()), "audio": st.builds(lambda a: a, RT_AUDIO)})
    if kind == "input_image":
        return st.fixed_dictionaries({"type": st.just(kind)}, optional={
            "image_url": st.sampled_from(["data:image/png;base64,AAAA", "https://example.com/x.png", ""]),
            "detail": st.sampled_from(["auto", "low"])})
    return st.fixed_dictionaries({"type": st.just(kind)}, optional={"text": _often(spoken_texts())})


RT_PART_KINDS = ("input_text", "input_text", "input_audio", "output_text", "text", "output_audio", "input_image",
                 "audio", "")
RT_MESSAGE = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "message", "message", "", "messages"]),
    "role": st.sampled_from(["user", "user", "user", "assistant", "assistant", "system", "", "tool", None]),
    "content": weighted([st.lists(st.sampled_from(RT_PART_KINDS).flatmap(_part), min_size=1, max_size=3)] * 4
                        + [st.just([]), _junk()]),
    "id": weighted([st.none(), st.text(max_size=12), st.just("item_mine"), st.just(ITEM_MARKER), _junk()]),
    "status": st.sampled_from(["completed", "in_progress", "x"]),
    "object": st.sampled_from(["realtime.item", "x"]),
    "no_such_field": st.just(1),
})
RT_ITEMS = weighted([
    RT_MESSAGE, RT_MESSAGE, RT_MESSAGE, RT_MESSAGE,
    st.builds(lambda role, text: {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]},
              st.just("user"), spoken_words()),  # a valid text turn
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "mcp_call"])},
                          optional={"name": st.just("f"), "call_id": st.just("call_1"), "arguments": st.just("{}"),
                                    "output": st.just("42")}),
    _junk(),
])
RT_RESPONSE = weighted([st.none(), st.just({}), st.fixed_dictionaries({}, optional={
    "instructions": _often(spoken_texts()),
    "max_output_tokens": RT_MAX_TOKENS,
    "output_modalities": RT_MODALITIES,
    "conversation": st.sampled_from(["auto", "auto", "none", "x", None, "", 5]),
    "metadata": st.one_of(st.sampled_from([None, {"topic": "x"}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 5}]),
                          st.dictionaries(st.text(max_size=4), st.text(max_size=4), min_size=15, max_size=18)),
    "audio": st.sampled_from([None, {"output": {"voice": "alloy"}}, {"output": {"voice": "verse"}},
                              {"output": {"format": {"type": "audio/pcm"}}}, {"output": {"format": "pcm"}},
                              {"output": {}}, {"input": {}}, "x"]),
    "input": st.sampled_from([None, [], [{"type": "item_reference", "id": "x"}]]),
    "tools": RT_TOOLS, "tool_choice": RT_TOOL_CHOICE,
    "prompt": st.sampled_from([None, {"id": "pmpt_1"}]),
    "reasoning": st.sampled_from([None, {"effort": "low"}]),
    "no_such_field": st.just(1),
}), _junk()])
RT_EVENT_IDS = weighted([st.just(UNSET)] * 4 + [st.text(max_size=12), st.sampled_from(["e1", "e1", "", "x" * 300]),
                                                st.sampled_from(OWN_IDS), _junk()])


def _event(kind: str, fields: dict[str, st.SearchStrategy[Any]] | None = None,
           optional: dict[str, st.SearchStrategy[Any]] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """A client event of type `kind` (a `kind` of None: any type), with its event_id drawn, and
    now and then a field it does not have."""
    def build(body: dict[str, Any], eid: Any, extra: Any) -> dict[str, Any]:
        event = {"type": kind, **body} if kind is not None else body
        if eid is not UNSET:
            event["event_id"] = eid
        if extra is not UNSET:
            event["no_such_field"] = extra
        return event

    return st.builds(build, st.fixed_dictionaries(fields or {}, optional=optional or {}), RT_EVENT_IDS,
                     sometimes(_junk(), 1, 12))


RT_EVENTS = [
    _event("session.update", {"session": RT_SESSION}),
    _event("session.update", {"session": RT_SESSION}),
    _event("session.update", optional={"session": _junk()}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": RT_AUDIO}),
    _event("input_audio_buffer.append", {"audio": st.builds(B64, st.just(Pcm("turn")))}),  # over the inbox
    RT_TURNS, RT_TURNS, RT_TURNS,
    _event("input_audio_buffer.append", optional={"audio": _junk()}),
    _event("input_audio_buffer.commit"),
    _event("input_audio_buffer.clear"),
    _event("conversation.item.create", {"item": RT_ITEMS},
           {"previous_item_id": weighted([st.just(ITEM_MARKER), st.none(), st.just("root"), _junk()])}),
    _event("conversation.item.create", {"item": RT_ITEMS}),
    _event("conversation.item.truncate", optional={
        "item_id": _ids_ref(ITEM_MARKER),
        "content_index": st.sampled_from([0, 0, 0, 1, -1, "0", None]),
        "audio_end_ms": st.one_of(st.sampled_from([0, 400, 1500, -1, 10**12, 1.5, "400", True, None]),
                                  st.integers(0, 10000))}),
    _event("conversation.item.delete", optional={"item_id": _ids_ref(ITEM_MARKER)}),
    _event("conversation.item.retrieve", optional={"item_id": _ids_ref(ITEM_MARKER)}),
    _event("response.create", optional={"response": RT_RESPONSE}),
    _event("response.create", optional={"response": RT_RESPONSE}),
    _event("response.cancel", optional={"response_id": _ids_ref(RESPONSE_OPEN_MARKER)}),
    _event("output_audio_buffer.clear"),
    _event(None, {"type": st.one_of(st.sampled_from(["no.such.event", "", "session.created", "response.done",
                                                     "transcription_session.update", "session.update ",
                                                     "SESSION.UPDATE", "input_audio_buffer.append.x"]), _junk())},
           {"session": RT_SESSION}),
    _event(None, optional={"session": RT_SESSION}),  # no type at all
]


@dataclass(frozen=True)
class Raw:
    """A frame that is no event: `kind` text (malformed JSON), json (a value that is not an
    object), binary, nested (JSON nested `size` deep), event_too_large (a text frame just over
    the front's max_event_bytes) or frame_too_large (just over max_frame_bytes: the socket closes, 1009)."""

    kind: str
    text: str = ""
    data: bytes = b""
    size: int = 0
    value: Any = None

    def __repr__(self) -> str:
        shown = {"text": repr(self.text[:80]), "json": repr(self.value)[:80], "binary": f"{len(self.data)} bytes"}
        return f"Raw({self.kind}, {shown.get(self.kind, self.size)})"


RT_MALFORMED = st.one_of(
    st.sampled_from(["{not json", "", " ", "{", "}", '{"type": "session.update"', '{"type": "session.update",}',
                     "NaN", "[1, 2", '{"type": "input_audio_buffer.append", "audio": "AAAA"} trailing',
                     '{"type": "\\ud800"}', "\x00", "9" * 5000, '{"type": 1e999}', "\ufeff{}",
                     '{"type": "response.create", "type": "session.update"}']),
    st.text(max_size=60),
)
RT_RAW = weighted([
    st.builds(Raw, st.just("text"), RT_MALFORMED),
    st.builds(Raw, st.just("text"), RT_MALFORMED),
    st.builds(lambda value: Raw("json", value=value), json_values(6).filter(lambda v: not isinstance(v, dict))),
    st.builds(lambda data: Raw("binary", data=data), st.one_of(st.binary(max_size=64), st.just(
        b'{"type": "input_audio_buffer.commit"}'))),
    # Nested `size // 2` deep (an odd size: in a session.update), about Python's recursion limit
    # (1000: serve's), and far beyond it first, where shrinking goes: Hypothesis raises the limit
    # while it runs a test, and an in-process server runs under it.
    st.builds(lambda n: Raw("nested", size=n), st.sampled_from([100000, 200001, 10, 1990, 2001, 2200, 4001])),
    st.builds(lambda n: Raw("event_too_large", size=n), st.integers(1, 4096)),
])
RT_FRAMES = weighted([*RT_EVENTS, *RT_EVENTS, *[RT_RAW] * 8])  # about one frame in seven is no event
RT_FRAME_TOO_LARGE = st.builds(lambda n: Raw("frame_too_large", size=n), st.integers(1, 4096))


@dataclass(frozen=True)
class RealtimeCase:
    credential: str  # see RT_CREDENTIALS
    junk: str  # a malformed Authorization header
    query: tuple[tuple[str, str], ...]
    frames: tuple[tuple[Any, int], ...]  # (an event (a dict), a Turn or a Raw; the pause before it in ms)
    ending: str  # close (the client's close frame) or drop (the TCP connection, at once)


RT_QUERY = st.builds(
    lambda model, intent, call: tuple(kv for kv in (("model", model), ("intent", intent), ("call_id", call))
                                      if kv[1] is not UNSET),
    weighted([st.just("gpt-realtime")] * 8 + [st.sampled_from(RT_MODELS), st.sampled_from(RT_BAD_MODELS),
                                              st.just(UNSET)]),
    weighted([st.just(UNSET)] * 10 + [st.just("transcription"), st.just("transcription"),
                                      st.sampled_from(["", "conversation", "TRANSCRIPTION", "x" * 100])]),
    weighted([st.just(UNSET)] * 30 + [st.sampled_from(["rtc_nope", "", "x"])]),
)
OPENAI_REALTIME = st.builds(
    RealtimeCase,
    st.sampled_from(RT_CREDENTIALS),
    header_values(60),
    RT_QUERY,
    st.lists(st.tuples(weighted([RT_FRAMES] * 150 + [RT_FRAME_TOO_LARGE]),
                       st.sampled_from([0, 0, 0, 0, 0, 5, 20, 50, 200, 600])), max_size=12).map(tuple),
    st.sampled_from(["close", "close", "close", "drop"]),
)


def _rt_handshake(target: Target, case: RealtimeCase) -> tuple[dict[str, str], list[str] | None]:
    """The case's headers and subprotocols."""
    key = {"wrong": "wrong-key-0123456789abcdef", "wrong_protocol": "wrong-key-0123456789abcdef"}.get(
        case.credential, target.token or "any-key")
    if case.credential == "bearer":
        return {"Authorization": f"Bearer {key}"}, None
    if case.credential == "wrong":
        return {"Authorization": f"Bearer {key}"}, None
    if case.credential == "malformed":
        return ({"Authorization": case.junk} if case.junk else {}), None
    if case.credential in ("protocol", "wrong_protocol"):
        return {}, ["realtime", f"openai-insecure-api-key.{key}"]
    if case.credential == "rtmedia_protocol":
        return {}, ["realtime", f"rtmedia.bearer.{key}"]
    if case.credential == "empty_protocol":
        return {}, ["realtime", "openai-insecure-api-key."]
    return {}, None


def _rt_expected(target: Target, case: RealtimeCase) -> int:
    """The handshake's answer the case must get: 101, or the status of its refusal."""
    from rtmedia.web.openai.realtime_config import REALTIME_MODELS

    query = dict(case.query)
    if target.token and case.credential not in ("bearer", "protocol", "rtmedia_protocol"):
        return 401
    if "call_id" in query:
        return 404
    intent = query.get("intent", "")
    if intent not in ("", "transcription"):
        return 400
    if intent != "transcription" and query.get("model", "rtmedia-realtime") not in REALTIME_MODELS:
        return 404
    return 101


def _resolve(value: Any, ids: dict[str, str]) -> Any:
    """An event with its markers replaced by the ids the socket has seen, and its audio encoded."""
    if isinstance(value, dict):
        return {k: _resolve(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, ids) for v in value]
    if isinstance(value, B64):
        return value.encode()
    if isinstance(value, str) and value in ids:
        return ids[value]
    return value


def _raw_frame(target: Target, raw: Raw) -> str | bytes:
    if raw.kind == "text":
        return raw.text
    if raw.kind == "json":
        return json.dumps(raw.value)
    if raw.kind == "binary":
        return raw.data
    if raw.kind == "nested":
        half = raw.size // 2
        return '{"type": "session.update", "session": ' + "[" * half + "]" * half + "}" if raw.size % 2 else \
            "[" * half + "]" * half
    limit = target.max_event_bytes if raw.kind == "event_too_large" else target.max_frame_bytes
    head, tail = '{"type": "input_audio_buffer.append", "audio": "', '"}'
    return head + "A" * (limit + raw.size - len(head) - len(tail)) + tail


class _Socket:
    """What a Realtime case has seen on its socket, judged event by event."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.ids: dict[str, str] = {ITEM_MARKER: "", RESPONSE_OPEN_MARKER: ""}
        self.event_ids: set[str] = set()
        self.sent_ids: set[str] = set()
        self.events = 0

    def problem(self, text: str) -> None:
        if len(self.outcome.problems) < 20:
            self.outcome.problems.append(text)

    def seen(self, message: str | bytes) -> None:
        self.events += 1
        if isinstance(message, bytes):
            self.problem(f"a binary frame from the server: {message[:80]!r}")
            return
        try:
            event = json.loads(message)
        except ValueError:
            self.problem(f"a server event that is not JSON: {message[:200]!r}")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str) or not event["type"]:
            self.problem(f"a server event without a string type: {message[:200]!r}")
            return
        kind, eid = event["type"], event.get("event_id")
        if not isinstance(eid, str) or not eid:
            self.problem(f"a {kind} event without an event_id: {message[:200]!r}")
        elif eid in self.event_ids:
            self.problem(f"a {kind} event repeats the event_id {eid!r}")
        else:
            self.event_ids.add(eid)
        if kind == "error":
            self._error(event, message)
        elif kind in ("conversation.item.added", "conversation.item.done", "conversation.item.retrieved"):
            item = event.get("item")
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                self.ids[ITEM_MARKER] = item["id"]
        elif kind == "input_audio_buffer.committed" and isinstance(event.get("item_id"), str):
            self.ids[ITEM_MARKER] = event["item_id"]
        elif kind == "response.created":
            response = event.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.ids[RESPONSE_OPEN_MARKER] = response["id"]
        elif kind == "response.done":
            response = event.get("response") if isinstance(event.get("response"), dict) else {}
            if response.get("status") == "failed":
                self.outcome.error_events["response.done/failed"] += 1
                self.problem(f"a response failed: {message[:300]}")
        elif kind == "conversation.item.input_audio_transcription.failed":
            error = event.get("error") if isinstance(event.get("error"), dict) else {}
            self.outcome.error_events[f"transcription.failed/{error.get('code')}"] += 1

    def _error(self, event: dict[str, Any], message: str) -> None:
        error = event.get("error")
        if not isinstance(error, dict) or not {"type", "code", "message", "param", "event_id"} <= error.keys() or \
                set(event) != {"type", "event_id", "error"}:
            self.problem(f"an error event not in the API's shape: {message[:300]}")
            return
        code = error["code"]
        self.outcome.error_events[str(code)] += 1
        if error["type"] == "server_error":
            self.problem(f"error event server_error ({code}): {str(error['message'])[:300]}")
        elif error["type"] != "invalid_request_error":
            self.problem(f"an error event of type {error['type']!r}: {message[:300]}")
        if not isinstance(code, str) or not code or not isinstance(error["message"], str) or not error["message"]:
            self.problem(f"an error event without a code or message: {message[:300]}")
        if error["param"] is not None and not isinstance(error["param"], str):
            self.problem(f"an error event whose param is not a string: {message[:300]}")
        ref = error["event_id"]
        if ref is not None and ref not in self.sent_ids:
            self.problem(f"an error event naming an event_id the client never sent ({str(ref)[:80]!r}): "
                         f"{message[:300]}")


def _rt_refused(outcome: Outcome, exc: Any, expected: int, case: RealtimeCase) -> None:
    status, body = exc.response.status_code, exc.response.body or b""
    parsed: Any = None
    with contextlib.suppress(ValueError):
        parsed = json.loads(body)
    reason = (parsed["error"].get("code") or parsed["error"]["type"]) if openai_error(parsed) else ""
    outcome.status(f"HTTP {status}", str(reason))
    where = f"GET {RT_PATH}?{'&'.join(f'{k}={v[:20]}' for k, v in case.query)} ({case.credential})"
    if not openai_error(parsed):
        outcome.problems.append(f"{where}: HTTP {status} without OpenAI's error object: {body[:300]!r}")
    if status >= 500 and (status != 503 or reason != "draining"):
        outcome.problems.append(f"{where}: HTTP {status}: {body[:300]!r}")
    elif status == 429 or status == 503:
        return  # capacity or draining: refused whatever the case was
    elif status != expected:
        outcome.problems.append(f"{where}: HTTP {status} ({reason}), expected "
                                f"{'the upgrade' if expected == 101 else expected}: {body[:300]!r}")


@door("openai_realtime", OPENAI_REALTIME, needs=["web", "openai"])
async def openai_realtime(target: Target, case: RealtimeCase) -> Outcome:
    """One `/v1/realtime` socket: the handshake, the case's frames, and the client's close (or
    its dropped connection), judged as the module docstring says and, for the events, as
    OpenAI's API has them (see _Socket)."""
    from urllib.parse import urlencode

    import websockets
    from websockets.asyncio.client import connect

    outcome = Outcome()
    headers, protocols = _rt_handshake(target, case)
    expected = _rt_expected(target, case)
    url = f"{target.web_url.replace('http', 'ws', 1)}{RT_PATH}?{urlencode(case.query)}"
    try:
        ws = await asyncio.wait_for(connect(url, additional_headers=headers, subprotocols=protocols, max_size=None,
                                            ping_interval=None, compression=None, close_timeout=CLOSE_S,
                                            open_timeout=END_S), END_S * 2)
    except websockets.InvalidStatus as exc:
        _rt_refused(outcome, exc, expected, case)
        return outcome
    except (TimeoutError, websockets.InvalidHandshake, OSError) as exc:
        outcome.status("WS handshake_failed")
        outcome.problems.append(f"the handshake failed: {type(exc).__name__}: {str(exc)[:300]}")
        return outcome
    outcome.status("WS 101")
    if expected != 101:
        outcome.problems.append(f"the handshake was answered 101, expected {expected} ({case.credential}, "
                                f"{case.query})")
    socket = _Socket(outcome)

    async def read() -> None:
        async for frame in ws:
            socket.seen(frame)

    reader = asyncio.ensure_future(read())
    try:
        await _rt_frames(target, case, ws, socket, reader, outcome)
    finally:
        if not reader.done():
            ws.transport.abort()
            reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
    # The front logs a failure of the socket's tasks after its session has ended (and, for a dropped
    # connection, after the client has gone): the case waits for that, so what it logs is its own.
    await settled(target.sessions, target.baseline_sessions, SETTLE_S)
    await asyncio.sleep(RT_LOG_GRACE_S)
    return outcome


async def _rt_turn(ws: Any, turn: Turn) -> bool:
    """Stream a spoken turn; False: the socket closed meanwhile."""
    import websockets

    for append in turn.appends():
        try:
            await ws.send(append)
        except websockets.ConnectionClosed:
            return False
        await asyncio.sleep(turn.chunk_ms / 1000 / turn.pace)
    return True


async def _rt_frames(target: Target, case: RealtimeCase, ws: Any, socket: _Socket, reader: asyncio.Future[None],
                     outcome: Outcome) -> None:
    import websockets

    too_large = lost = False
    for frame, pause_ms in case.frames:
        if pause_ms:
            await asyncio.sleep(pause_ms / 1000)
        if reader.done():
            break
        if isinstance(frame, Turn):
            if not await _rt_turn(ws, frame):
                lost = True
                break
            continue
        if isinstance(frame, Raw):
            data = _raw_frame(target, frame)
            too_large = frame.kind == "frame_too_large"
        else:
            event = _resolve(frame, socket.ids)
            if isinstance(event.get("event_id"), str):
                socket.sent_ids.add(event["event_id"])
            data = json.dumps(event)
        try:
            await ws.send(data)
        except websockets.ConnectionClosed:
            lost = True
            break
        if too_large:
            break
    if lost and not too_large:  # the send found the socket closed: the reader sees why
        await asyncio.wait([reader], timeout=CLOSE_S)
    if too_large:  # the front reads no frame that size: it closes the socket, 1009
        done, _ = await asyncio.wait([reader], timeout=CLOSE_S)
        code = ws.protocol.close_rcvd.code if ws.protocol.close_rcvd else None
        outcome.status("WS closed", str(code))
        if not done:
            outcome.problems.append(f"the socket stayed open {CLOSE_S:g} s after a frame over max_frame_bytes")
        elif code != 1009:
            outcome.problems.append(f"a frame over max_frame_bytes closed the socket with {code}, not 1009")
        return
    if reader.done():  # the server closed the socket: no client mistake may do that
        rcvd = ws.protocol.close_rcvd
        outcome.status("WS closed", str(rcvd.code if rcvd else None))
        error = reader.exception() if not reader.cancelled() else None
        outcome.problems.append(f"the server closed the socket before the client did: "
                                f"{rcvd if rcvd else 'no close frame'}"
                                f"{f' ({type(error).__name__})' if error else ''}")
        return
    if case.ending == "drop":
        ws.transport.abort()
        outcome.status("WS dropped")
        return
    started = time.monotonic()
    await ws.close()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait_for(asyncio.shield(reader), CLOSE_S)
    rcvd = ws.protocol.close_rcvd
    outcome.status("WS closed", str(rcvd.code if rcvd else None))
    if rcvd is None:
        outcome.problems.append(f"the server did not answer the client's close within "
                                f"{time.monotonic() - started:.1f} s")
    elif rcvd.code != 1000:
        outcome.problems.append(f"the server answered the client's close with {rcvd}")
    elif rcvd.reason or ws.protocol.close_rcvd_then_sent:  # its answer to a close has no reason
        outcome.problems.append(f"the server closed the socket itself ({rcvd}), not in answer to the client's close")
