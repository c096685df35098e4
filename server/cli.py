"""The `rtmedia` command: `serve` runs the server; the other commands are clients."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from typing import Any

from rtmedia.clients.commands import cli as client_cli
from rtmedia.server.config import ASR_ENGINES, ServerConfig
from rtmedia.server.doctor import add_doctor_parser, cmd_doctor
from rtmedia.web.cli import add_web_parser
from rtmedia.web.telephony.sip_cli import add_sip_flags, add_sip_parser, sip_argv, sip_config

SYNTHETIC_SIZES = ("tiny", "0.5b", "1b", "7b")  # engines/lm/synthetic.py SHAPES (not imported: no torch here)

DESCRIPTION = """\
rtmedia: a realtime media server over gRPC.

  rtmedia serve                          start the server (gRPC on :50051, metrics on :9464)
  rtmedia voices                         list voices and their output rates
  rtmedia synth "Hello." -o hello.mp3    streaming text-to-speech into any audio file (- : stdout)
  rtmedia transcribe recording.mp3       streaming speech-to-text of any audio file (- : stdin)
  rtmedia talk question.wav -o reply.wav a duplex voice session: turns, replies, barge-in
  rtmedia decode-video lat.npy -o a.mp4  chunked video decode of a latent, frames streamed as decoded
  rtmedia web                            the browser page and WebRTC bridge (http://127.0.0.1:8080/)
  rtmedia sip                            answer phone calls over SIP (docs/telephony.md)
  rtmedia loadtest --sessions 50         many simulated sessions: latency percentiles, capacity
  rtmedia health                         grpc.health.v1 check: exit 0 when SERVING
  rtmedia doctor                         self-check: engines, device, CUDA graphs, Triton kernels

Every client command takes --target HOST:PORT and --json. Run `rtmedia COMMAND --help` for details.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtmedia", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (client commands; also after the command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser("serve", help="run the gRPC server on the embedded default models",
                       description="Run the rtmedia gRPC server. Health says SERVING once the engines are "
                                   "loaded and warmed up; SIGTERM/SIGINT drain it gracefully.")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default 50051; 0 picks a free one)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default 9464; 0 disables)")
    p.add_argument("--metrics-host", default=None, help="address the metrics endpoint binds (default 127.0.0.1)")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="PEM certificate chain: serve gRPC over TLS (with --tls-key; reloaded on SIGHUP)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, metavar="FILE",
                   help="PEM CA bundle: require client certificates that chain to it (mutual TLS)")
    p.add_argument("--auth-tokens", default=None, metavar="FILE",
                   help="bearer tokens, one per line with an optional name and quotas (docs/operations.md); "
                        "default: RTMEDIA_AUTH_TOKENS, else no authentication; reloaded on SIGHUP")
    p.add_argument("--config", default=None, help="YAML deploy file (its `server:` keys; flags override it)")
    p.add_argument("--grace", dest="grace_s", type=float, default=None, help="drain grace period in seconds (30)")
    p.add_argument("--asr", default=None, choices=ASR_ENGINES,
                   help="the recogniser: Whisper tiny.en on CTranslate2 (whisper, the default) or pocketsphinx")
    p.add_argument("--asr-model", default=None, metavar="DIR",
                   help="Whisper: a CTranslate2 (faster-whisper) or transformers Whisper directory "
                        "(default: the embedded tiny.en)")
    p.add_argument("--asr-backend", default=None, choices=("auto", "ct2", "torch"),
                   help="Whisper's runtime: CTranslate2 or torch (auto: torch on CUDA, else ct2)")
    p.add_argument("--asr-compute-type", default=None, metavar="TYPE",
                   help="Whisper's precision (ct2: int8, int8_float16, float16, float32, ...; torch: float32, "
                        "float16, bfloat16, int8 on a CPU); default: the runtime's on the device")
    p.add_argument("--asr-max-graphs", type=int, default=None, metavar="N",
                   help="Whisper on torch and CUDA: CUDA graphs captured at most (48)")
    p.add_argument("--asr-threads", type=int, default=None, help="Whisper: cores one decode batch uses (1)")
    p.add_argument("--asr-parallel", type=int, default=None,
                   help="Whisper: decode batches that run at once, each on its share of the streams (2)")
    p.add_argument("--asr-workers", type=int, default=None, help="PocketSphinx worker processes (2)")
    p.add_argument("--asr-decoders", type=int, default=None,
                   help="fast PocketSphinx decoders each ASR worker builds at start (10)")
    p.add_argument("--max-sessions", type=int, default=None, help="concurrent Converse sessions (256)")
    p.add_argument("--capacity-sessions", type=int, default=None, metavar="N",
                   help="the sessions this replica is sized for (default: --max-sessions), exported as "
                        "rtmedia_sessions_capacity; one more is refused (AT_CAPACITY) unless --admit-over-capacity")
    p.add_argument("--admit-over-capacity", dest="refuse_at_capacity", action="store_false", default=None,
                   help="admit sessions over --capacity-sessions (up to --max-sessions): capacity only as a metric")
    p.add_argument("--drain-delay", dest="drain_delay_s", type=float, default=None, metavar="S",
                   help="after SIGTERM, say not ready at once but admit new sessions for S more seconds, so a "
                        "proxy polling readiness stops routing here first (0)")
    p.add_argument("--replica-name", default=None, metavar="NAME",
                   help="sent as rtmedia-replica metadata on each session (default: the host name)")
    p.add_argument("--vad-threads", type=int, default=None,
                   help="concurrent onnxruntime runs one VAD tick's batch is split over (2)")
    p.add_argument("--responder", dest="default_responder", default=None,
                   help="default responder of a session: llm (default), echo, transformers, openai")
    p.add_argument("--no-llm", dest="llm", action="store_false", default=None,
                   help="do not load the embedded SmolLM2-135M-Instruct (responder llm)")
    p.add_argument("--turn-detection", choices=["server_vad", "semantic_vad"], default=None,
                   help="a session's turn detection unless it asks for another (default server_vad); semantic_vad "
                        "needs the LM")
    p.add_argument("--noise-reduction", choices=["off", "near_field", "far_field"], default=None,
                   help="new sessions' noise suppression for the VAD (off; a session may set its own)")
    p.add_argument("--eagerness", dest="turn_eagerness", choices=["low", "medium", "high", "auto"], default=None,
                   help="semantic_vad's default eagerness (auto = medium)")
    p.add_argument("--turn-audio-model", default=None, metavar="smart-turn|FILE",
                   help="semantic_vad also hears the pause: Smart Turn v3.2 from the pipecat-ai wheel, or an ONNX "
                        "file of its contract (input_features [batch, 80, 800] -> logits [batch, 1]); default: off")
    p.add_argument("--no-riva", dest="riva", action="store_false", default=None,
                   help="do not serve NVIDIA Riva's speech API (nvidia.riva.asr / nvidia.riva.tts)")
    p.add_argument("--transformers-model", default=None, metavar="DIR",
                   help="a local Hugging Face causal-LM directory, offered as responder transformers")
    p.add_argument("--openai-url", default=None, metavar="URL",
                   help="an OpenAI-compatible chat-completions base URL (e.g. http://host:8000/v1), offered as "
                        "responder openai; the key is read from OPENAI_API_KEY")
    p.add_argument("--openai-model", default=None, help="the model name sent to --openai-url")
    p.add_argument("--lm-slots", type=int, default=None, help="LM KV-cache slots shared by sessions (16)")
    p.add_argument("--lm-quantize", choices=["auto", "int8", "none"], default=None,
                   help="LM linear layers as per-row int8 matmuls (int8: CPU only) or in the model's dtype "
                        "(none); auto (default): int8 on the CPU, none on CUDA")
    p.add_argument("--lm-batch-sizes", type=_sizes, default=None, metavar="N,N,...",
                   help="LM decode batch sizes, each captured as a CUDA graph at warm-up on a GPU "
                        "(1,2,4,8,16,32,64,128; capped at --lm-slots)")
    p.add_argument("--synthetic-lm", default=None, choices=list(SYNTHETIC_SIZES), metavar="SIZE",
                   help="CAPACITY RUNS ONLY: build the llm lane on a Llama of this shape (tiny, 0.5b, 1b, 7b) "
                        "with RANDOM weights instead of the embedded SmolLM2; every step costs what that "
                        "model costs, and every reply is gibberish that runs to its token limit")
    p.add_argument("--device", default=None, metavar="auto|cpu|cuda",
                   help="where the LM and video engines run: auto (default: CUDA when torch sees a GPU), cpu, "
                        "cuda or cuda:N; on CUDA the LMs run in bfloat16 with CUDA-graph decode")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="run every engine step eagerly (no CUDA-graph capture)")
    p.add_argument("--max-graphs", type=int, default=None,
                   help="CUDA graphs admitted per engine beyond the LM's warm-up ones (4; 0 disables admission)")
    p.add_argument("--min-free-bytes", type=int, default=None,
                   help="free GPU memory a CUDA-graph capture needs, else the step runs eagerly (1 GiB; 0: no check)")
    p.add_argument("--voice", dest="voices", action="append", default=None,
                   help="extra Piper voice: a local .onnx with .onnx.json beside it (repeatable)")
    p.add_argument("--web", action="store_true", default=None,
                   help="also serve the browser page and WebRTC bridge (see `rtmedia web --help`)")
    p.add_argument("--web-port", type=int, default=None, help="port of the page and bridge (8080)")
    p.add_argument("--web-tls-cert", default=None, metavar="FILE", help="PEM certificate: serve the page on https")
    p.add_argument("--web-tls-key", default=None, metavar="FILE", help="PEM private key of --web-tls-cert")
    p.add_argument("--web-max-peers", type=int, default=None, help="concurrent browser peers of the bridge (8)")
    p.add_argument("--no-openai-api", dest="web_openai_api", action="store_false", default=None,
                   help="do not serve OpenAI's audio APIs (/v1/audio/speech, /v1/audio/transcriptions) on the web port")
    p.add_argument("--web-twilio", action="store_true", default=None,
                   help="answer phone calls Twilio connects on the web port (see `rtmedia web --help`)")
    p.add_argument("--web-twilio-auth-token-file", default=None, metavar="FILE",
                   help="the Twilio account's auth token (default: $RTMEDIA_TWILIO_AUTH_TOKEN)")
    p.add_argument("--web-twilio-insecure", action="store_true", default=None,
                   help="accept unsigned requests on /twilio/")
    p.add_argument("--web-twilio-public-url", default=None, metavar="URL",
                   help="the web port's URL as Twilio calls it, https://HOST[:PORT]")
    p.add_argument("--sip", action="store_true", default=None,
                   help="also answer phone calls over SIP: `rtmedia sip` as a process beside the server, taking "
                        "the --sip-* flags below (see `rtmedia sip --help`); with --web its calls API is on the web "
                        "port too")
    add_sip_flags(p)
    p.add_argument("--video-vae", default=None, metavar="DIR",
                   help="a local diffusers AutoencoderKLWan directory (e.g. a Wan 2.1 vae/ folder); without it "
                        "a small Wan-style VAE with seeded random weights is built (real decode path and timing, "
                        "meaningless pictures)")
    p.add_argument("--video-fast-path", choices=["off", "fused"], default=None,
                   help="Wan VAE decoder: off (diffusers' reference, default) or fused (Triton kernels; pays "
                        "off on CUDA, falls back to the reference on a CPU)")
    p.add_argument("--video-threads", type=int, default=None,
                   help="torch intra-op threads for video decode (1; process-wide, shared with the LM)")
    for flag, default, what in (
            ("latent-frames", "128", "latent frames T of one DecodeVideo request"),
            ("latent-height", "160", "latent height H of one DecodeVideo request"),
            ("latent-width", "160", "latent width W of one DecodeVideo request"),
            ("frames", "512", "output frames of one DecodeVideo request"),
            ("frame-pixels", "921600 = 1280x720", "pixels of one decoded frame (before any crop)"),
            ("total-pixels", "176947200 = 192 frames of 1280x720", "output frames x decoded frame pixels")):
        p.add_argument(f"--video-max-{flag}", type=int, default=None, metavar="N",
                       help=f"most {what} ({default}); over it: INVALID_ARGUMENT")
    for flag, default, what in (
            ("outbox-events", "4096", "events a Converse session holds for a client that does not read"),
            ("outbox-bytes", "8388608", "bytes a Converse session holds for a client that does not read"),
            ("text-chars", "2000", "characters of a typed conversation item"),
            ("instructions-chars", "2000", "characters of a session's or response's instructions"),
            ("id-bytes", "256", "bytes of an id or name the server echoes"),
            ("max-duration-s", "14400", "seconds of max_session_s a client may ask for"),
            ("max-idle-s", "1800", "seconds of idle_timeout_s a client may ask for")):
        p.add_argument(f"--session-{flag}", type=_positive, default=None, metavar="N", help=f"most {what} ({default})")
    p.add_argument("--lane-deadline", dest="lane_step_deadlines_s", action=_LaneDeadline, default=None,
                   metavar="LANE=SECONDS",
                   help="step deadline of one lane (repeatable; 0: none): vad 5, asr 30, asr_final 30, tts 30, "
                        "video 300, llm 60, transformers 120")
    p.add_argument("--lane-unhealthy-after", dest="lane_unhealthy_after_s", type=float, default=None,
                   metavar="SECONDS",
                   help="how long a lane may stay stalled past a deadline, or fail every step, before health "
                        "says NOT_SERVING (10)")
    p.add_argument("--record-dir", default=None, metavar="DIR",
                   help="record every Converse session in DIR: <session_id>.ogg (stereo Ogg Opus: the user left, "
                        "the agent right, as heard) and <session_id>.jsonl (its events); owner-only files "
                        "(docs/operations.md#recordings); default: off")
    p.add_argument("--record-on-request", action="store_true", default=None,
                   help="with --record-dir: record only the sessions that set recording: true")
    p.add_argument("--record-max-mb", type=float, default=None, metavar="MB",
                   help="size bound of one recording, both files (64)")
    p.add_argument("--record-max-s", type=float, default=None, metavar="S",
                   help="duration bound of one recording (3600)")
    p.add_argument("--record-retention-h", type=float, default=None, metavar="H",
                   help="delete recordings older than H hours, at start and hourly (0: keep them)")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (INFO)")
    p.add_argument("--log-format", choices=["json", "text"], default=None, help="log line format (json)")
    p.add_argument("--otel-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces to this OTLP collector (a base URL such as "
                        "http://collector:4318, as OTEL_EXPORTER_OTLP_ENDPOINT; default: that variable, else off)")
    p.set_defaults(func=cmd_serve)
    client_cli.add_commands(sub)
    add_web_parser(sub)
    add_sip_parser(sub)
    add_doctor_parser(sub)
    return parser


class _LaneDeadline(argparse.Action):
    """`--lane-deadline LANE=SECONDS`, repeatable: a mapping of lane names to seconds."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        lane, _, seconds = str(values).partition("=")
        try:
            value = float(seconds)
        except ValueError:
            raise argparse.ArgumentError(self, f"expected LANE=SECONDS, got {values!r}") from None
        deadlines = dict(getattr(namespace, self.dest) or {})
        deadlines[lane.strip()] = value
        setattr(namespace, self.dest, deadlines)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return sizes


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Defaults, then the --config file, then the `serve` flags given (each named as its ServerConfig field)."""
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    if flags := sip_argv(args):
        overrides["sip_flags"] = flags
    config = ServerConfig.load(args.config, **overrides)
    from rtmedia.server.observe.tracing import tracing_from_env

    tracing_from_env(config.otel_endpoint)  # a bad OTEL_* protocol or endpoint: one line, before anything starts
    if config.sip_flags and not config.sip:
        raise ValueError("the --sip-* flags (sip_flags) need --sip (sip)")
    if config.sip:  # the door's own checks, before anything starts
        sip_parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        add_sip_flags(sip_parser)
        try:
            flags, unknown = sip_parser.parse_known_args(config.sip_flags)
        except argparse.ArgumentError as exc:
            raise ValueError(f"sip_flags: {exc}") from None
        if unknown:
            raise ValueError(f"sip_flags: not --sip-* flags: {' '.join(unknown)}")
        sip_config(flags)
        if config.auth_tokens and not os.environ.get("RTMEDIA_TOKEN"):
            raise ValueError("sip with auth_tokens: the SIP door's sessions need a token of the table: set "
                             "$RTMEDIA_TOKEN for it")
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    # Idle OpenMP threads sleep instead of spinning (set before torch loads): the cores
    # are shared with the ASR workers and TTS, and spinning threads starve them.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rtmedia.protocol import logs
    from rtmedia.server.app import serve

    try:
        config = config_from_args(args)
    except (OSError, ValueError) as exc:
        print(f"rtmedia serve: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, config.log_format)
    beside = besides if config.web or config.sip else None
    try:
        asyncio.run(serve(config, beside))
    except (OSError, ValueError) as exc:
        print(f"rtmedia serve: {exc}", file=sys.stderr)
        return 1
    return 0


class Besides:
    """What runs beside the server (`serve --web`, `serve --sip`): drained and stopped together."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def reload(self, tokens: Any) -> None:
        for part in self.parts:
            part.reload(tokens)

    async def drain(self, grace_s: float) -> None:
        await asyncio.gather(*(part.drain(grace_s) for part in self.parts))

    async def stop(self) -> None:
        for part in reversed(self.parts):
            await part.stop()


async def besides(config: ServerConfig, target: str, tokens: Any) -> Besides:
    """The SIP door's process first (the web front forwards its calls API), then the web front;
    each a client of the server's private socket `target`."""
    parts: list[Any] = []
    control = None
    try:
        if config.sip:
            from rtmedia.web.telephony.sip_process import SipProcess

            sip = SipProcess(config.sip_flags)
            await sip.start(target, config.log_format)
            parts.append(sip)
            control = sip.control
        if config.web:
            from rtmedia.web.bridge import start_beside

            parts.append(await start_beside(config, target, tokens, sip_calls=control))
    except BaseException:
        await Besides(parts).stop()
        raise
    return Besides(parts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.func in (cmd_serve, cmd_doctor):
        return args.func(args)
    return client_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
