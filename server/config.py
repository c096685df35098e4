"""Server configuration: defaults, a YAML deploy file, then command-line flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rtmedia.engines.tts.piper_bf16 import PRECISIONS
from rtmedia.server.session.limits import Limits

MiB = 1024 * 1024

# The longest one engine step of each lane may run, in seconds (docs/operations.md#engine-faults-and-health):
# far above a step's usual time on a loaded CPU, so only a stuck step reaches it. `lane_step_deadlines_s`
# overrides them per lane (0: no deadline). An LM lane's step is a prefill (of up to lm_context tokens: a
# local `transformers` model may be large for a CPU) or one decode step; a video step decodes one latent
# frame, which at the largest frame the limits admit takes long on a CPU.
ASR_ENGINES = ("whisper", "pocketsphinx")
ASR_BACKENDS = ("auto", "ct2", "torch")
STEP_DEADLINES_S: dict[str, float] = {
    "vad": 5.0, "turn_audio": 10.0, "asr": 30.0, "asr_final": 30.0, "tts": 30.0, "video": 300.0, "llm": 60.0,
    "transformers": 120.0,
}


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # 0 disables the metrics endpoint.
    metrics_port: int = 9464
    # Where the metrics endpoint binds (loopback: a deployment sets the pod's address).
    metrics_host: str = "127.0.0.1"
    # TLS on the gRPC port (PEM files; both or neither), and the CA bundle client
    # certificates must chain to (mutual TLS). Reloaded on SIGHUP.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # The token file (rtmedia.protocol.tokens; else RTMEDIA_AUTH_TOKENS): every call but health
    # needs a bearer token, with per-token session quotas. Reloaded on SIGHUP.
    auth_tokens: str | None = None
    # Seconds active RPCs get to finish on SIGTERM/SIGINT.
    grace_s: float = 30.0
    max_receive_bytes: int = 8 * MiB
    max_send_bytes: int = 4 * MiB
    # HTTP/2 flow-control window per stream: what the server reads ahead of a handler that
    # has not taken the previous message (a client it cannot keep up with, or a hostile one).
    # 0: grpc's adaptive window, which grows to tens of MiB per stream.
    stream_window_bytes: int = 1 * MiB
    max_text_chars: int = 5000
    # The recogniser: "whisper" (Whisper tiny.en on CTranslate2, engines/asr/whisper.py) or
    # "pocketsphinx" (engines/asr/pocketsphinx.py; the asr_workers and asr_decoders settings are its).
    asr: str = "whisper"
    # Whisper: cores one decode batch uses, and batches that run at once (the asr lane's runners).
    asr_threads: int = 1
    asr_parallel: int = 2
    # Whisper's model: a CTranslate2 (faster-whisper) or transformers Whisper directory; "" is the
    # embedded tiny.en. Its runtime: "ct2" (CTranslate2), "torch" (engines/asr/whisper_torch.py;
    # CUDA graphs on a GPU, at most asr_max_graphs) or "auto" (torch on CUDA, else ct2); its
    # precision: "" for the runtime's default on the device (ct2: int8 on a CPU, float16 on
    # CUDA; torch: float32, float16), else e.g. int8_float16, float32, bfloat16 (torch int8: a CPU path).
    asr_model: str = ""
    asr_backend: str = "auto"
    asr_compute_type: str = ""
    asr_max_graphs: int = 48
    asr_workers: int = 2
    # Fast-final PocketSphinx decoders built per worker at start: the user turns a worker
    # decodes at once before building more on demand (building one stalls the worker, and
    # each costs memory; BENCHMARKS.md has both). 10 per worker: 20 sessions speaking at once.
    asr_decoders: int = 10
    # A server_vad turn's recogniser utterance ends at each pause (160 ms of silence) rather than
    # at speech_stopped, so its final is ready when the turn ends (server/session/session.py Limits).
    early_finals: bool = True
    # What one Converse session may make the server hold or echo (server/session/limits.py):
    # events and bytes waiting for a client that does not read; a typed text item and the
    # instructions, in characters (sized to fit the embedded LM's context with the
    # conversation); ids and names the server echoes, in bytes.
    session_outbox_events: int = 4096
    session_outbox_bytes: int = 8 * MiB
    session_text_chars: int = 2000
    session_instructions_chars: int = 2000
    session_id_bytes: int = 256
    # The longest max_session_s and idle_timeout_s a client may ask for, in seconds.
    session_max_duration_s: int = 14400
    session_max_idle_s: int = 1800
    # What a session's server says while a function call is out (fillers, taken in turn) and when
    # one goes unanswered for its tool_timeout_ms (docs/protocol.md#tools).
    tool_fillers: list[str] = field(default_factory=lambda: list(Limits().tool_fillers))
    tool_apology: str = Limits().tool_apology
    # Concurrent Converse sessions; one more is refused with RESOURCE_EXHAUSTED.
    max_sessions: int = 256
    # The sessions this replica is sized for (0: max_sessions), from the load tester's figures:
    # exported as rtmedia_sessions_capacity, the denominator of an autoscaler's occupancy. With
    # refuse_at_capacity, a session over it is refused (RESOURCE_EXHAUSTED, AT_CAPACITY) so the
    # client opens it on a replica with room instead of degrading every session here.
    capacity_sessions: int = 0
    refuse_at_capacity: bool = True
    # After SIGTERM, health and /readyz say not serving at once while new sessions are still
    # admitted this long: a proxy that routes by polling readiness stops sending first, so none is
    # refused (0 on Kubernetes, where a preStop hook does the same).
    drain_delay_s: float = 0.0
    # The name Converse sends as `rtmedia-replica` initial metadata (which replica a client got
    # behind a proxy); empty: the host name (a pod's name on Kubernetes).
    replica_name: str = ""
    # LM slots (a separate, smaller pool; sessions wait for one, never refused).
    lm_slots: int = 16
    # Tokens of KV cache per slot (prompt + reply).
    lm_context: int = 2048
    # torch threads for the LM (process-wide). The cores are shared with the ASR
    # workers and TTS; with 2 threads a contended 2-core box spins (seconds per step).
    lm_threads: int = 1
    # LM linear layers: "int8" (per-row int8 matmuls, faster prefill and decode on a CPU and
    # batch-invariant, engines/lm/quant.py; CPU only, refused on CUDA), "none" (the model's own
    # dtype) or "auto" (int8 on the CPU, none on CUDA).
    lm_quantize: str = "auto"
    # LM decode batch sizes (capped at lm_slots): a decode is padded to the next one, and on CUDA
    # each is captured as a CUDA graph at warm-up (docs/architecture.md#cuda-graph-runner; not subject to max_graphs).
    lm_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    # Build the llm lane on a Llama of this shape (tiny, 0.5b, 1b, 7b) with random weights instead of
    # the embedded SmolLM2, for capacity runs: its replies are gibberish.
    synthetic_lm: str | None = None
    # Where the LM and video engines run: "auto" (CUDA when torch sees a GPU, else the CPU), "cpu",
    # "cuda" or "cuda:N" (start-up fails when torch sees no CUDA device). bfloat16 LMs on CUDA.
    device: str = "auto"
    # CUDA graphs for fixed-shape engine steps (docs/architecture.md#cuda-graph-runner); false runs every step eagerly.
    cuda_graphs: bool = True
    # Graph runner admission per engine (docs/architecture.md#cuda-graph-runner): graphs beyond the warm-up ones (0 disables
    # admission), and the free device memory a capture needs (0 disables the check).
    max_graphs: int = 4
    min_free_bytes: int = 1 << 30
    # The responder a session uses unless it asks for another: llm, echo, transformers, openai.
    default_responder: str = "llm"
    # The turn detection a session gets unless it asks for another: server_vad or semantic_vad
    # (docs/protocol.md#semantic-vad, which needs an LM), and semantic_vad's default eagerness.
    turn_detection: str = "server_vad"
    turn_eagerness: str = "auto"
    noise_reduction: str = "off"  # new sessions' noise_reduction.type: off, near_field, far_field
    # semantic_vad's thresholds (log10 P(finished)) by eagerness, each [before 600 ms, from 600 ms,
    # from 1.5 s of silence]; the eagernesses given replace the defaults (server/hearing/semantic_turns.py).
    semantic_thresholds: dict[str, list[float]] = field(default_factory=dict)
    # Serve NVIDIA Riva's speech API (RivaSpeechRecognition, RivaSpeechSynthesis) on the same port.
    riva: bool = True
    # Load the embedded SmolLM2-135M-Instruct (responder "llm"; also semantic_vad's turn scorer).
    llm: bool = True
    # semantic_vad's acoustic turn scorer beside the text one (docs/protocol.md#semantic-vad):
    # "smart-turn" (Smart Turn v3.2 from the pipecat-ai wheel) or a path to an ONNX file of the
    # same contract; None: off (it scores finished and unfinished speech alike on clean audio).
    turn_audio_model: str | None = None
    # A local Hugging Face causal-LM directory (responder "transformers").
    transformers_model: str | None = None
    # An OpenAI-compatible chat-completions server (responder "openai"); the key comes
    # from the OPENAI_API_KEY environment variable.
    openai_url: str | None = None
    openai_model: str = "gpt-4o-mini"
    # onnxruntime intra-op threads per TTS synthesis, and syntheses that run at once. 0: one per
    # core for a synthesis that starts alone, one for one that starts beside another
    # (engines/tts/piper.py): two threads shorten a synthesis that runs alone (the first audio of a
    # Synthesize call waits for its whole first chunk), while two syntheses at once do more
    # audio per second on one thread each (BENCHMARKS.md, TTS threads).
    tts_threads: int = 0
    tts_concurrency: int = 2
    # Piper's decoder: "auto" (bfloat16 on OpenVINO where the CPU has it natively, else float32
    # on onnxruntime), "fp32", or "bf16" (refused where not native). engines/tts/piper_bf16.py.
    tts_precision: str = "auto"
    # Concurrent single-threaded onnxruntime runs one VAD tick's batch is split over (500
    # `listen` sessions: VAD start p95 129 and 133 ms with 2 against 401 and 134 ms with 1).
    vad_threads: int = 2
    # Extra Piper voices: paths of `.onnx` files with `.onnx.json` beside them.
    voices: list[str] = field(default_factory=list)
    # The browser page and WebRTC bridge beside the server (rtmedia.web), on the same host.
    web: bool = False
    web_port: int = 8080
    web_tls_cert: str | None = None
    web_tls_key: str | None = None
    web_max_peers: int = 8
    # OpenAI's audio HTTP APIs (/v1/audio/speech, /v1/audio/transcriptions) on the web port.
    web_openai_api: bool = True
    # Twilio Media Streams on the web port (docs/telephony.md): the account's auth token file
    # (else $RTMEDIA_TWILIO_AUTH_TOKEN), unsigned requests accepted, the URL Twilio calls.
    web_twilio: bool = False
    web_twilio_auth_token_file: str | None = None
    web_twilio_insecure: bool = False
    web_twilio_public_url: str | None = None
    # The SIP door (docs/telephony.md) as a process beside the server, with `rtmedia sip`'s
    # --sip-* flags (`serve --sip-listen ...` fills them in); its calls API on the web port too.
    sip: bool = False
    sip_flags: list[str] = field(default_factory=list)
    # A local diffusers AutoencoderKLWan directory (e.g. a Wan 2.1 `vae/` folder); without
    # one, a small Wan-style VAE with seeded random weights (real decode path, fake pictures).
    video_vae: str | None = None
    # torch intra-op threads for video decode (process-wide, shared with the LM; 0: torch's default).
    video_threads: int = 1
    # Encoded chunks a DecodeVideo stream may hold for a slow reader before its decode waits.
    video_queue_chunks: int = 4
    # Bounds on one DecodeVideo request, checked before it is accepted (INVALID_ARGUMENT over them;
    # server/services/video.py VideoLimits): latent T, H and W; output frames; pixels of one decoded
    # frame (before any crop: the work); output frames x those pixels. Defaults: 720p (latent 90x160),
    # up to 192 frames of it; the message limit alone would let a request run for minutes or take GBs.
    video_max_latent_frames: int = 128
    video_max_latent_height: int = 160
    video_max_latent_width: int = 160
    video_max_frames: int = 512
    video_max_frame_pixels: int = 1280 * 720
    video_max_total_pixels: int = 1280 * 720 * 192
    # Wan VAE decoder fast path: "off" (diffusers' reference) or "fused" (Triton kernels, kernels/wan.py).
    video_fast_path: str = "off"
    # Step deadlines by lane name, over STEP_DEADLINES_S (0: none for that lane), and how long a lane
    # may stay stalled past a deadline, or fail every step, before health says NOT_SERVING.
    lane_step_deadlines_s: dict[str, float] = field(default_factory=dict)
    lane_unhealthy_after_s: float = 10.0
    # Session recordings (server/observe/recording.py, docs/operations.md#recordings): the directory (None:
    # off); with record_on_request only the sessions that set `recording`; the bounds of one
    # recording (MiB of both files, seconds); files older than record_retention_h hours are
    # deleted at start and hourly (0 keeps them).
    record_dir: str | None = None
    record_on_request: bool = False
    record_max_mb: float = 64.0
    record_max_s: float = 3600.0
    record_retention_h: float = 0.0
    log_level: str = "INFO"
    # "json" (one object per line) or "text".
    log_format: str = "json"
    # OpenTelemetry traces (server/observe/tracing.py): the OTLP collector's base URL, as
    # OTEL_EXPORTER_OTLP_ENDPOINT means it ("": off unless that variable names one).
    otel_endpoint: str = ""

    def step_deadline(self, lane: str) -> float | None:
        """The step deadline of `lane` in seconds, or None for no deadline."""
        seconds = self.lane_step_deadlines_s.get(lane, STEP_DEADLINES_S.get(lane, 0.0))
        return float(seconds) if seconds else None

    def __post_init__(self) -> None:
        if self.asr not in ASR_ENGINES:
            raise ValueError(f"asr must be one of {', '.join(ASR_ENGINES)}, got {self.asr!r}")
        if self.asr_backend not in ASR_BACKENDS:
            raise ValueError(f"asr_backend must be one of {', '.join(ASR_BACKENDS)}, got {self.asr_backend!r}")
        if self.asr_max_graphs < 0:
            raise ValueError(f"asr_max_graphs must be 0 or more, got {self.asr_max_graphs}")
        if self.asr != "whisper" and (self.asr_model or self.asr_backend != "auto" or self.asr_compute_type):
            raise ValueError("asr_model, asr_backend and asr_compute_type are Whisper's: they need asr whisper")
        if self.asr_threads < 1 or self.asr_parallel < 1:
            raise ValueError(f"asr_threads and asr_parallel must be at least 1, got {self.asr_threads} and "
                             f"{self.asr_parallel}")
        if self.vad_threads < 1:
            raise ValueError(f"vad_threads must be at least 1, got {self.vad_threads}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (--tls-cert and --tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for name in ("session_max_duration_s", "session_max_idle_s"):
            if not 1 <= getattr(self, name) <= 86400:
                raise ValueError(f"{name} must be within 1..86400, got {getattr(self, name)}")
        for text in [*self.tool_fillers, self.tool_apology]:
            if not isinstance(text, str) or not text.strip() or len(text) > 500:
                raise ValueError(f"tool_fillers and tool_apology are sentences of 1..500 characters, got {text!r}")
        if not self.tool_fillers:
            raise ValueError("tool_fillers needs at least one sentence")
        if self.turn_detection not in ("server_vad", "semantic_vad"):
            raise ValueError(f"turn_detection must be server_vad or semantic_vad, got {self.turn_detection!r}")
        if (self.web_twilio_auth_token_file or self.web_twilio_insecure or self.web_twilio_public_url) \
                and not self.web_twilio:
            raise ValueError("web_twilio_auth_token_file, web_twilio_insecure and web_twilio_public_url need "
                             "web_twilio (--web-twilio)")
        if self.web_twilio and not self.web:
            raise ValueError("web_twilio serves on the web port: it needs web (--web)")
        if self.web_twilio and self.auth_tokens:
            raise ValueError("web_twilio with auth_tokens: Twilio presents no token for the server to check; run "
                             "`rtmedia web --twilio --server-token TOKEN` beside the server instead")
        if self.noise_reduction not in ("off", "near_field", "far_field"):
            raise ValueError(f"noise_reduction must be off, near_field or far_field, got {self.noise_reduction!r}")
        if self.turn_eagerness not in ("low", "medium", "high", "auto"):
            raise ValueError(f"turn_eagerness must be low, medium, high or auto, got {self.turn_eagerness!r}")
        if not isinstance(self.semantic_thresholds, dict):
            raise ValueError(f"semantic_thresholds must map eagernesses to three thresholds, got "
                             f"{self.semantic_thresholds!r}")
        for eagerness, values in self.semantic_thresholds.items():
            if eagerness not in ("low", "medium", "high") or not isinstance(values, list | tuple) \
                    or len(values) != 3 or not all(isinstance(v, int | float) and -12 <= v <= 0 for v in values) \
                    or not values[0] >= values[1] >= values[2]:
                raise ValueError(f"semantic_thresholds: {eagerness}={values!r} must be low, medium or high with three "
                                 "thresholds in -12..0, none above the one before")
        if not 0 <= self.capacity_sessions <= self.max_sessions:
            raise ValueError(f"capacity_sessions must be within 0..max_sessions ({self.max_sessions}), got "
                             f"{self.capacity_sessions}")
        if not 0 <= self.drain_delay_s <= self.grace_s:
            raise ValueError(f"drain_delay_s must be within 0..grace_s ({self.grace_s:g}), got {self.drain_delay_s:g}")
        if self.stream_window_bytes < 0:
            raise ValueError(f"stream_window_bytes must be at least 0, got {self.stream_window_bytes}")
        if self.tts_threads < 0:
            raise ValueError(f"tts_threads must be at least 0, got {self.tts_threads}")
        if self.tts_precision not in PRECISIONS:
            raise ValueError(f"tts_precision must be one of {', '.join(PRECISIONS)}, got {self.tts_precision!r}")
        if not isinstance(self.lane_step_deadlines_s, dict):
            raise ValueError(f"lane_step_deadlines_s must map lane names to seconds, got {self.lane_step_deadlines_s!r}")
        for lane, seconds in self.lane_step_deadlines_s.items():
            if lane not in STEP_DEADLINES_S:
                raise ValueError(f"lane_step_deadlines_s: unknown lane {lane!r}; lanes: {', '.join(STEP_DEADLINES_S)}")
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < float("inf"):
                raise ValueError(f"lane_step_deadlines_s: {lane}={seconds!r} must be a number of seconds >= 0 "
                                 "(0: no deadline)")
        if self.record_on_request and not self.record_dir:
            raise ValueError("record_on_request needs record_dir (--record-on-request needs --record-dir DIR)")
        for name in ("record_max_mb", "record_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if isinstance(self.record_retention_h, bool) or not isinstance(self.record_retention_h, int | float) \
                or not 0 <= self.record_retention_h < float("inf"):
            raise ValueError(f"record_retention_h must be a number of hours >= 0 (0 keeps recordings), got "
                             f"{self.record_retention_h!r}")
        if not 0 < self.lane_unhealthy_after_s < float("inf"):
            raise ValueError(f"lane_unhealthy_after_s must be a positive number of seconds, got "
                             f"{self.lane_unhealthy_after_s!r}")

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: object) -> ServerConfig:
        """Defaults, then the YAML file's keys, then the overrides that are not None."""
        values: dict[str, object] = {}
        if path:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a mapping of settings at the top level")
            values.update(data.get("server", data))
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)  # type: ignore[arg-type]
