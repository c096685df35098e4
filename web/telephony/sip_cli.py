"""`rtmedia sip`: the SIP door in front of an rtmedia server (docs/telephony.md#sip), and the
`--sip-*` flags it shares with `rtmedia serve --sip` (which runs this command as a process of
its own beside the server)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import signal
import sys
from typing import Any

from rtmedia.web.settings import SipSettings

DESCRIPTION = """\
Answer phone calls over SIP: each call is a duplex session of the rtmedia server.
Phones, PBXs and trunks send INVITEs to --sip-listen (UDP and TCP; TLS with
--sip-tls-listen), or the door registers with a trunk (--sip-register, or trunks in
--sip-config). Calls take G.722 (16 kHz) or G.711 (PCMU, PCMA at 8 kHz).

The calls API (dial out, list, hang up, transfer, DTMF) and Prometheus metrics are on
--sip-control (loopback, no authentication: the web front serves the API behind its
tokens). Signals: SIGTERM drains (new calls get 503, live calls go on for --grace);
SIGINT (or a second SIGTERM) stops at once.
"""


def add_sip_flags(p: argparse.ArgumentParser, aliases: bool = False) -> None:
    """The --sip-* flags, from web/settings.py SipSettings (`aliases`: also the short names
    `rtmedia sip` takes, --rtp-ports and --max-calls)."""
    SipSettings.add_door_flags(p, aliases)


SIP_FLAGS = ("sip_listen", "sip_tls_listen", "sip_tls_cert", "sip_tls_key", "sip_srtp", "sip_register",
             "sip_password_file", "sip_public_address", "sip_rtp_ports", "sip_max_calls", "sip_rtp_timeout",
             "sip_config", "sip_control", "sip_responder", "sip_echo_cancellation")


def sip_argv(args: argparse.Namespace) -> list[str]:
    """The --sip-* flags given, as `rtmedia sip` arguments (for `serve --sip`'s process)."""
    out: list[str] = []
    for name in SIP_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def sip_config(settings: SipSettings | argparse.Namespace) -> Any:
    """The settings (or the parsed flags), and the --sip-config file, as a SipConfig; ValueError
    names a bad flag."""
    from rtmedia.web.telephony.sip_config import (
        SipConfig,
        Trunk,
        host_port,
        load_file,
        port_range,
        read_password,
        sip_uri,
    )

    args = SipSettings.from_args(settings) if isinstance(settings, argparse.Namespace) else settings
    kwargs: dict[str, Any] = load_file(args.config) if args.config else {}
    if args.listen:
        kwargs["listen"] = host_port(args.listen, "--sip-listen", 5060)
    if args.tls_listen:
        kwargs["tls_listen"] = host_port(args.tls_listen, "--sip-tls-listen", 5061)
    for flag in ("tls_cert", "tls_key", "srtp", "public_address"):
        if getattr(args, flag) is not None:
            kwargs[flag] = getattr(args, flag)
    if args.rtp_ports:
        kwargs["rtp_ports"] = port_range(args.rtp_ports, "--sip-rtp-ports")
    if args.max_calls is not None:
        kwargs["max_calls"] = args.max_calls
    if args.rtp_timeout is not None:
        kwargs["rtp_timeout_s"] = args.rtp_timeout
    if args.control:
        kwargs["control"] = None if args.control == "off" else host_port(args.control, "--sip-control")
    if args.echo_cancellation is not None:
        kwargs["echo_cancellation"] = args.echo_cancellation == "on"
    if args.responder:
        kwargs["session"] = {**kwargs.get("session", {}), "responder": args.responder}
    if args.register:
        password = read_password(args.password_file, "--sip-password-file")
        kwargs["trunks"] = (Trunk.from_uri("register", sip_uri(args.register, "--sip-register"), password),
                            *kwargs.get("trunks", ()))
    elif args.password_file:
        raise ValueError("--sip-password-file goes with --sip-register")
    return SipConfig(**kwargs)


def add_sip_parser(sub: argparse._SubParsersAction) -> None:
    from rtmedia.clients.client import DEFAULT_TARGET
    from rtmedia.clients.credentials import add_credential_flags

    p = sub.add_parser("sip", help="answer phone calls over SIP (a door in front of the server)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"rtmedia server address (default {DEFAULT_TARGET})")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long live calls may go on while new ones are refused (default 30)")
    p.add_argument("--log-format", choices=["json", "text"], default="text", help="log line format")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level (DEBUG includes PJSIP's own lines)")
    add_sip_flags(p, aliases=True)
    p.add_argument("--sip-settings", default=None, help=argparse.SUPPRESS)  # (serve --sip: the section as JSON)
    add_credential_flags(p)
    p.set_defaults(func=cmd_sip)


def cmd_sip(args: argparse.Namespace) -> None:
    from rtmedia.clients.credentials import from_args
    from rtmedia.protocol import logs

    if args.grace < 0:
        raise ValueError(f"--grace must be at least 0, got {args.grace:g}")
    settings = SipSettings.from_json(args.sip_settings) if args.sip_settings else SipSettings.from_args(args)
    config = sip_config(settings)
    credentials = from_args(args)
    logs.configure(args.log_level, args.log_format)
    asyncio.run(run_sip(config, lambda: credentials.aio_channel(args.target), args.grace, args.target))


async def run_sip(config: Any, open_channel: Any, grace_s: float, target: str) -> None:
    """Serve calls until a signal: SIGTERM drains (`grace_s`), SIGINT or a second SIGTERM stops."""
    import pjsua2 as pj
    from aiohttp import web
    from rtmedia.web.http_errors import ServerLog
    from rtmedia.web.telephony.sip import SipDoor
    from rtmedia.web.telephony.sip_control import SipControl

    channel = open_channel()  # (on this loop)
    faulthandler.enable()  # (a crash in PJSIP's threads leaves its Python stacks in the log)
    door = SipDoor(config, channel)
    drain, stop = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: (stop if drain.is_set() else drain).set())
    loop.add_signal_handler(signal.SIGINT, stop.set)
    runner = None
    try:
        try:
            door.start()
        except pj.Error as exc:
            raise OSError(f"PJSIP could not start: {exc.title or exc.reason}: {exc.reason}") from None
        if config.control is not None:
            runner = web.AppRunner(SipControl(door).app(), access_log=None, logger=ServerLog())
            await runner.setup()
            site = web.TCPSite(runner, *config.control)
            await site.start()
            control = "http://{}:{}".format(*site._server.sockets[0].getsockname()[:2])  # type: ignore[union-attr]
        else:
            control = "off"
        ports = ", ".join(f"{k} {v}" for k, v in door.ports.items())
        print(f"rtmedia sip: SIP on {config.listen[0]} ({ports}), calls API {control} (answering for {target})",
              file=sys.stderr, flush=True)
        waits = {asyncio.create_task(drain.wait()), asyncio.create_task(stop.wait())}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if drain.is_set() and not stop.is_set():
            print(f"rtmedia sip: draining (at most {grace_s:g} s)", file=sys.stderr, flush=True)
            drained = asyncio.create_task(door.drain(grace_s))
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({drained, stopping}, return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
            waits.add(stopping)
        for task in waits:
            task.cancel()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if runner is not None:
            await runner.cleanup()
        with contextlib.suppress(Exception):
            await door.stop()
        await channel.close()
