"""The web front's settings sections (rtmedia.protocol.settings) as `rtmedia serve` runs the
doors beside the server: the page and bridge (`web`), Twilio Media Streams on the web port
(`twilio`), and the SIP door's process (`sip`). `server/cli.py` composes them into the server's
configuration; `start_beside` and the SIP process take them typed."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from rtmedia.protocol.settings import Section, add_flag, setting

SRTP_MODES = ("off", "optional", "mandatory")


@dataclass
class WebSettings(Section):
    """The browser page and WebRTC bridge beside the server, on the server's host."""

    PREFIX = "web_"
    TITLE = "web: the page and WebRTC bridge beside the server"
    enabled: bool = setting(False, key="web", flags=("--web",),
                            help="also serve the browser page and WebRTC bridge (see `rtmedia web --help`)")
    port: int = setting(8080, help="port of the page and bridge (8080)")
    tls_cert: str | None = setting(None, metavar="FILE", help="PEM certificate: serve the page on https")
    tls_key: str | None = setting(None, metavar="FILE", help="PEM private key of --web-tls-cert")
    max_peers: int = setting(8, help="concurrent browser peers of the bridge (8)")
    openai_api: bool = setting(True, flags=("--no-openai-api",),
                               help="do not serve OpenAI's audio APIs (/v1/audio/speech, /v1/audio/transcriptions) "
                                    "on the web port")


@dataclass
class TwilioSettings(Section):
    """Twilio Media Streams on the web port (docs/telephony.md)."""

    PREFIX = "web_twilio_"
    TITLE = "twilio: phone calls Twilio connects on the web port"
    enabled: bool = setting(False, key="web_twilio", flags=("--web-twilio",),
                            help="answer phone calls Twilio connects on the web port (see `rtmedia web --help`)")
    auth_token_file: str | None = setting(None, metavar="FILE",
                                          help="the Twilio account's auth token (default: $RTMEDIA_TWILIO_AUTH_TOKEN)")
    insecure: bool = setting(False, flags=("--twilio-insecure",), deprecated=("--web-twilio-insecure",),
                             help="accept unsigned requests on /twilio/")
    public_url: str | None = setting(None, metavar="URL",
                                     help="the web port's URL as Twilio calls it, https://HOST[:PORT]")

    def check(self) -> None:
        if (self.auth_token_file or self.insecure or self.public_url) and not self.enabled:
            raise ValueError("web_twilio_auth_token_file, web_twilio_insecure and web_twilio_public_url need "
                             "web_twilio (--web-twilio)")


@dataclass
class SipSettings(Section):
    """The SIP door (docs/telephony.md#sip): `rtmedia sip`'s --sip-* flags, and for `serve --sip`
    whether it runs as a process beside the server (`enabled`). None: the door's own default."""

    PREFIX = "sip_"
    TITLE = "SIP (docs/telephony.md)"
    enabled: bool = setting(False, key="sip", flags=("--sip",),
                            help="also answer phone calls over SIP: `rtmedia sip` as a process beside the server, "
                                 "taking the --sip-* flags below (see `rtmedia sip --help`); with --web its calls "
                                 "API is on the web port too")
    listen: str | None = setting(None, metavar="HOST:PORT",
                                 help="address for SIP over UDP and TCP (default 127.0.0.1:5060; 0.0.0.0 for every "
                                      "address)")
    tls_listen: str | None = setting(None, metavar="HOST:PORT", help="also SIP over TLS here")
    tls_cert: str | None = setting(None, metavar="FILE", help="PEM certificate of --sip-tls-listen")
    tls_key: str | None = setting(None, metavar="FILE", help="PEM private key of --sip-tls-cert")
    srtp: str | None = setting(None, choices=SRTP_MODES,
                               help="SRTP for the calls' media (default optional: when the caller offers it)")
    register: str | None = setting(None, metavar="URI",
                                   help="register with a trunk or PBX as this address of record, "
                                        "sip:user@host[:port]")
    password_file: str | None = setting(None, metavar="FILE",
                                        help="the digest password of --sip-register (default $RTMEDIA_SIP_PASSWORD)")
    public_address: str | None = setting(None, metavar="ADDR",
                                         help="the address advertised in SDP and Contact (behind NAT, in Kubernetes)")
    rtp_ports: str | None = setting(None, aliases=("--rtp-ports",), metavar="LOW-HIGH",
                                    help="UDP ports of the calls' RTP and RTCP (default 40000-40999)")
    max_calls: int | None = setting(None, kind="int", aliases=("--max-calls",), metavar="N",
                                    help="calls at once, 1..4 (default 4: what one PJSIP process holds); one more "
                                         "gets 486 Busy Here")
    rtp_timeout: float | None = setting(None, kind="float", metavar="S",
                                        help="end a call whose RTP stopped for S seconds (default 30)")
    config: str | None = setting(None, metavar="FILE",
                                 help="YAML: trunks, per-number session settings, accept rules and hook, transfer "
                                      "targets")
    control: str | None = setting(None, metavar="HOST:PORT",
                                  help="the calls API and /metrics (default 127.0.0.1:5070; 'off': none)")
    responder: str | None = setting(None, help="responder of the calls' sessions (default: the server's)")
    echo_cancellation: str | None = setting(None, choices=("on", "off"),
                                            help="remove the reply's echo from the caller's audio, for speakerphone "
                                                 "lines (default off; per number in --sip-config)")

    def door_flags(self) -> dict[str, Any]:
        """The door's settings given (flat keys, without `sip`)."""
        return {k: v for k, v in self.flat().items() if k != "sip" and v is not None}

    @classmethod
    def add_door_flags(cls, parser: argparse.ArgumentParser, aliases: bool = False) -> Any:
        """The --sip-* flags alone (`rtmedia sip`'s; `aliases`: also --rtp-ports and --max-calls)."""
        group = parser.add_argument_group(cls.TITLE)
        for info in cls.fields():
            if info.name != "enabled":
                add_flag(group, info, aliases)
        return group

    @classmethod
    def from_flags(cls, flags: list[str]) -> SipSettings:
        """The legacy `sip_flags` key (a list of --sip-* argv strings) as settings; ValueError names it."""
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        cls.add_door_flags(parser)
        try:
            args, unknown = parser.parse_known_args([str(f) for f in flags])
        except argparse.ArgumentError as exc:
            raise ValueError(f"sip_flags: {exc}") from None
        if unknown:
            raise ValueError(f"sip_flags: not --sip-* flags: {' '.join(unknown)}")
        return cls.from_args(args)


def check_front(web: WebSettings, twilio: TwilioSettings, sip: SipSettings, auth_tokens: str | None) -> None:
    """Rules between the web front's sections and the server's tokens."""
    if twilio.enabled and not web.enabled:
        raise ValueError("web_twilio serves on the web port: it needs web (--web)")
    if twilio.enabled and auth_tokens:
        raise ValueError("web_twilio with auth_tokens: Twilio presents no token for the server to check; run "
                         "`rtmedia web --twilio --server-token TOKEN` beside the server instead")
    if sip.door_flags() and not sip.enabled:
        raise ValueError("the --sip-* flags (sip_flags) need --sip (sip)")
