"""The WebRTC bridge's settings (rtmedia.web.bridge): `BridgeConfig`, checked whole when it is
made, and the small parsers of what its flags spell (a UDP port range, a gRPC target's
locality, a token that may travel as gRPC metadata)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rtmedia.protocol.tokens import is_loopback, target_host
from rtmedia.web.openai.openai_api import OpenAIConfig
from rtmedia.web.telephony.twilio import TwilioConfig
from rtmedia.web.webrtc.offers import MAX_BODY_BYTES, MAX_MEDIA_SECTIONS
from rtmedia.web.webrtc.peer import VideoDefaults


@dataclass
class BridgeConfig:
    target: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8080
    tls_cert: str | None = None
    tls_key: str | None = None
    ice_servers: list[str] = field(default_factory=list)
    udp_ports: tuple[int, int] | None = None
    max_peers: int = 8
    input_rate: int = 16000  # the session's input rate: the microphone is resampled to it
    # Microphone frames held before decoding: 0 decodes each packet as it arrives (a late
    # packet is dropped), N adds N x 20 ms (aiortc's own 4: 80 ms). Raise it on paths with
    # much jitter or reordering.
    audio_prefetch: int = 0
    # The connect deadline: an answered peer whose connection (ICE and DTLS) is not up within this
    # is closed, giving back its slot and its session. A browser on loopback connects well within
    # a second; a TURN relay across the world within a few.
    connect_timeout_s: float = 10.0
    max_body_bytes: int = MAX_BODY_BYTES  # an HTTP request body (aiohttp's client_max_size); larger is 413
    max_media_sections: int = MAX_MEDIA_SECTIONS  # m= sections of one offer; more is 400
    # Address ICE's UDP media sockets bind (and gather host candidates) on; None: `host`'s.
    # "0.0.0.0": every IPv4 address, "::" or "": every address.
    media_host: str | None = None
    session: dict[str, Any] = field(default_factory=dict)  # session.update fields every session starts with
    video: VideoDefaults = field(default_factory=VideoDefaults)
    # The web port's token file (rtmedia.protocol.tokens; None: the table the Bridge is given, or none).
    auth_tokens: str | None = None
    # Toward the server: TLS (server_ca: PEM roots, implies it; default the system's), a client
    # certificate (mutual TLS, implies it), and the token calls carry when the browser gave none.
    server_tls: bool = False
    server_ca: str | None = None
    server_cert: str | None = None
    server_key: str | None = None
    server_token: str | None = None
    # OpenAI's audio HTTP APIs under /v1/ (rtmedia.web.openai.openai_api); None: not served.
    openai: OpenAIConfig | None = field(default_factory=OpenAIConfig)
    # Twilio Media Streams under /twilio/ (rtmedia.web.telephony.twilio); None: not served.
    twilio: TwilioConfig | None = None
    # The SIP door's calls API, forwarded from /v1/sip/calls to its control URL; None: not served.
    sip_calls: str | None = None

    def __post_init__(self) -> None:
        if self.sip_calls is not None and not re.match(r"https?://[^/\s]+/?$", self.sip_calls):
            raise ValueError(f"--sip-calls must be the SIP door's control URL, http://HOST:PORT; got {self.sip_calls!r}")
        if not 0 <= self.audio_prefetch <= 16:
            raise ValueError(f"audio_prefetch must be 0..16 frames, got {self.audio_prefetch}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be more than 0 seconds, got {self.connect_timeout_s}")
        if self.max_peers < 1:
            raise ValueError(f"max_peers must be at least 1, got {self.max_peers}")
        if not 1024 <= self.max_body_bytes <= 16 * 1024 * 1024:
            raise ValueError(f"max_body_bytes must be 1024..16777216, got {self.max_body_bytes}")
        if not 1 <= self.max_media_sections <= 64:
            raise ValueError(f"max_media_sections must be 1..64, got {self.max_media_sections}")
        if self.input_rate not in (8000, 16000, 24000):
            raise ValueError(f"input_rate must be 8000, 16000 or 24000, got {self.input_rate}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("a TLS certificate needs its key and a key its certificate (--tls-cert and --tls-key)")
        if self.udp_ports is not None:
            lo, hi = self.udp_ports
            if not 1 <= lo <= hi <= 65535:
                raise ValueError(f"udp_ports must be a range A-B with 1 <= A <= B <= 65535, got {lo}-{hi}")
        for url in self.ice_servers:
            if not url.startswith(("stun:", "turn:", "turns:")):
                raise ValueError(f"ICE server {url!r} must be a stun:, turn: or turns: URL")
        if bool(self.server_cert) != bool(self.server_key):
            raise ValueError("a client certificate needs its key and a key its certificate "
                             "(--server-cert and --server-key)")
        if self.server_ca or self.server_cert:
            self.server_tls = True
        if self.server_token is not None:
            self.server_token = self.server_token.strip() or None
        if self.server_token and not is_metadata_value(self.server_token):
            raise ValueError("--server-token: a token is printable ASCII without spaces")
        if self.server_token and not self.server_tls and not is_local_target(self.target):
            raise ValueError(f"refusing to send --server-token in plaintext to {self.target}; "
                             "use --server-tls (or a loopback or unix: target)")

    @property
    def media_bind_host(self) -> str:
        return self.host if self.media_host is None else self.media_host

    @property
    def forwards_tokens(self) -> bool:
        """Whether tokens may travel to the server: over TLS, or to this machine."""
        return self.server_tls or is_local_target(self.target)


def is_metadata_value(text: str) -> bool:
    """Printable ASCII without spaces: what a bearer token is and a gRPC metadata value may carry."""
    return bool(text) and all("!" <= c <= "~" for c in text)


def is_local_target(target: str) -> bool:
    """A gRPC target on this machine (unix:, a loopback address, localhost)."""
    return is_loopback(target_host(target))


def parse_udp_ports(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(part) for part in text.split("-"))
    except ValueError:
        raise ValueError(f"--udp-ports must look like 40000-40100, got {text!r}") from None
    return lo, hi
