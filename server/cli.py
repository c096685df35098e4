"""The `rtmedia` command: `serve` runs the server; the other commands are clients."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from rtmedia.clients.commands import cli as client_cli
from rtmedia.protocol.settings import sections
from rtmedia.server.config import ServerConfig
from rtmedia.server.config_sections import SYNTHETIC_SIZES  # noqa: F401  (the sizes `--synthetic-lm` takes)
from rtmedia.server.doctor import add_doctor_parser, cmd_doctor
from rtmedia.web.cli import add_web_parser
from rtmedia.web.settings import SipSettings, TwilioSettings, WebSettings, check_front
from rtmedia.web.telephony.sip_cli import add_sip_parser, sip_config

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


@dataclass
class ServeConfig(ServerConfig):
    """`rtmedia serve`'s configuration: the server's sections and the web front's doors beside it
    (web/settings.py), composed here, where every door may be imported."""

    web: WebSettings = field(default_factory=WebSettings)
    twilio: TwilioSettings = field(default_factory=TwilioSettings)
    sip: SipSettings = field(default_factory=SipSettings)

    def __post_init__(self) -> None:
        check_front(self.web, self.twilio, self.sip, self.auth.auth_tokens)

    @classmethod
    def legacy(cls, values: dict[str, Any]) -> dict[str, Any]:
        """`sip_flags` (the --sip-* flags as argv strings) as the sip section's keys."""
        if "sip_flags" not in values:
            return values
        values = dict(values)
        flags = values.pop("sip_flags")
        if not isinstance(flags, list):
            raise ValueError(f"sip_flags: expected a list of --sip-* flags, got {flags!r}")
        return {**SipSettings.from_flags(flags).door_flags(), **values}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtmedia", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (client commands; also after the command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_serve_parser(sub)
    client_cli.add_commands(sub)
    add_web_parser(sub)
    add_sip_parser(sub)
    add_doctor_parser(sub)
    return parser


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """`rtmedia serve`: one group of flags per section of ServeConfig, each flag named as today."""
    p = sub.add_parser("serve", help="run the gRPC server on the embedded default models",
                       description="Run the rtmedia gRPC server. Health says SERVING once the engines are "
                                   "loaded and warmed up; SIGTERM/SIGINT drain it gracefully.")
    p.add_argument("--config", default=None, help="YAML deploy file (its `server:` keys; flags override it)")
    for section in sections(ServeConfig).values():
        section.add_flags(p)
    p.set_defaults(func=cmd_serve)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Defaults, then the --config file, then the `serve` flags given (each named as its flat key)."""
    overrides = {key: getattr(args, key) for key in ServeConfig.keys() if hasattr(args, key)}
    config = ServeConfig.load(args.config, **overrides)
    from rtmedia.server.observe.tracing import tracing_from_env

    tracing_from_env(config.tracing.endpoint)  # a bad OTEL_* protocol or endpoint: one line, before anything starts
    if config.sip.enabled:  # the door's own checks, before anything starts
        sip_config(config.sip)
        if config.auth.auth_tokens and not os.environ.get("RTMEDIA_TOKEN"):
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
    logs.configure(config.logging.level, config.logging.format)
    beside = besides if config.web.enabled or config.sip.enabled else None
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


async def besides(config: ServeConfig, target: str, tokens: Any) -> Besides:
    """The SIP door's process first (the web front forwards its calls API), then the web front;
    each a client of the server's private socket `target`."""
    parts: list[Any] = []
    control = None
    try:
        if config.sip.enabled:
            from rtmedia.web.telephony.sip_process import SipProcess

            sip = SipProcess(config.sip)
            await sip.start(target, config.logging.format)
            parts.append(sip)
            control = sip.control
        if config.web.enabled:
            from rtmedia.web.bridge import start_beside

            parts.append(await start_beside(config.web, config.twilio, config.network.host, target, tokens,
                                            sip_calls=control))
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
