"""The session of OpenAI's Realtime API (docs/openai.md#realtime) on an rtmedia `Converse` session.

`RealtimeConfig` is what a `/v1/realtime` client sees as its session: `session.update`'s
object is checked here against what rtmedia serves, and becomes the `SessionConfig` fields
the rtmedia session takes; `session_object()` is the API's session object that
`session.created` / `session.updated` carry. An update with a field rtmedia does not serve
(image input, MCP, other formats) is
refused whole with an error naming the field, and the session stays as it was, as OpenAI's
own server refuses an invalid update.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from rtmedia.protocol.turn_kinds import NONE, SEMANTIC_VAD, SERVER_VAD, VAD_TURNS
from rtmedia.v1 import common_pb2

INCLUDE_LOGPROBS = "item.input_audio_transcription.logprobs"
# The API's model names a session accepts; all are served by the same engines.
DEFAULT_MODEL = "rtmedia-realtime"
REALTIME_MODELS = (DEFAULT_MODEL, "gpt-realtime", "gpt-realtime-mini", "gpt-realtime-2025-08-28",
                   "gpt-4o-realtime-preview", "gpt-4o-mini-realtime-preview", "gpt-realtime-1.5",
                   "gpt-realtime-2", "gpt-realtime-2.1", "gpt-realtime-2.1-mini")
# "rtmedia-asr" and OpenAI's transcription models all name the server's recogniser (Whisper
# tiny.en unless it runs `--asr pocketsphinx`).
TRANSCRIPTION_MODELS = ("rtmedia-asr", "whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe",
                        "gpt-transcribe", "gpt-live-transcribe", "gpt-realtime-whisper")
RETIRED_MODELS = {"rtmedia-pocketsphinx": "rtmedia-asr"}  # old ids -> what replaced them


def unknown_model(model: Any, known: tuple[str, ...]) -> str:
    """Why `model` is refused: what replaced it, or the models there are."""
    if model in RETIRED_MODELS:
        return f"the model {model!r} was replaced by {RETIRED_MODELS[model]!r}, the server's recogniser"
    return f"the model {str(model)[:100]!r} does not exist here; models: {', '.join(known)}"


# OpenAI's built-in voices speak with the server's default voice; any other name is an rtmedia voice.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
# audio/pcm is 24 kHz PCM16; G.711 runs at 8 kHz.
FORMATS: dict[str, tuple[int, int]] = {
    "audio/pcm": (common_pb2.AUDIO_ENCODING_PCM16, 24000),
    "audio/pcmu": (common_pb2.AUDIO_ENCODING_G711_ULAW, 8000),
    "audio/pcma": (common_pb2.AUDIO_ENCODING_G711_ALAW, 8000),
}
ENCODINGS = {common_pb2.AUDIO_ENCODING_PCM16: "pcm16", common_pb2.AUDIO_ENCODING_G711_ULAW: "g711_ulaw",
             common_pb2.AUDIO_ENCODING_G711_ALAW: "g711_alaw"}  # canonical JSON's short names
SESSION_TTL_S = 3600  # OpenAI's sessions last an hour; so do rtmedia's by default (max_session_s)
MAX_SPEED = (0.25, 1.5)  # the API's bounds of audio.output.speed


class RealtimeError(Exception):
    """A client event the front refuses: the API's `error` event (`type`, `code`, `message`, `param`)."""

    def __init__(self, code: str, message: str, param: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.type = code, message, param, type


def refuse(param: str, what: str) -> RealtimeError:
    """The error for a field of the API that rtmedia does not serve."""
    return RealtimeError("unsupported_parameter", f"{param}: {what} is not served by rtmedia; the event was not "
                         "applied and the session goes on (docs/openai.md#realtime)", param)


def _invalid(param: str, message: str) -> RealtimeError:
    return RealtimeError("invalid_value", f"{param}: {message}", param)


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(param, f"must be an object, not {type(value).__name__}")
    return value


def _unknown(obj: dict[str, Any], known: set[str], prefix: str) -> None:
    for key in obj:
        if key not in known:
            raise RealtimeError("unknown_parameter", f"unknown parameter {prefix}{str(key)[:64]}", f"{prefix}{key}"[:200])


def _number(value: Any, param: str, low: float, high: float, whole: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or (whole and not float(value).is_integer()):
        raise _invalid(param, f"must be {'an integer' if whole else 'a number'}")
    if not low <= value <= high:  # NaN fails too
        raise _invalid(param, f"{value} is outside {low:g}..{high:g}")
    return value


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(param, "must be true or false")
    return value


def _noise_reduction(value: Any) -> str | None:
    """audio.input.noise_reduction: null (off) or {type: near_field | far_field}."""
    if value is None:
        return None
    param = "session.audio.input.noise_reduction"
    spec = _object(value, param)
    _unknown(spec, {"type"}, param + ".")
    if spec.get("type") not in ("near_field", "far_field"):
        raise _invalid(param + ".type", 'must be "near_field" or "far_field" (null turns it off)')
    return str(spec["type"])


def _include(value: Any) -> list[str]:
    """session.include: null, or a list of what the API may add to its events (logprobs only)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _invalid("session.include", "must be a list of strings")
    if unknown := [v for v in value if v != INCLUDE_LOGPROBS]:
        raise _invalid("session.include", f"{unknown[0][:64]!r} is not one of: {INCLUDE_LOGPROBS}")
    return sorted(set(value))


def _interruption(value: Any, param: str) -> dict[str, Any]:
    """turn_detection.interruption (an rtmedia extension, docs/protocol.md#interruptions), checked."""
    param += ".interruption"
    spec = _object(value, param)
    _unknown(spec, {"mode", "min_words", "min_speech_ms", "false_interruption_timeout_ms", "backchannels"}, param + ".")
    out: dict[str, Any] = {}
    if "mode" in spec:
        if spec["mode"] not in ("immediate", "confirmed"):
            raise _invalid(param + ".mode", 'must be "immediate" or "confirmed"')
        out["mode"] = spec["mode"]
    for name, (low, high) in {"min_words": (1, 20), "min_speech_ms": (200, 10000),
                              "false_interruption_timeout_ms": (100, 10000)}.items():
        if name in spec:
            out[name] = int(_number(spec[name], f"{param}.{name}", low, high, True))
    if "backchannels" in spec:
        phrases = spec["backchannels"]
        if not isinstance(phrases, list) or len(phrases) > 100 or \
                not all(isinstance(p, str) and p.strip() and len(p) <= 64 for p in phrases):
            raise _invalid(param + ".backchannels", "must be a list of at most 100 phrases of 1..64 characters")
        out["backchannels"] = phrases
    return out


def audio_format(value: Any, param: str) -> str:
    """The `type` of an audio format object the API allows and rtmedia serves."""
    fmt = _object(value, param)
    _unknown(fmt, {"type", "rate"}, param + ".")
    kind = fmt.get("type", "audio/pcm")
    if kind not in FORMATS:
        raise refuse(param + ".type", f"the format {str(kind)[:40]!r} (served: {', '.join(FORMATS)})")
    rate = fmt.get("rate")
    if rate is not None and rate != FORMATS[kind][1]:
        raise _invalid(param + ".rate", f"{kind} is {FORMATS[kind][1]} Hz; rate={rate!r} is not served")
    return kind


def max_tokens(value: Any, param: str) -> int:
    """`max_output_tokens`: 1..4096 or "inf"; rtmedia's 0 is "inf" (the server's ceiling)."""
    if value == "inf":
        return 0
    return int(_number(value, param, 1, 4096, whole=True))


def modality(value: Any, param: str) -> str:
    """`output_modalities`: ["audio"] (speech and its transcript) or ["text"]."""
    if not isinstance(value, list) or len(value) != 1 or value[0] not in ("audio", "text"):
        raise _invalid(param, 'must be ["audio"] or ["text"] (both at once are not allowed)')
    return value[0]


def tools_of(value: Any, param: str) -> list[dict[str, Any]]:
    """`session.tools`: function tools ({type: function, name, description, parameters}), in the
    API's form; MCP tools are refused. The server checks names and schemas."""
    if not isinstance(value, list):
        raise _invalid(param, "must be a list of tools")
    tools = []
    for n, tool in enumerate(value):
        at = f"{param}[{n}]"
        tool = _object(tool, at)
        if tool.get("type", "function") != "function":
            raise refuse(f"{at}.type", f"{str(tool.get('type'))[:32]} tools (function tools are served)")
        _unknown(tool, {"type", "name", "description", "parameters", "strict"}, at + ".")
        if not isinstance(tool.get("name"), str):
            raise _invalid(f"{at}.name", "must be a string")
        if not isinstance(tool.get("description", ""), str):
            raise _invalid(f"{at}.description", "must be a string")
        if not isinstance(tool.get("parameters", {}), dict):
            raise _invalid(f"{at}.parameters", "must be a JSON Schema object")
        tools.append({"type": "function", "name": tool["name"], "description": tool.get("description", ""),
                      "parameters": tool.get("parameters", {"type": "object", "properties": {}})})
    return tools


def tool_choice_of(value: Any, param: str) -> str | dict[str, str]:
    """`tool_choice`: "auto", "none", "required" or {type: function, name}."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str) \
            and set(value) <= {"type", "name"}:
        return {"type": "function", "name": value["name"]}
    if isinstance(value, dict) and value.get("type") == "mcp":
        raise refuse(param, "MCP tools")
    raise _invalid(param, 'must be "auto", "none", "required" or {"type": "function", "name": ...}')


def check_response_tools(response: dict[str, Any]) -> None:
    """A response's own tools: rtmedia offers a session's tools to each of its responses."""
    if response.get("tools") is not None:
        raise refuse("response.tools", "tools per response (set session.tools)")
    if response.get("tool_choice") is not None:
        raise refuse("response.tool_choice", "a tool choice per response (set session.tool_choice)")


@dataclass
class TurnDetection:
    """`audio.input.turn_detection`; None on the config means manual turns."""

    type: str = SERVER_VAD  # or SEMANTIC_VAD
    eagerness: str = "auto"  # semantic_vad
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    interruption: dict[str, Any] | None = None  # (rtmedia extension) as the client set it; None: immediate
    preemptive: bool | None = None  # (rtmedia extension) as the client set it; None: the default (on)

    def to_json(self) -> dict[str, Any]:
        extension = {k: v for k, v in (("interruption", self.interruption), ("preemptive", self.preemptive))
                     if v is not None}
        if self.type == SEMANTIC_VAD:
            return {"type": self.type, "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response, **extension}
        fields = dataclasses.asdict(self)
        del fields["eagerness"], fields["interruption"], fields["preemptive"]
        return {**fields, **extension}


@dataclass
class RealtimeConfig:
    """What a Realtime API client has set, in the API's terms."""

    id: str
    model: str
    type: str = "realtime"  # or "transcription"
    instructions: str = ""
    output_modality: str = "audio"
    max_output_tokens: int = 0  # 0: "inf"
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    voice: str = "alloy"
    speed: float = 1.0
    transcription: dict[str, Any] | None = None  # what the client set; None: no transcription events
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    expires_at: int = field(default_factory=lambda: int(time.time()) + SESSION_TTL_S)
    tools: list[dict[str, Any]] = field(default_factory=list)  # the API's function tools
    tool_choice: str | dict[str, str] = "auto"
    # (rtmedia extensions) the wait for a function call's output: the filler is off here unless
    # the session asks (clients written for OpenAI expect only the responses they create).
    tool_filler_ms: int = 0
    tool_timeout_ms: int = 10000
    include: list[str] = field(default_factory=list)  # [] or [INCLUDE_LOGPROBS]
    noise_reduction: str | None = None  # audio.input.noise_reduction.type; None: off
    # (rtmedia extension) `recording` as the client set it (docs/operations.md#recordings); None:
    # the server's default (recorded or not by how it runs)
    recording: bool | None = None
    recognizer: str = ""  # the server's recogniser's own name, a transcription model besides the aliases

    # ---- session.update -> rtmedia ------------------------------------------------------------------
    def updated(self, session: Any) -> RealtimeConfig:
        """This config with `session` (session.update's object) applied; RealtimeError names a bad field."""
        session = _object(session, "session")
        new = copy.deepcopy(self)
        kind = session.get("type", self.type)
        if kind not in ("realtime", "transcription"):
            raise _invalid("session.type", 'must be "realtime" or "transcription"')
        if kind != self.type:
            raise _invalid("session.type", f"this is a {self.type} session; its type cannot change")
        realtime = {"type", "model", "instructions", "output_modalities", "max_output_tokens", "audio", "tools",
                    "tool_choice", "tracing", "truncation", "include", "prompt", "parallel_tool_calls", "reasoning",
                    "tool_filler_ms", "tool_timeout_ms", "recording"}
        _unknown(session, realtime if kind == "realtime" else {"type", "audio", "include", "recording"}, "session.")
        if session.get("recording") is not None:
            new.recording = _bool(session["recording"], "session.recording")
        if "tools" in session:
            new.tools = tools_of(session["tools"] or [], "session.tools")
        if "tool_choice" in session:
            new.tool_choice = tool_choice_of(session["tool_choice"], "session.tool_choice")
        for name in ("tool_filler_ms", "tool_timeout_ms"):
            if name in session:
                setattr(new, name, int(_number(session[name], f"session.{name}", 0, 120000, whole=True)))
        if "include" in session:
            new.include = _include(session["include"])
        for name, what in (("tracing", "tracing"), ("prompt", "prompt templates"), ("reasoning", "reasoning")):
            if session.get(name) is not None:
                raise refuse(f"session.{name}", what)
        if session.get("truncation") not in (None, "auto"):
            raise refuse("session.truncation", "a truncation strategy other than auto")
        if "parallel_tool_calls" in session:
            _bool(session["parallel_tool_calls"], "session.parallel_tool_calls")
        if "model" in session:
            if session["model"] not in REALTIME_MODELS:
                raise RealtimeError("model_not_found", f"session.model: {str(session['model'])[:64]!r} is not a "
                                    f"model here; models: {', '.join(REALTIME_MODELS)}", "session.model")
            new.model = session["model"]
        if "instructions" in session:
            if not isinstance(session["instructions"], str):
                raise _invalid("session.instructions", "must be a string")
            new.instructions = session["instructions"]
        if "output_modalities" in session:
            new.output_modality = modality(session["output_modalities"], "session.output_modalities")
        if "max_output_tokens" in session:
            new.max_output_tokens = max_tokens(session["max_output_tokens"], "session.max_output_tokens")
        if "audio" in session:
            new._update_audio(_object(session["audio"], "session.audio"))
        return new

    def _update_audio(self, audio: dict[str, Any]) -> None:
        _unknown(audio, {"input", "output"} if self.type == "realtime" else {"input"}, "session.audio.")
        if "input" in audio:
            put = _object(audio["input"], "session.audio.input")
            _unknown(put, {"format", "transcription", "turn_detection", "noise_reduction"}, "session.audio.input.")
            if "format" in put:
                self.input_format = audio_format(put["format"], "session.audio.input.format")
            if "noise_reduction" in put:
                self.noise_reduction = _noise_reduction(put["noise_reduction"])
            if "transcription" in put:
                self.transcription = self._transcription(put["transcription"])
            if "turn_detection" in put:
                self.turn_detection = self._turn_detection(put["turn_detection"])
        if "output" in audio:
            out = _object(audio["output"], "session.audio.output")
            _unknown(out, {"format", "voice", "speed"}, "session.audio.output.")
            if "format" in out:
                self.output_format = audio_format(out["format"], "session.audio.output.format")
            if "voice" in out:
                if not isinstance(out["voice"], str) or not out["voice"]:
                    raise refuse("session.audio.output.voice", "a custom voice object")
                self.voice = out["voice"]
            if "speed" in out:
                self.speed = _number(out["speed"], "session.audio.output.speed", *MAX_SPEED)

    def _transcription(self, value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        param = "session.audio.input.transcription"
        spec = _object(value, param)
        _unknown(spec, {"model", "language", "prompt", "delay", "keywords", "languages"}, param + ".")
        model = spec.get("model", "whisper-1")
        models = (*TRANSCRIPTION_MODELS, self.recognizer) if self.recognizer else TRANSCRIPTION_MODELS
        if model not in models:
            raise RealtimeError("model_not_found", f"{param}.model: {unknown_model(model, models)}", param + ".model")
        if spec.get("language") is not None and not isinstance(spec["language"], str):
            raise _invalid(param + ".language", "must be a string (ISO 639-1, as \"en\" or \"fr\") or null")
        for name in ("prompt", "delay", "keywords", "languages"):
            if spec.get(name) not in (None, "", []):
                raise refuse(f"{param}.{name}", f"transcription {name}")
        return {"model": model, "language": spec.get("language"), "prompt": spec.get("prompt")}

    def _turn_detection(self, value: Any) -> TurnDetection | None:
        if value is None:
            return None
        param = "session.audio.input.turn_detection"
        spec = _object(value, param)
        kind = spec.get("type", SERVER_VAD)
        if kind not in VAD_TURNS:
            raise _invalid(param + ".type", f'must be "{SERVER_VAD}", "{SEMANTIC_VAD}" or null')
        if kind == SEMANTIC_VAD:
            _unknown(spec, {"type", "eagerness", "create_response", "interrupt_response", "interruption",
                            "preemptive"}, param + ".")
        else:
            _unknown(spec, {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                            "interrupt_response", "idle_timeout_ms", "interruption", "preemptive"}, param + ".")
        turn = copy.copy(self.turn_detection) if self.turn_detection is not None else TurnDetection()
        turn.type = kind
        if kind == SEMANTIC_VAD:
            turn.idle_timeout_ms = None
            eagerness = spec.get("eagerness", "auto")
            if eagerness not in ("low", "medium", "high", "auto"):
                raise _invalid(param + ".eagerness", 'must be "low", "medium", "high" or "auto"')
            turn.eagerness = eagerness
        if self.type == "transcription":
            turn.create_response = turn.interrupt_response = False
        bounds = {"threshold": (0.05, 0.95, False), "prefix_padding_ms": (0, 2000, True),
                  "silence_duration_ms": (100, 5000, True), "idle_timeout_ms": (5000, 30000, True)}
        for name, (low, high, whole) in bounds.items():
            if spec.get(name) is not None:
                number = _number(spec[name], f"{param}.{name}", low, high, whole)
                setattr(turn, name, int(number) if whole else float(number))
        for name in ("create_response", "interrupt_response"):
            if spec.get(name) is not None:
                if self.type == "transcription" and spec[name]:
                    raise _invalid(f"{param}.{name}", "a transcription session makes no responses")
                setattr(turn, name, _bool(spec[name], f"{param}.{name}"))
        if "idle_timeout_ms" in spec and spec["idle_timeout_ms"] is None:
            turn.idle_timeout_ms = None
        if spec.get("interruption") is not None:
            turn.interruption = {**(turn.interruption or {}), **_interruption(spec["interruption"], param)}
        if spec.get("preemptive") is not None:
            turn.preemptive = _bool(spec["preemptive"], f"{param}.preemptive")
        return turn

    def to_rtmedia(self) -> dict[str, Any]:
        """The whole config as rtmedia `SessionConfig` fields (session.update's `session`)."""
        encoding, rate = FORMATS[self.input_format]
        out_rate = FORMATS[self.output_format][1]
        turn: dict[str, Any] = {"type": NONE}
        if self.turn_detection is not None:
            t = self.turn_detection
            turn = {"type": t.type, "threshold": t.threshold, "prefix_padding_ms": t.prefix_padding_ms,
                    "silence_duration_ms": t.silence_duration_ms, "create_response": t.create_response,
                    "interrupt_response": t.interrupt_response}
            if t.type == SEMANTIC_VAD:
                turn["eagerness"] = t.eagerness
            else:
                turn["idle_timeout_ms"] = t.idle_timeout_ms or 0  # 0: off
            if t.interruption is not None:
                turn["interruption"] = t.interruption
            if t.preemptive is not None:
                turn["preemptive"] = t.preemptive
        config: dict[str, Any] = {
            "input_audio_format": {"encoding": ENCODINGS[encoding], "sample_rate": rate, "channels": 1},
            "output_sample_rate": out_rate,
            # rtmedia's responders answer the user's words: the session always transcribes, and the
            # front passes the transcription events on only when the client asked for them. The
            # server checks the language against its recogniser's (unsupported_language).
            "input_audio_transcription": {"enabled": True,
                                          "language": (self.transcription or {}).get("language") or ""},
            "noise_reduction": {"type": self.noise_reduction or ""},
            "turn_detection": turn,
            "instructions": self.instructions,
            "voice": "" if self.voice in OPENAI_VOICES else self.voice,
            "speed": self.speed,
        }
        if self.recording is not None:  # the server refuses what it cannot grant (param session.recording)
            config["recording"] = self.recording
        if self.type == "realtime":
            config["output_modality"] = self.output_modality
            config["max_output_tokens"] = self.max_output_tokens
            config["tools"] = {"functions": [{"name": t["name"], "description": t["description"],
                                              "parameters": json.dumps(t["parameters"])} for t in self.tools]}
            choice = self.tool_choice
            config["tool_choice"] = {"mode": choice} if isinstance(choice, str) else \
                {"mode": "function", "name": choice["name"]}
            config["tool_filler_ms"] = self.tool_filler_ms
            config["tool_timeout_ms"] = self.tool_timeout_ms
        return config

    # ---- rtmedia -> the API's session object ------------------------------------------------------------
    def session_object(self) -> dict[str, Any]:
        turn = self.turn_detection.to_json() if self.turn_detection is not None else None
        audio_in = {"format": self._format(self.input_format), "transcription": self.transcription,
                    "noise_reduction": {"type": self.noise_reduction} if self.noise_reduction else None,
                    "turn_detection": turn}
        if self.type == "transcription":
            return {"type": "transcription", "object": "realtime.transcription_session", "id": self.id,
                    "expires_at": self.expires_at, "audio": {"input": audio_in}, "include": self.include or None}
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
            "expires_at": self.expires_at, "output_modalities": [self.output_modality],
            "instructions": self.instructions,
            "audio": {"input": audio_in, "output": {"format": self._format(self.output_format), "voice": self.voice,
                                                    "speed": self.speed}},
            "tools": self.tools, "tool_choice": self.tool_choice, "tracing": None, "truncation": "auto", "prompt": None,
            "include": self.include or None, "max_output_tokens": self.max_output_tokens or "inf",
        }

    @staticmethod
    def _format(kind: str) -> dict[str, Any]:
        return {"type": kind, "rate": FORMATS[kind][1]} if kind == "audio/pcm" else {"type": kind}


def new_config(model: str = DEFAULT_MODEL, kind: str = "realtime", session: Any = None,
               recognizer: str = "") -> RealtimeConfig:
    """A new session's config: the defaults of its kind (`session`'s type where it names a valid
    one, else `kind`) and model, then `session` (session.update's object, as calls and client
    secrets take one) applied; RealtimeError names a bad field. `recognizer`: the server's
    recogniser's name (a transcription model too)."""
    if isinstance(session, dict):
        kind = session["type"] if session.get("type") in ("realtime", "transcription") else kind
        model = session["model"] if isinstance(session.get("model"), str) else model
    config = RealtimeConfig(id="sess_" + secrets.token_urlsafe(12), model=model, type=kind, recognizer=recognizer)
    if kind == "transcription":  # transcription sessions speak no replies and always transcribe
        config.turn_detection = TurnDetection(create_response=False, interrupt_response=False)
        config.transcription = {"model": "whisper-1", "language": None, "prompt": None}
    return config if session is None else config.updated(session)
