"""A session's effective configuration (docs/protocol.md#session-config): defaults, validated updates,
and the proto form that session.created / session.updated carry."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from rtmedia.engines.asr.contract import ENGLISH, language_code
from rtmedia.engines.responders.contract import FunctionTool, Message, ReplyRequest
from rtmedia.engines.tts.piper import MAX_SPEED, MIN_SPEED
from rtmedia.protocol.turn_kinds import MANUAL, NONE, SEMANTIC_VAD, SERVER_VAD, VAD_TURNS
from rtmedia.server.session.interruptions import BOUNDS as INTERRUPTION_BOUNDS
from rtmedia.server.session.interruptions import MAX_BACKCHANNEL_CHARS, MAX_BACKCHANNELS, MODES, Interruption
from rtmedia.v1 import common_pb2, realtime_pb2

PCM16 = common_pb2.AUDIO_ENCODING_PCM16
ULAW = common_pb2.AUDIO_ENCODING_G711_ULAW
ALAW = common_pb2.AUDIO_ENCODING_G711_ALAW
INPUT_RATES = {PCM16: (8000, 16000, 24000), ULAW: (8000,), ALAW: (8000,)}
TURN_TYPES = {
    realtime_pb2.TURN_DETECTION_TYPE_SERVER_VAD: SERVER_VAD,
    realtime_pb2.TURN_DETECTION_TYPE_MANUAL: MANUAL,
    realtime_pb2.TURN_DETECTION_TYPE_NONE: NONE,
    realtime_pb2.TURN_DETECTION_TYPE_SEMANTIC_VAD: SEMANTIC_VAD,
}
NOISE_REDUCTION = ("", "near_field", "far_field")  # engines/audio/denoise.py's kinds, "" off
EAGERNESS = {
    realtime_pb2.EAGERNESS_UNSPECIFIED: "auto",
    realtime_pb2.EAGERNESS_LOW: "low",
    realtime_pb2.EAGERNESS_MEDIUM: "medium",
    realtime_pb2.EAGERNESS_HIGH: "high",
    realtime_pb2.EAGERNESS_AUTO: "auto",
}
# semantic_vad: the silence before the first score, and the longest wait (default by eagerness).
SEMANTIC_BOUNDS = {"candidate_ms": (200, 2000), "max_wait_ms": (500, 30000)}
MAX_WAIT_MS = {"low": 8000, "medium": 4000, "high": 2000, "auto": 4000}
TURN_BOUNDS = {"threshold": (0.05, 0.95), "prefix_padding_ms": (0, 2000), "silence_duration_ms": (100, 5000)}
# turn_detection.idle_timeout_ms (server_vad only), as OpenAI bounds it; 0 in an update turns it off.
IDLE_TIMEOUT_MS_BOUNDS = (5000, 30000)
SESSION_BOUNDS = {"max_output_tokens": (1, 4096), "max_session_s": (1, 86400), "idle_timeout_s": (1, 86400)}
# Settings whose 0 means something else than a value in bounds: max_output_tokens 0 is "inf",
# up to the server's ceiling (the upper bound above).
ZERO_ALLOWED = {"max_output_tokens"}
OUTPUT_MODALITIES = ("audio", "text")
# Tools (docs/protocol.md#tools): at most MAX_TOOLS functions, each named by TOOL_NAME, its
# description and JSON Schema within these sizes.
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOL_DESCRIPTION_CHARS = 4096
MAX_TOOL_PARAMETERS_BYTES = 16 * 1024
TOOL_CHOICES = {
    realtime_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    realtime_pb2.TOOL_CHOICE_MODE_NONE: "none",
    realtime_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
    realtime_pb2.TOOL_CHOICE_MODE_FUNCTION: "function",
}
TOOL_TIMEOUT_MS_BOUNDS = (1000, 120000)
TOOL_FILLER_MS_BOUNDS = (100, 10000)  # or 0: off


def check_max_output_tokens(value: int, param: str = "max_output_tokens") -> None:
    """ConfigError unless `value` is 0 ("inf") or within SESSION_BOUNDS (session.update, response.create)."""
    low, high = SESSION_BOUNDS["max_output_tokens"]
    if value != 0 and not low <= value <= high:
        raise ConfigError(param, f"{param}={value} is outside {low}..{high} (or 0 for the server's ceiling, {high})")


def output_tokens(value: int) -> int:
    """The token limit a reply gets: `value`, or for 0 ("inf") the server's ceiling."""
    return value or SESSION_BOUNDS["max_output_tokens"][1]


def check_output_modality(value: str, param: str = "output_modality") -> None:
    if value not in OUTPUT_MODALITIES:
        raise ConfigError(param, f"{param} {value[:32]!r} must be \"audio\" or \"text\"")


class ConfigError(ValueError):
    """An invalid session setting; `param` names the field, `code` is the error event's."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class SessionSettings:
    input_encoding: int = PCM16
    input_rate: int = 24000
    output_rate: int = 0  # 0: the voice's native rate
    transcription: bool = True
    language: str = ""  # input_audio_transcription.language (ISO 639-1); "": detected, or English
    turn_type: str = SERVER_VAD
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    instructions: str = ""
    voice: str = ""
    responder: str = "llm"
    max_output_tokens: int = 256  # voice replies are short; 0: "inf" (output_tokens())
    max_session_s: int = 3600
    idle_timeout_s: int = 60
    idle_timeout_ms: int | None = None  # turn_detection.idle_timeout_ms (server_vad); None: off
    eagerness: str = "auto"  # semantic_vad: low, medium, high or auto (= medium)
    candidate_ms: int = 200  # semantic_vad: silence before the first score
    max_wait_ms: int | None = None  # semantic_vad: silence that ends a turn whatever the score; None: by eagerness
    output_modality: str = "audio"  # "audio" (speech and its text) or "text"
    speed: float = 1.0  # the replies' speaking rate (the TTS stream's length scale is divided by it)
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"  # "auto", "none", "required" or "function" (tool_function)
    tool_function: str = ""  # tool_choice "function": the function's name
    tool_timeout_ms: int = 10000  # a call unanswered this long ends with the server's apology
    tool_filler_ms: int = 800  # a call out this long gets a filler response; 0: off
    interruption: Interruption = field(default_factory=Interruption)  # turn_detection.interruption
    noise_reduction: str = ""  # "near_field", "far_field", or "" (off): the VAD hears the input denoised
    preemptive: bool = True  # turn_detection.preemptive: replies prepared at pauses (server/session/reply.py)
    # Recorded (server/observe/recording.py): True, False (a server that records on request), None (one
    # that records nothing: absent from session.created).
    recording: bool | None = None

    @property
    def input_format(self) -> tuple[int, int]:
        return self.input_encoding, self.input_rate

    @property
    def vad_turns(self) -> bool:
        """The VAD finds the turns (server_vad, semantic_vad)."""
        return self.turn_type in VAD_TURNS

    @property
    def turn_wait_ms(self) -> int:
        """semantic_vad: the silence after which a turn ends whatever its score."""
        return self.max_wait_ms or MAX_WAIT_MS[self.eagerness]

    def updated(self, config: realtime_pb2.SessionConfig, voices: dict[str, list[int]],
                responders: Collection[str], max_name_chars: int = 256,
                max_instructions_chars: int = 2000, caps: dict[str, int] | None = None,
                tool_responders: Collection[str] = (), languages: tuple[str, ...] = ENGLISH) -> SessionSettings:
        """The settings with `config`'s set fields applied; ConfigError names the first bad field.
        `voices` maps voice names (first: the default) to their supported output rates. A name
        (voice, responder) over `max_name_chars` or instructions over `max_instructions_chars`
        is refused without being echoed. `caps` lowers the upper bounds of SESSION_BOUNDS (the
        server's maxima: max_session_s, idle_timeout_s). `tool_responders`: the responders that
        can call functions (tools on any other are refused). `languages`: the recogniser's (ISO
        639-1); another input_audio_transcription.language is refused (unsupported_language)."""
        for name, limit in (("voice", max_name_chars), ("responder", max_name_chars),
                            ("instructions", max_instructions_chars)):
            if config.HasField(name) and len(getattr(config, name)) > limit:
                raise ConfigError(name, f"{name} has {len(getattr(config, name))} characters; the limit is {limit}")
        changes: dict[str, object] = {}
        if config.HasField("input_audio_format"):
            changes.update(self._input_format(config.input_audio_format))
        changes.update(_transcription_changes(config, languages))
        if config.HasField("turn_detection"):
            changes.update(_turn_changes(config.turn_detection))
            if config.turn_detection.HasField("interruption"):
                changes["interruption"] = _interruption(config.turn_detection.interruption, self.interruption)
        changes.update(_tool_changes(config))
        if config.HasField("recording"):  # the server's policy decides (Session.on_session_update)
            changes["recording"] = config.recording
        if config.HasField("noise_reduction"):
            kind = config.noise_reduction.type
            if kind not in NOISE_REDUCTION:
                raise ConfigError("noise_reduction.type", f"noise_reduction.type {kind[:40]!r} is not one of "
                                  f"{', '.join(NOISE_REDUCTION)} (or \"\": off)")
            changes["noise_reduction"] = kind
        changes.update(_scalar_changes(config))
        _check_bounds(changes, caps or {})
        if changes.get("turn_type", SERVER_VAD) != SERVER_VAD and "idle_timeout_ms" not in changes:
            changes["idle_timeout_ms"] = None  # it means nothing without server_vad
        result = dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        if result.idle_timeout_ms is not None and result.turn_type != SERVER_VAD:
            raise ConfigError("turn_detection.idle_timeout_ms", "turn_detection.idle_timeout_ms is for server_vad "
                                                               f"turn detection only, not {result.turn_type}")
        result._check_served(voices, responders, tool_responders)
        return result

    def _input_format(self, fmt: common_pb2.AudioFormat) -> dict[str, object]:
        """The input encoding and rate `fmt` asks for (an unset field keeps this session's, but
        a G.711 encoding's rate is 8 kHz unless given)."""
        encoding = fmt.encoding or self.input_encoding
        rate = fmt.sample_rate or (8000 if encoding != PCM16 else self.input_rate)
        if encoding not in INPUT_RATES:
            raise ConfigError("input_audio_format.encoding", f"input_audio_format.encoding={fmt.encoding} is not supported")
        if rate not in INPUT_RATES[encoding]:
            name = common_pb2.AudioEncoding.Name(encoding)
            allowed = ", ".join(map(str, INPUT_RATES[encoding]))
            raise ConfigError("input_audio_format.sample_rate",
                              f"input_audio_format.sample_rate={rate} is not supported for {name}; supported: {allowed}")
        if fmt.channels not in (0, 1):
            raise ConfigError("input_audio_format.channels",
                              f"input_audio_format.channels={fmt.channels}: only mono input is accepted")
        return {"input_encoding": encoding, "input_rate": rate}

    def _check_served(self, voices: dict[str, list[int]], responders: Collection[str],
                      tool_responders: Collection[str]) -> None:
        """ConfigError unless this server serves the settings' voice at their output rate, their
        responder, and their tools (a responder that can call functions; a named tool_choice)."""
        voice = self.voice or next(iter(voices))
        if voice not in voices:
            raise ConfigError("voice", f"voice {self.voice!r} is not known; voices: {', '.join(sorted(voices))}")
        if self.output_rate and self.output_rate not in voices[voice]:
            rates = ", ".join(map(str, voices[voice]))
            raise ConfigError("output_sample_rate", f"sample_rate={self.output_rate} is not supported by voice "
                                                    f"{voice}; supported rates: {rates}")
        if self.responder not in responders:
            raise ConfigError("responder", f"responder {self.responder!r} is not available; "
                                           f"available: {', '.join(sorted(responders))}")
        if self.tools and self.responder not in tool_responders:
            able = ", ".join(sorted(tool_responders)) or "none on this server"
            raise ConfigError("tools", f"the {self.responder} responder cannot call functions; the session goes "
                                       f"on without tools (responders that can: {able})")
        if self.tool_choice == "function" and self.tool_function not in {t.name for t in self.tools}:
            raise ConfigError("tool_choice.name", f"tool_choice names {self.tool_function[:64]!r}, which is not "
                                                  "one of the session's tools")

    def to_proto(self) -> realtime_pb2.SessionConfig:
        turn_type = next(k for k, v in TURN_TYPES.items() if v == self.turn_type)
        return realtime_pb2.SessionConfig(
            input_audio_format=common_pb2.AudioFormat(encoding=self.input_encoding, sample_rate=self.input_rate,
                                                      channels=1),
            output_sample_rate=self.output_rate,
            input_audio_transcription=realtime_pb2.InputAudioTranscription(enabled=self.transcription,
                                                                           language=self.language),
            turn_detection=realtime_pb2.TurnDetection(
                type=turn_type, threshold=self.threshold, prefix_padding_ms=self.prefix_padding_ms,
                silence_duration_ms=self.silence_duration_ms, create_response=self.create_response,
                interrupt_response=self.interrupt_response, idle_timeout_ms=self.idle_timeout_ms,
                eagerness=next(k for k, v in EAGERNESS.items() if v == self.eagerness and k),
                candidate_ms=self.candidate_ms, max_wait_ms=self.turn_wait_ms, preemptive=self.preemptive,
                interruption=realtime_pb2.Interruption(
                    mode=self.interruption.mode, min_words=self.interruption.min_words,
                    min_speech_ms=self.interruption.min_speech_ms,
                    false_interruption_timeout_ms=self.interruption.false_interruption_timeout_ms,
                    backchannels=self.interruption.backchannels),
            ),
            instructions=self.instructions, voice=self.voice, responder=self.responder,
            max_output_tokens=self.max_output_tokens, max_session_s=self.max_session_s,
            idle_timeout_s=self.idle_timeout_s, output_modality=self.output_modality, speed=self.speed,
            tools=realtime_pb2.Tools(functions=[
                realtime_pb2.FunctionTool(name=t.name, description=t.description, parameters=json.dumps(t.parameters))
                for t in self.tools]),
            tool_choice=realtime_pb2.ToolChoice(
                mode=next(k for k, v in TOOL_CHOICES.items() if v == self.tool_choice), name=self.tool_function),
            tool_timeout_ms=self.tool_timeout_ms, tool_filler_ms=self.tool_filler_ms,
            noise_reduction=realtime_pb2.NoiseReduction(type=self.noise_reduction),
            recording=self.recording,
        )


def _transcription_changes(config: realtime_pb2.SessionConfig, languages: tuple[str, ...]) -> dict[str, object]:
    """input_audio_transcription's set fields: enabled, and a language the recogniser knows."""
    changes: dict[str, object] = {}
    if config.HasField("input_audio_transcription") and config.input_audio_transcription.HasField("enabled"):
        changes["transcription"] = config.input_audio_transcription.enabled
    if config.HasField("input_audio_transcription") and config.input_audio_transcription.HasField("language"):
        param = "input_audio_transcription.language"
        try:
            changes["language"] = language_code(config.input_audio_transcription.language, languages, param)
        except ValueError as exc:
            raise ConfigError(param, str(exc), "unsupported_language") from None
    return changes


def _scalar_changes(config: realtime_pb2.SessionConfig) -> dict[str, object]:
    """The set scalar fields (instructions, voice, ... speed), those with a range of their own checked."""
    changes: dict[str, object] = {}
    for name in ("instructions", "voice", "responder", "output_sample_rate", "max_output_tokens",
                 "max_session_s", "idle_timeout_s", "output_modality", "speed"):
        if config.HasField(name):
            changes["output_rate" if name == "output_sample_rate" else name] = getattr(config, name)
    if "max_output_tokens" in changes:
        check_max_output_tokens(changes["max_output_tokens"])  # type: ignore[arg-type]
    if "output_modality" in changes:
        check_output_modality(changes["output_modality"])  # type: ignore[arg-type]
    if "speed" in changes and not MIN_SPEED <= changes["speed"] <= MAX_SPEED:  # type: ignore[operator]
        raise ConfigError("speed", f"speed={changes['speed']:.4g} is outside {MIN_SPEED:g}..{MAX_SPEED:g}")
    return changes


def _check_bounds(changes: dict[str, object], caps: dict[str, int]) -> None:
    """ConfigError for the first change outside SESSION_BOUNDS, whose upper bounds `caps` lowers."""
    for name, (low, high) in SESSION_BOUNDS.items():
        value, cap = changes.get(name), caps.get(name, high)
        if name in ZERO_ALLOWED or value is None:
            continue
        if not low <= value <= min(high, cap):  # type: ignore[operator]
            limit = " (the server's maximum)" if cap < high else ""
            raise ConfigError(name, f"{name}={value} is outside {low}..{min(high, cap)}{limit}")


def _turn_changes(turn: realtime_pb2.TurnDetection) -> dict[str, object]:
    changes: dict[str, object] = {}
    if turn.type:
        if turn.type not in TURN_TYPES:
            raise ConfigError("turn_detection.type", f"turn_detection.type={turn.type} is not a turn detection type")
        changes["turn_type"] = TURN_TYPES[turn.type]
    for name, (low, high) in TURN_BOUNDS.items():
        if turn.HasField(name):
            value = getattr(turn, name)
            if not low <= value <= high:
                shown = round(value, 4) if isinstance(value, float) else value
                raise ConfigError(f"turn_detection.{name}", f"turn_detection.{name}={shown} is outside {low}..{high}")
            changes[name] = value
    for name in ("create_response", "interrupt_response", "preemptive"):
        if turn.HasField(name):
            changes[name] = getattr(turn, name)
    if turn.HasField("idle_timeout_ms"):
        value = turn.idle_timeout_ms
        low, high = IDLE_TIMEOUT_MS_BOUNDS
        if value != 0 and not low <= value <= high:
            raise ConfigError("turn_detection.idle_timeout_ms", f"turn_detection.idle_timeout_ms={value} is outside "
                                                               f"{low}..{high} (0 turns it off)")
        changes["idle_timeout_ms"] = value or None
    if turn.HasField("eagerness"):
        if turn.eagerness not in EAGERNESS:
            raise ConfigError("turn_detection.eagerness", f"turn_detection.eagerness={turn.eagerness} is not an "
                                                         "eagerness (low, medium, high, auto)")
        changes["eagerness"] = EAGERNESS[turn.eagerness]
    for name, (low, high) in SEMANTIC_BOUNDS.items():
        if turn.HasField(name):
            value = getattr(turn, name)
            if not low <= value <= high:
                raise ConfigError(f"turn_detection.{name}", f"turn_detection.{name}={value} is outside {low}..{high}")
            changes[name] = value
    return changes


def _interruption(config: realtime_pb2.Interruption, current: Interruption) -> Interruption:
    """turn_detection.interruption applied to `current`; ConfigError names a bad field."""
    changes: dict[str, object] = {}
    if config.HasField("mode"):
        if config.mode not in MODES:
            raise ConfigError("turn_detection.interruption.mode", f"turn_detection.interruption.mode "
                              f"{config.mode[:40]!r} is not one of {', '.join(MODES)}")
        changes["mode"] = config.mode
    for name, (low, high) in INTERRUPTION_BOUNDS.items():
        if config.HasField(name):
            value = getattr(config, name)
            if not low <= value <= high:
                raise ConfigError(f"turn_detection.interruption.{name}",
                                  f"turn_detection.interruption.{name}={value} is outside {low}..{high}")
            changes[name] = value
    if config.backchannels:
        phrases = tuple(config.backchannels)
        if len(phrases) > MAX_BACKCHANNELS:
            raise ConfigError("turn_detection.interruption.backchannels", f"turn_detection.interruption.backchannels "
                              f"has {len(phrases)} phrases; the limit is {MAX_BACKCHANNELS}")
        for n, phrase in enumerate(phrases):
            if not phrase.strip() or len(phrase) > MAX_BACKCHANNEL_CHARS:
                raise ConfigError(f"turn_detection.interruption.backchannels[{n}]",
                                  f"turn_detection.interruption.backchannels[{n}] must be 1..{MAX_BACKCHANNEL_CHARS} "
                                  "characters of words")
        changes["backchannels"] = phrases
    return dataclasses.replace(current, **changes)  # type: ignore[arg-type]


def _tool_changes(config: realtime_pb2.SessionConfig) -> dict[str, object]:
    """tools, tool_choice, tool_timeout_ms and tool_filler_ms of a session.update, checked."""
    changes: dict[str, object] = {}
    if config.HasField("tools"):
        functions = config.tools.functions
        if len(functions) > MAX_TOOLS:
            raise ConfigError("tools", f"tools has {len(functions)} functions; the limit is {MAX_TOOLS}")
        tools: list[FunctionTool] = []
        for n, function in enumerate(functions):
            tools.append(_tool(function, f"tools.functions[{n}]"))
            if function.name in {t.name for t in tools[:-1]}:
                raise ConfigError(f"tools.functions[{n}].name", f"tools: {function.name!r} is declared twice")
        changes["tools"] = tuple(tools)
    if config.HasField("tool_choice"):
        choice = config.tool_choice
        if choice.mode not in TOOL_CHOICES:
            raise ConfigError("tool_choice.mode", f"tool_choice.mode={choice.mode} is not a tool choice")
        if (choice.mode == realtime_pb2.TOOL_CHOICE_MODE_FUNCTION) != bool(choice.name):
            raise ConfigError("tool_choice.name", "tool_choice.name names the function for mode function, and only "
                                                  "then")
        changes.update(tool_choice=TOOL_CHOICES[choice.mode], tool_function=choice.name)
    for name, (low, high), off in (("tool_timeout_ms", TOOL_TIMEOUT_MS_BOUNDS, False),
                                   ("tool_filler_ms", TOOL_FILLER_MS_BOUNDS, True)):
        if config.HasField(name):
            value = getattr(config, name)
            if not (low <= value <= high or (off and value == 0)):
                raise ConfigError(name, f"{name}={value} is outside {low}..{high}" + (" (or 0: off)" if off else ""))
            changes[name] = value
    return changes


def _tool(function: realtime_pb2.FunctionTool, param: str) -> FunctionTool:
    if not TOOL_NAME.fullmatch(function.name):
        raise ConfigError(f"{param}.name", f"{param}.name {function.name[:80]!r} must be 1..64 letters, digits, "
                                           "'_' or '-'")
    if len(function.description) > MAX_TOOL_DESCRIPTION_CHARS:
        raise ConfigError(f"{param}.description", f"{param}.description has {len(function.description)} characters; "
                                                  f"the limit is {MAX_TOOL_DESCRIPTION_CHARS}")
    if not function.parameters:
        return FunctionTool(function.name, function.description)
    if len(function.parameters.encode()) > MAX_TOOL_PARAMETERS_BYTES:
        raise ConfigError(f"{param}.parameters", f"{param}.parameters is over {MAX_TOOL_PARAMETERS_BYTES} bytes")
    try:
        schema = json.loads(function.parameters)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{param}.parameters", f"{param}.parameters is not JSON: {str(exc)[:120]}") from None
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ConfigError(f"{param}.parameters", f"{param}.parameters must be a JSON Schema of an object "
                                                 "(\"type\": \"object\")")
    return FunctionTool(function.name, function.description, schema)


def reply_request(settings: SessionSettings, history: list[Message], camera: Iterable[bytes], conversation: str,
                  instructions: str | None = None, max_tokens: int | None = None,
                  said: Message | None = None) -> ReplyRequest:
    """What the responder gets: the history's messages that hold words (a turn in which
    nothing was recognised is an item, but no message), then `said` (a preemptive reply's
    words so far), the instructions and token limit (0, "inf": the server's ceiling), the
    camera's frames, the tools."""
    kept = [m for m in history if m.text or m.call is not None or m.role == "tool"]
    return ReplyRequest(
        history=[*kept, said] if said is not None else kept,
        instructions=settings.instructions if instructions is None else instructions,
        max_output_tokens=output_tokens(settings.max_output_tokens if max_tokens is None else max_tokens),
        images=list(camera),
        conversation=conversation,
        tools=settings.tools,
        tool_choice=settings.tool_function if settings.tool_choice == "function" else settings.tool_choice,
    )
