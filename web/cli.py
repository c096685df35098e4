"""`rtmedia web`: the WebRTC bridge and its page, in front of an rtmedia server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from rtmedia.clients.client import DEFAULT_TARGET

DESCRIPTION = """\
Serve the browser page and bridge its WebRTC peer connections to an rtmedia server:
open the printed URL, press Start, talk. Browsers allow the microphone only on
https or on localhost, so on any other host give --tls-cert and --tls-key.

Signalling: POST /offer (JSON {sdp, type}) as aiortc's examples do, or WHIP
(POST /whip with application/sdp -> 201 + Location; DELETE to end; the
transceivers are send-receive, so the reply comes back on the same connection).
A peer's id (in its answer or Location) is its credential: only it ends or
shows that peer. GET /healthz counts the peers and names none.

Tokens: with --auth-tokens FILE (else $RTMEDIA_AUTH_TOKENS) every route but the
page and /healthz wants `Authorization: Bearer TOKEN` (a WebSocket may offer the
subprotocol rtmedia.bearer.TOKEN instead); the page asks for one when it needs it.
Each session's calls to the server carry the browser's token, else --server-token.

Signals: SIGHUP re-reads --tls-cert/--tls-key, --auth-tokens and the --server-*
files (a file that does not load leaves the old in force; live calls keep theirs); SIGTERM drains: new offers get 503, live calls
go on until their sessions end or --grace runs out. SIGINT (or a second SIGTERM)
stops at once.
"""
TOKEN_ENV = "RTMEDIA_TOKEN"


def add_web_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("web", help="the WebRTC bridge and browser page (talk from a browser)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"rtmedia server address (default {DEFAULT_TARGET})")
    p.add_argument("--host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1); "
                                                       "media binds it too unless --media-host says otherwise")
    p.add_argument("--media-host", default=None, metavar="ADDR",
                   help="address ICE's UDP media sockets bind and offer as host candidates (default: --host; "
                        "0.0.0.0: every IPv4 address, '::': every address)")
    p.add_argument("--port", type=int, default=8080, help="HTTP(S) port (default 8080; 0 picks a free one)")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM certificate: serve https")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--ice-server", dest="ice_servers", action="append", default=[], metavar="URL",
                   help="STUN/TURN server, e.g. stun:stun.example.org:3478 or turn:user:pass@host:3478 "
                        "(repeatable; default none: host candidates only)")
    p.add_argument("--udp-ports", default=None, metavar="A-B", help="bind ICE's UDP sockets in this port range")
    p.add_argument("--max-peers", type=int, default=8, help="concurrent browser peers (default 8); "
                                                            "one more is refused with 503")
    p.add_argument("--input-rate", type=int, default=16000, choices=[8000, 16000, 24000],
                   help="session input rate the microphone is resampled to (default 16000)")
    p.add_argument("--audio-prefetch", type=int, default=0, metavar="FRAMES",
                   help="20 ms microphone frames held before decoding (default 0: each packet is decoded as it "
                        "arrives and a late one dropped; raise it on jittery paths)")
    p.add_argument("--max-body-bytes", type=int, default=65536, metavar="BYTES",
                   help="largest HTTP request body, an offer's included (default 65536); larger is refused with 413")
    p.add_argument("--max-media-sections", type=int, default=4, metavar="N",
                   help="most m= sections (media sections) an offer may have (default 4: audio, video and the "
                        "data channel fit); more is refused with 400")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="an answered peer whose connection (ICE and DTLS) is not up within S seconds is closed, "
                        "giving back its slot and its session (default 10)")
    p.add_argument("--responder", default=None, help="responder of the sessions, e.g. echo (default: the server's)")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, how long live calls may go on while new offers are refused (default 30)")
    p.add_argument("--log-format", choices=["json", "text"], default="text",
                   help="log line format (text: for people; json: one object per line)")
    g = p.add_argument_group("OpenAI's audio APIs on the web port (/v1/audio/speech, /v1/audio/transcriptions)")
    g.add_argument("--no-openai-api", dest="openai_api", action="store_false", help="do not serve them")
    g.add_argument("--openai-max-upload-bytes", type=int, default=None, metavar="BYTES",
                   help="largest transcription upload (default 26214400: 25 MiB, as OpenAI's)")
    g.add_argument("--openai-max-audio-seconds", type=float, default=None, metavar="S",
                   help="longest audio a transcription decodes (default 3600)")
    g.add_argument("--openai-max-requests", type=int, default=None, metavar="N",
                   help="audio requests served at once; one more is answered 429 (default 16)")
    g = p.add_argument_group("Twilio Media Streams on the web port (/twilio/voice, /twilio/media)")
    g.add_argument("--twilio", action="store_true", help="answer phone calls that Twilio connects (docs/telephony.md)")
    g.add_argument("--twilio-auth-token-file", default=None, metavar="FILE",
                   help="the Twilio account's auth token, which signs its requests (default: "
                        "$RTMEDIA_TWILIO_AUTH_TOKEN)")
    g.add_argument("--twilio-insecure", action="store_true",
                   help="accept unsigned requests on /twilio/ (no auth token: anyone may open calls)")
    g.add_argument("--twilio-public-url", default=None, metavar="URL",
                   help="the web port's URL as Twilio calls it, https://HOST[:PORT] (default: each request's)")
    g = p.add_argument_group("the SIP door's calls API on the web port (/v1/sip/calls)")
    g.add_argument("--sip-calls", default=None, metavar="URL",
                   help="serve it, behind the web port's tokens, by forwarding to the door's --sip-control URL "
                        "(e.g. http://127.0.0.1:5070)")
    g = p.add_argument_group("tokens on the web port")
    g.add_argument("--auth-tokens", default=None, metavar="FILE",
                   help="token file (TOKEN [NAME] [limits] per line; default $RTMEDIA_AUTH_TOKENS, else no "
                        "authentication): every route but the page and /healthz wants Authorization: Bearer TOKEN")
    g = p.add_argument_group("toward the rtmedia server")
    g.add_argument("--server-tls", action="store_true",
                   help="connect with TLS, checking the server's certificate against the system's roots (or --server-ca)")
    g.add_argument("--server-ca", default=None, metavar="FILE",
                   help="PEM root certificates to check the server's certificate with (implies --server-tls)")
    g.add_argument("--server-cert", default=None, metavar="FILE",
                   help="PEM client certificate for mutual TLS, with --server-key (implies --server-tls)")
    g.add_argument("--server-key", default=None, metavar="FILE", help="PEM private key of --server-cert")
    g.add_argument("--server-token", default=None, metavar="TOKEN",
                   help=f"bearer token of the sessions whose browser presented none (default ${TOKEN_ENV}); "
                        "without TLS only to a loopback or unix: target")
    p.set_defaults(func=cmd_web)


def bridge_config(args: argparse.Namespace) -> object:
    from rtmedia.web.bridge import BridgeConfig, parse_udp_ports
    from rtmedia.web.openai.openai_api import OpenAIConfig
    from rtmedia.web.telephony.twilio import TwilioConfig

    twilio_flags = args.twilio_auth_token_file or args.twilio_insecure or args.twilio_public_url
    if twilio_flags and not args.twilio:
        raise ValueError("--twilio-auth-token-file, --twilio-insecure and --twilio-public-url need --twilio")
    twilio = TwilioConfig.load(args.twilio_auth_token_file, args.twilio_insecure, args.twilio_public_url) \
        if args.twilio else None
    session = {"responder": args.responder} if args.responder else {}
    server_token = args.server_token if args.server_token is not None else os.environ.get(TOKEN_ENV)
    return BridgeConfig(target=args.target, host=args.host, port=args.port, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, ice_servers=args.ice_servers,
                        udp_ports=parse_udp_ports(args.udp_ports) if args.udp_ports else None,
                        max_peers=args.max_peers, input_rate=args.input_rate, session=session,
                        audio_prefetch=args.audio_prefetch, media_host=args.media_host,
                        max_body_bytes=args.max_body_bytes, max_media_sections=args.max_media_sections,
                        connect_timeout_s=args.connect_timeout,
                        auth_tokens=args.auth_tokens, server_tls=args.server_tls, server_ca=args.server_ca,
                        server_cert=args.server_cert, server_key=args.server_key, server_token=server_token,
                        openai=OpenAIConfig(**{k: v for k, v in (("max_upload_bytes", args.openai_max_upload_bytes),
                                                                 ("max_requests", args.openai_max_requests),
                                                                 ("max_audio_seconds", args.openai_max_audio_seconds))
                                               if v is not None}) if args.openai_api else None,
                        twilio=twilio, sip_calls=args.sip_calls)


def cmd_web(args: argparse.Namespace) -> None:
    from rtmedia.protocol import logs
    from rtmedia.protocol.tokens import TokenTable

    if args.grace < 0:
        raise ValueError(f"--grace must be at least 0, got {args.grace:g}")
    config = bridge_config(args)
    tokens = TokenTable.load(args.auth_tokens)  # the file, else $RTMEDIA_AUTH_TOKENS; ValueError names it
    logs.configure("INFO", args.log_format)
    asyncio.run(run_bridge(config, tokens, args.grace))


async def run_bridge(config: object, tokens: object = None, grace_s: float = 30.0) -> None:
    """Serve until a signal: SIGTERM drains (`grace_s`), SIGINT or a second SIGTERM stops at
    once, SIGHUP reloads the TLS certificate and the tokens."""
    from rtmedia.web.bridge import Bridge

    bridge = Bridge(config, tokens)  # type: ignore[arg-type]
    drain, stop = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_term() -> None:
        (stop if drain.is_set() else drain).set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, bridge.reload)
    try:
        await bridge.start()
        print(f"rtmedia web: open {bridge.url} (bridging to {bridge.config.target})", file=sys.stderr, flush=True)
        draining = asyncio.create_task(drain.wait())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({draining, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if drain.is_set() and not stop.is_set():
            print(f"rtmedia web: draining (at most {grace_s:g} s)", file=sys.stderr, flush=True)
            drained = asyncio.create_task(bridge.drain(grace_s))
            await asyncio.wait({drained, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if drained.done():
                drained.result()
            else:
                drained.cancel()
        for task in (draining, stopping):
            task.cancel()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await bridge.stop()
