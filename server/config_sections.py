"""The server's settings sections (rtmedia.protocol.settings): each field once, with its default,
its `serve` flag's help and its checks; `server/config.py` composes them with the web front's
sections into ServerConfig. The flat keys (`asr_threads`) are the deploy file's `server:` keys."""

from __future__ import annotations

from dataclasses import dataclass

from rtmedia.engines.asr.registry import RECOGNIZERS
from rtmedia.engines.tts.piper_bf16 import PRECISIONS
from rtmedia.protocol.settings import Section, positive_int, setting
from rtmedia.protocol.turn_kinds import SERVER_VAD, VAD_TURNS
from rtmedia.server.session.limits import Limits

MiB = 1024 * 1024

# The recognisers by name (engines/asr/registry.py), live: one registered later is a choice too.
ASR_ENGINES = RECOGNIZERS
ASR_BACKENDS = ("auto", "ct2", "torch")
SYNTHETIC_SIZES = ("tiny", "0.5b", "1b", "7b")  # engines/lm/synthetic.py SHAPES (not imported: no torch here)
# The longest one engine step of each lane may run, in seconds (docs/operations.md#engine-faults-and-health):
# far above a step's usual time on a loaded CPU, so only a stuck step reaches it. `lane_step_deadlines_s`
# overrides them per lane (0: no deadline). An LM lane's step is a prefill (of up to lm_context tokens: a
# local `transformers` model may be large for a CPU) or one decode step; a video step decodes one latent
# frame, which at the largest frame the limits admit takes long on a CPU.
STEP_DEADLINES_S: dict[str, float] = {
    "vad": 5.0, "turn_audio": 10.0, "asr": 30.0, "asr_final": 30.0, "tts": 30.0, "video": 300.0, "llm": 60.0,
    "transformers": 120.0,
}
POSITIVE = "{key} must be a positive number, got {value!r}"


@dataclass
class NetworkSettings(Section):
    """The gRPC port, the metrics endpoint, message bounds, draining and the Riva API."""

    TITLE = "network: the gRPC port, metrics, draining"
    host: str = setting("127.0.0.1", help="address to bind (default 127.0.0.1)")
    port: int = setting(50051, help="gRPC port (default 50051; 0 picks a free one)")
    metrics_port: int = setting(9464, help="Prometheus port (default 9464; 0 disables)")
    metrics_host: str = setting("127.0.0.1", help="address the metrics endpoint binds (default 127.0.0.1)")
    grace_s: float = setting(30.0, flags=("--grace",), help="drain grace period in seconds (30)")
    # After SIGTERM, health and /readyz say not serving at once while new sessions are still admitted this
    # long (0 on Kubernetes, where a preStop hook does the same).
    drain_delay_s: float = setting(
        0.0, flags=("--drain-delay",), metavar="S",
        help="after SIGTERM, say not ready at once but admit new sessions for S more seconds, so a "
             "proxy polling readiness stops routing here first (0)")
    replica_name: str = setting("", metavar="NAME",
                                help="sent as rtmedia-replica metadata on each session (default: the host name)")
    max_receive_bytes: int = setting(8 * MiB, low=1, metavar="BYTES", help="largest message received (8 MiB)")
    max_send_bytes: int = setting(4 * MiB, low=1, metavar="BYTES", help="largest message sent (4 MiB)")
    # HTTP/2 flow-control window per stream (0: grpc's adaptive window, tens of MiB per stream).
    stream_window_bytes: int = setting(1 * MiB, low=0, metavar="BYTES",
                                       help="HTTP/2 flow-control window per stream (1 MiB; 0: grpc's adaptive one)")
    max_text_chars: int = setting(5000, low=1, metavar="N", help="characters of one Synthesize text (5000)")
    riva: bool = setting(True, flags=("--no-riva",),
                         help="do not serve NVIDIA Riva's speech API (nvidia.riva.asr / nvidia.riva.tts)")

    def check(self) -> None:
        if not 0 <= self.drain_delay_s <= self.grace_s:
            raise ValueError(f"drain_delay_s must be within 0..grace_s ({self.grace_s:g}), got {self.drain_delay_s:g}")


@dataclass
class AuthSettings(Section):
    """TLS on the gRPC port and the bearer tokens (both reloaded on SIGHUP)."""

    TITLE = "auth: TLS and tokens"
    tls_cert: str | None = setting(None, metavar="FILE",
                                   help="PEM certificate chain: serve gRPC over TLS (with --tls-key; reloaded on SIGHUP)")
    tls_key: str | None = setting(None, metavar="FILE", help="PEM private key of --tls-cert")
    tls_client_ca: str | None = setting(None, metavar="FILE",
                                        help="PEM CA bundle: require client certificates that chain to it (mutual TLS)")
    auth_tokens: str | None = setting(
        None, metavar="FILE",
        help="bearer tokens, one per line with an optional name and quotas (docs/operations.md); "
             "default: RTMEDIA_AUTH_TOKENS, else no authentication; reloaded on SIGHUP")

    def check(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (--tls-cert and --tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")


@dataclass
class AsrSettings(Section):
    """The recogniser: Whisper (engines/asr/whisper.py) or PocketSphinx (its workers and decoders)."""

    PREFIX = "asr_"
    TITLE = "asr: the recogniser"
    engine: str = setting("whisper", key="asr", choices=ASR_ENGINES,
                          help="the recogniser: Whisper tiny.en on CTranslate2 (whisper, the default) or pocketsphinx")
    model: str = setting("", metavar="DIR",
                         help="Whisper: a CTranslate2 (faster-whisper) or transformers Whisper directory "
                              "(default: the embedded tiny.en)")
    backend: str = setting("auto", choices=ASR_BACKENDS,
                           help="Whisper's runtime: CTranslate2 or torch (auto: torch on CUDA, else ct2)")
    compute_type: str = setting(
        "", metavar="TYPE",
        help="Whisper's precision (ct2: int8, int8_float16, float16, float32, ...; torch: float32, "
             "float16, bfloat16, int8 on a CPU); default: the runtime's on the device")
    max_graphs: int = setting(48, low=0, metavar="N", message="{key} must be 0 or more, got {value}",
                              help="Whisper on torch and CUDA: CUDA graphs captured at most (48)")
    threads: int = setting(1, help="Whisper: cores one decode batch uses (1)")
    parallel: int = setting(2, help="Whisper: decode batches that run at once, each on its share of the streams (2)")
    workers: int = setting(2, help="PocketSphinx worker processes (2)")
    # Fast-final decoders built per worker at start (10 per worker: 20 sessions speaking at once).
    decoders: int = setting(10, help="fast PocketSphinx decoders each ASR worker builds at start (10)")
    # A server_vad turn's utterance ends at each pause, so its final is ready when the turn ends.
    early_finals: bool = setting(True, key="early_finals", flags=("--no-early-finals",),
                                 help="end a recogniser utterance at speech_stopped, not at each pause")

    def check(self) -> None:
        if self.engine != "whisper" and (self.model or self.backend != "auto" or self.compute_type):
            raise ValueError("asr_model, asr_backend and asr_compute_type are Whisper's: they need asr whisper")
        if self.threads < 1 or self.parallel < 1:
            raise ValueError(f"asr_threads and asr_parallel must be at least 1, got {self.threads} and "
                             f"{self.parallel}")


@dataclass
class VadSettings(Section):
    """Voice activity detection."""

    PREFIX = "vad_"
    TITLE = "vad: voice activity detection"
    threads: int = setting(2, low=1, help="concurrent onnxruntime runs one VAD tick's batch is split over (2)")
    noise_reduction: str = setting(
        "off", key="noise_reduction", choices=("off", "near_field", "far_field"),
        message="{key} must be off, near_field or far_field, got {value!r}",
        help="new sessions' noise suppression for the VAD (off; a session may set its own)")


def _thresholds_ok(values: object) -> bool:
    return isinstance(values, list | tuple) and len(values) == 3 \
        and all(isinstance(v, int | float) and -12 <= v <= 0 for v in values) and values[0] >= values[1] >= values[2]


@dataclass
class TurnSettings(Section):
    """Turn detection a session gets unless it asks for another (docs/protocol.md#semantic-vad)."""

    PREFIX = "turn_"
    TITLE = "turn: turn detection"
    detection: str = setting(SERVER_VAD, choices=VAD_TURNS,
                             message="{key} must be server_vad or semantic_vad, got {value!r}",
                             help="a session's turn detection unless it asks for another (default server_vad); "
                                  "semantic_vad needs the LM")
    eagerness: str = setting("auto", flags=("--eagerness",), choices=("low", "medium", "high", "auto"),
                             message="{key} must be low, medium, high or auto, got {value!r}",
                             help="semantic_vad's default eagerness (auto = medium)")
    audio_model: str | None = setting(
        None, metavar="smart-turn|FILE",
        help="semantic_vad also hears the pause: Smart Turn v3.2 from the pipecat-ai wheel, or an ONNX "
             "file of its contract (input_features [batch, 80, 800] -> logits [batch, 1]); default: off")
    # log10 P(finished) by eagerness, each [before 600 ms, from 600 ms, from 1.5 s of silence].
    semantic_thresholds: dict[str, list[float]] = setting(
        factory=dict, key="semantic_thresholds", flags=("--semantic-threshold",), kind="map_floats",
        metavar="EAGERNESS=A,B,C",
        help="semantic_vad's thresholds of one eagerness (repeatable; log10 P(finished), before 600 ms, "
             "from 600 ms, from 1.5 s of silence)")

    def check(self) -> None:
        if not isinstance(self.semantic_thresholds, dict):
            raise ValueError(f"semantic_thresholds must map eagernesses to three thresholds, got "
                             f"{self.semantic_thresholds!r}")
        for eagerness, values in self.semantic_thresholds.items():
            if eagerness not in ("low", "medium", "high") or not _thresholds_ok(values):
                raise ValueError(f"semantic_thresholds: {eagerness}={values!r} must be low, medium or high with three "
                                 "thresholds in -12..0, none above the one before")


@dataclass
class TtsSettings(Section):
    """Piper text-to-speech (engines/tts/piper.py)."""

    PREFIX = "tts_"
    TITLE = "tts: speech synthesis"
    # 0: one thread per core for a synthesis that starts alone, one beside another (BENCHMARKS.md).
    threads: int = setting(0, low=0, metavar="N", help="onnxruntime threads per synthesis (0: by what runs beside)")
    concurrency: int = setting(2, low=1, metavar="N", help="syntheses that run at once (2)")
    precision: str = setting("auto", choices=PRECISIONS,
                             help="Piper's decoder: auto (bfloat16 on OpenVINO where the CPU has it natively), "
                                  "fp32 or bf16")
    voices: list[str] = setting(factory=list, key="voices", flags=("--voice",),
                                help="extra Piper voice: a local .onnx with .onnx.json beside it (repeatable)")


@dataclass
class LmSettings(Section):
    """The language models and the default responder."""

    PREFIX = "lm_"
    TITLE = "lm: language models and responders"
    default_responder: str = setting("llm", key="default_responder", flags=("--responder",),
                                     help="default responder of a session: llm (default), echo, transformers, openai")
    llm: bool = setting(True, key="llm", flags=("--no-llm",),
                        help="do not load the embedded SmolLM2-135M-Instruct (responder llm)")
    transformers_model: str | None = setting(None, key="transformers_model", metavar="DIR",
                                             help="a local Hugging Face causal-LM directory, offered as responder "
                                                  "transformers")
    slots: int = setting(16, help="LM KV-cache slots shared by sessions (16)")
    context: int = setting(2048, low=1, metavar="TOKENS", help="tokens of KV cache per slot, prompt and reply (2048)")
    threads: int = setting(1, low=1, metavar="N", help="torch threads for the LM (process-wide; 1)")
    quantize: str = setting("auto", kind="str", cli_choices=("auto", "int8", "none"),
                            help="LM linear layers as per-row int8 matmuls (int8: CPU only) or in the model's dtype "
                                 "(none); auto (default): int8 on the CPU, none on CUDA")
    batch_sizes: list[int] = setting(factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128], metavar="N,N,...",
                                     help="LM decode batch sizes, each captured as a CUDA graph at warm-up on a GPU "
                                          "(1,2,4,8,16,32,64,128; capped at --lm-slots)")
    synthetic_lm: str | None = setting(
        None, key="synthetic_lm", cli_choices=SYNTHETIC_SIZES, metavar="SIZE",
        help="CAPACITY RUNS ONLY: build the llm lane on a Llama of this shape (tiny, 0.5b, 1b, 7b) "
             "with RANDOM weights instead of the embedded SmolLM2; every step costs what that "
             "model costs, and every reply is gibberish that runs to its token limit")


@dataclass
class OpenAiSettings(Section):
    """An OpenAI-compatible chat-completions server (responder openai; key from OPENAI_API_KEY)."""

    PREFIX = "openai_"
    TITLE = "openai: an OpenAI-compatible responder"
    url: str | None = setting(None, metavar="URL",
                              help="an OpenAI-compatible chat-completions base URL (e.g. http://host:8000/v1), "
                                   "offered as responder openai; the key is read from OPENAI_API_KEY")
    model: str = setting("gpt-4o-mini", help="the model name sent to --openai-url")


@dataclass
class ComputeSettings(Section):
    """Where the LM and video engines run, and CUDA-graph admission (docs/architecture.md#cuda-graph-runner)."""

    TITLE = "compute: device and CUDA graphs"
    device: str = setting("auto", metavar="auto|cpu|cuda",
                          help="where the LM and video engines run: auto (default: CUDA when torch sees a GPU), cpu, "
                               "cuda or cuda:N; on CUDA the LMs run in bfloat16 with CUDA-graph decode")
    cuda_graphs: bool = setting(True, flags=("--no-cuda-graphs",),
                                help="run every engine step eagerly (no CUDA-graph capture)")
    max_graphs: int = setting(4, help="CUDA graphs admitted per engine beyond the LM's warm-up ones "
                                      "(4; 0 disables admission)")
    min_free_bytes: int = setting(1 << 30, help="free GPU memory a CUDA-graph capture needs, else the step runs "
                                                "eagerly (1 GiB; 0: no check)")


def _video_limit(default: int, what: str, shown: str | None = None) -> int:
    return setting(default, metavar="N", help=f"most {what} ({shown or default}); over it: INVALID_ARGUMENT")


@dataclass
class VideoSettings(Section):
    """DecodeVideo: the VAE, its threads and the bounds of one request (server/services/video.py)."""

    PREFIX = "video_"
    TITLE = "video: DecodeVideo"
    vae: str | None = setting(None, metavar="DIR",
                              help="a local diffusers AutoencoderKLWan directory (e.g. a Wan 2.1 vae/ folder); "
                                   "without it a small Wan-style VAE with seeded random weights is built (real "
                                   "decode path and timing, meaningless pictures)")
    fast_path: str = setting("off", kind="str", cli_choices=("off", "fused"),
                             help="Wan VAE decoder: off (diffusers' reference, default) or fused (Triton kernels; "
                                  "pays off on CUDA, falls back to the reference on a CPU)")
    threads: int = setting(1, help="torch intra-op threads for video decode (1; process-wide, shared with the LM)")
    queue_chunks: int = setting(4, low=1, metavar="N",
                                help="encoded chunks a DecodeVideo stream holds for a slow reader (4)")
    max_latent_frames: int = _video_limit(128, "latent frames T of one DecodeVideo request")
    max_latent_height: int = _video_limit(160, "latent height H of one DecodeVideo request")
    max_latent_width: int = _video_limit(160, "latent width W of one DecodeVideo request")
    max_frames: int = _video_limit(512, "output frames of one DecodeVideo request")
    max_frame_pixels: int = _video_limit(1280 * 720, "pixels of one decoded frame (before any crop)",
                                         "921600 = 1280x720")
    max_total_pixels: int = _video_limit(1280 * 720 * 192, "output frames x decoded frame pixels",
                                         "176947200 = 192 frames of 1280x720")


def _session_limit(default: int, what: str) -> int:
    return setting(default, metavar="N", cli_type=positive_int, help=f"most {what} ({default})")


def _sentence(text: object) -> bool:
    return isinstance(text, str) and bool(text.strip()) and len(text) <= 500


@dataclass
class LimitsSettings(Section):
    """What one Converse session may make the server hold or echo (server/session/limits.py), and
    how many sessions the replica takes."""

    PREFIX = "session_"
    TITLE = "limits: sessions and what one may hold"
    max_sessions: int = setting(256, key="max_sessions", help="concurrent Converse sessions (256)")
    capacity_sessions: int = setting(
        0, key="capacity_sessions", metavar="N",
        help="the sessions this replica is sized for (default: --max-sessions), exported as "
             "rtmedia_sessions_capacity; one more is refused (AT_CAPACITY) unless --admit-over-capacity")
    refuse_at_capacity: bool = setting(
        True, key="refuse_at_capacity", flags=("--admit-over-capacity",),
        help="admit sessions over --capacity-sessions (up to --max-sessions): capacity only as a metric")
    outbox_events: int = _session_limit(4096, "events a Converse session holds for a client that does not read")
    outbox_bytes: int = _session_limit(8 * MiB, "bytes a Converse session holds for a client that does not read")
    text_chars: int = _session_limit(2000, "characters of a typed conversation item")
    instructions_chars: int = _session_limit(2000, "characters of a session's or response's instructions")
    id_bytes: int = _session_limit(256, "bytes of an id or name the server echoes")
    max_duration_s: int = setting(14400, low=1, high=86400, metavar="N", cli_type=positive_int,
                                  help="most seconds of max_session_s a client may ask for (14400)")
    max_idle_s: int = setting(1800, low=1, high=86400, metavar="N", cli_type=positive_int,
                              help="most seconds of idle_timeout_s a client may ask for (1800)")
    # What a session's server says while a function call is out, and when one goes unanswered.
    tool_fillers: list[str] = setting(factory=lambda: list(Limits().tool_fillers), key="tool_fillers",
                                      flags=("--tool-filler",), metavar="TEXT",
                                      help="said while a function call is out (repeatable; replaces the defaults)")
    tool_apology: str = setting(Limits().tool_apology, key="tool_apology", metavar="TEXT",
                                help="said when a function call goes unanswered")

    def check(self) -> None:
        for text in [*self.tool_fillers, self.tool_apology]:
            if not _sentence(text):
                raise ValueError(f"tool_fillers and tool_apology are sentences of 1..500 characters, got {text!r}")
        if not self.tool_fillers:
            raise ValueError("tool_fillers needs at least one sentence")
        if not 0 <= self.capacity_sessions <= self.max_sessions:
            raise ValueError(f"capacity_sessions must be within 0..max_sessions ({self.max_sessions}), got "
                             f"{self.capacity_sessions}")


@dataclass
class LanesSettings(Section):
    """Engine step deadlines and lane health (docs/operations.md#engine-faults-and-health)."""

    PREFIX = "lane_"
    TITLE = "lanes: step deadlines and health"
    step_deadlines_s: dict[str, float] = setting(
        factory=dict, flags=("--lane-deadline",), kind="map_float", metavar="LANE=SECONDS",
        help="step deadline of one lane (repeatable; 0: none): vad 5, asr 30, asr_final 30, tts 30, "
             "video 300, llm 60, transformers 120")
    unhealthy_after_s: float = setting(
        10.0, flags=("--lane-unhealthy-after",), above=0, finite=True, metavar="SECONDS",
        message="{key} must be a positive number of seconds, got {value!r}",
        help="how long a lane may stay stalled past a deadline, or fail every step, before health "
             "says NOT_SERVING (10)")

    def check(self) -> None:
        if not isinstance(self.step_deadlines_s, dict):
            raise ValueError(f"lane_step_deadlines_s must map lane names to seconds, got {self.step_deadlines_s!r}")
        for lane, seconds in self.step_deadlines_s.items():
            if lane not in STEP_DEADLINES_S:
                raise ValueError(f"lane_step_deadlines_s: unknown lane {lane!r}; lanes: {', '.join(STEP_DEADLINES_S)}")
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < float("inf"):
                raise ValueError(f"lane_step_deadlines_s: {lane}={seconds!r} must be a number of seconds >= 0 "
                                 "(0: no deadline)")

    def step_deadline(self, lane: str) -> float | None:
        """The step deadline of `lane` in seconds, or None for no deadline."""
        seconds = self.step_deadlines_s.get(lane, STEP_DEADLINES_S.get(lane, 0.0))
        return float(seconds) if seconds else None


@dataclass
class RecordingSettings(Section):
    """Session recordings (server/observe/recording.py, docs/operations.md#recordings)."""

    PREFIX = "record_"
    TITLE = "recording: session recordings"
    dir: str | None = setting(None, metavar="DIR",
                              help="record every Converse session in DIR: <session_id>.ogg (stereo Ogg Opus: the user "
                                   "left, the agent right, as heard) and <session_id>.jsonl (its events); owner-only "
                                   "files (docs/operations.md#recordings); default: off")
    on_request: bool = setting(False, help="with --record-dir: record only the sessions that set recording: true")
    max_mb: float = setting(64.0, above=0, finite=True, message=POSITIVE, metavar="MB",
                            help="size bound of one recording, both files (64)")
    max_s: float = setting(3600.0, above=0, finite=True, message=POSITIVE, metavar="S",
                           help="duration bound of one recording (3600)")
    retention_h: float = setting(
        0.0, low=0, finite=True, metavar="H",
        message="{key} must be a number of hours >= 0 (0 keeps recordings), got {value!r}",
        help="delete recordings older than H hours, at start and hourly (0: keep them)")

    def check(self) -> None:
        if self.on_request and not self.dir:
            raise ValueError("record_on_request needs record_dir (--record-on-request needs --record-dir DIR)")


@dataclass
class LoggingSettings(Section):
    """Log lines (rtmedia.protocol.logs)."""

    PREFIX = "log_"
    TITLE = "logging"
    level: str = setting("INFO", help="DEBUG, INFO, WARNING (INFO)")
    format: str = setting("json", kind="str", cli_choices=("json", "text"), help="log line format (json)")


@dataclass
class TracingSettings(Section):
    """OpenTelemetry traces (server/observe/tracing.py)."""

    PREFIX = "otel_"
    TITLE = "tracing: OpenTelemetry"
    endpoint: str = setting("", metavar="URL",
                            help="export OpenTelemetry traces to this OTLP collector (a base URL such as "
                                 "http://collector:4318, as OTEL_EXPORTER_OTLP_ENDPOINT; default: that variable, "
                                 "else off)")
