"""The SIP door's configuration (docs/telephony.md#sip): the `--sip-*` flags, and the file
`--sip-config` names (YAML) for what flags say badly: trunks, per-number session settings, the
accept/reject rules and hook, the transfer targets the agent may use, the headers passed on.

Everything is checked when it loads: a mistake is a ValueError naming the flag or the key.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

PASSWORD_ENV = "RTMEDIA_SIP_PASSWORD"
# The calls one PJSIP process holds at once: PJSUA_MAX_CALLS, a compile-time constant, is 4 in
# the pjsua2-python wheel (PJSIP's default); beyond it pjsua itself answers 486 ("Unable to
# accept incoming call (too many calls)"). More calls at once take more doors.
PJSIP_MAX_CALLS = 4
SRTP_MODES = ("off", "optional", "mandatory")
# Session settings a call's config may set (the door owns the audio formats and the tools).
SESSION_KEYS = ("responder", "voice", "instructions", "turn_detection", "noise_reduction", "input_audio_transcription",
                "max_output_tokens", "speed", "max_session_s", "idle_timeout_s")
# A call's settings the door itself applies (beside the session's).
CALL_KEYS = ("echo_cancellation",)


def host_port(text: str, flag: str, default_port: int | None = None) -> tuple[str, int]:
    """HOST:PORT (PORT may be 0: any free one); a bare HOST takes `default_port` when there is one."""
    host, sep, port = text.rpartition(":")
    if not sep and default_port is not None:
        host, port = text, str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{flag} must be HOST:PORT, got {text!r}")
    return host, int(port)


def port_range(text: str, flag: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not sep or not lo.isdigit() or not hi.isdigit() or not 1024 <= int(lo) <= int(hi) <= 65535 \
            or int(hi) - int(lo) < 1:
        raise ValueError(f"{flag} must be LOW-HIGH within 1024-65535 (at least two ports: RTP and RTCP), got {text!r}")
    return int(lo), int(hi)


def sip_uri(text: str, flag: str) -> str:
    if not re.fullmatch(r"sips?:([^@\s]+@)?[^@\s:;]+(:\d+)?(;\S*)?", text):
        raise ValueError(f"{flag} must be a SIP URI like sip:user@host[:port], got {text!r}")
    return text


def read_password(path: str | None, flag: str) -> str | None:
    """A password from a file (its first line), else $RTMEDIA_SIP_PASSWORD; None: none."""
    if path is None:
        return os.environ.get(PASSWORD_ENV) or None
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not text:
        raise ValueError(f"{flag} {path}: the file is empty")
    return text.splitlines()[0].strip()


def session_settings(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping of session settings")
    unknown = sorted(set(value) - set(SESSION_KEYS) - set(CALL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown session settings {', '.join(unknown)} "
                         f"(known: {', '.join(SESSION_KEYS + CALL_KEYS)})")
    if not isinstance(value.get("echo_cancellation", True), bool):
        raise ValueError(f"{where}: echo_cancellation must be true or false")
    return dict(value)


@dataclass(frozen=True)
class Trunk:
    """A SIP trunk or PBX the door registers with: calls arriving through it (and calls dialled
    out through it) take its session settings and count against its `max_calls`."""

    name: str
    register: str  # sip:user@host[:port]
    username: str
    password: str | None
    registrar: str  # sip:host[:port]
    expires_s: int = 300
    max_calls: int | None = None
    session: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_uri(cls, name: str, uri: str, password: str | None, **rest: Any) -> Trunk:
        sip_uri(uri, f"trunk {name}: register")
        scheme, _, address = uri.partition(":")
        user, _, hostport = address.rpartition("@")
        if not user:
            raise ValueError(f"trunk {name}: register {uri!r} names no user (sip:user@host)")
        return cls(name, uri, rest.pop("username", None) or user, password, f"{scheme}:{hostport.split(';')[0]}",
                   **rest)


@dataclass(frozen=True)
class AcceptRules:
    """Which calls are answered: `deny` patterns first, then `allow` (none: everyone), matched
    with shell wildcards against the caller (the From URI's user part and the whole URI); then
    the `webhook` (a URL; it answers {"accept": bool, "status": int, "session": {...}})."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    webhook: str | None = None
    webhook_timeout_s: float = 3.0

    def decide(self, caller: str, caller_uri: str) -> bool:
        def hit(patterns: tuple[str, ...]) -> bool:
            return any(fnmatch.fnmatchcase(caller, p) or fnmatch.fnmatchcase(caller_uri, p) for p in patterns)

        return not hit(self.deny) and (not self.allow or hit(self.allow))


@dataclass(frozen=True)
class SipConfig:
    listen: tuple[str, int] = ("127.0.0.1", 5060)  # UDP and TCP
    tls_listen: tuple[str, int] | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    srtp: str = "optional"
    public_address: str | None = None  # advertised in SDP and Contact (NAT, Kubernetes)
    rtp_ports: tuple[int, int] = (40000, 40999)
    max_calls: int = PJSIP_MAX_CALLS
    rtp_timeout_s: float = 30.0
    ring_timeout_s: float = 30.0  # an outbound call nobody answers
    control: tuple[str, int] | None = ("127.0.0.1", 5070)  # the calls API and /metrics
    session: dict[str, Any] = field(default_factory=dict)  # every call's settings
    numbers: dict[str, dict[str, Any]] = field(default_factory=dict)  # per called number
    trunks: tuple[Trunk, ...] = ()
    accept: AcceptRules = AcceptRules()
    transfer_allow: tuple[str, ...] = ()  # targets transfer_call may use (none: no transfer_call tool)
    headers: tuple[str, ...] = ("X-*",)  # INVITE headers passed to the session (patterns)
    codecs: tuple[str, ...] = ("G722", "PCMU", "PCMA")  # in order of preference
    # A call's default (web/telephony/echo.py); its settings may say otherwise. Off: the canceller
    # also dims the caller's voice while the reply plays, which can hide a barge-in (BENCHMARKS.md).
    echo_cancellation: bool = False
    log_level: int = 1  # PJSIP's own log level (0-6) written to the door's log

    def __post_init__(self) -> None:
        if self.srtp not in SRTP_MODES:
            raise ValueError(f"--sip-srtp must be one of {', '.join(SRTP_MODES)}, got {self.srtp!r}")
        if not 1 <= self.max_calls <= PJSIP_MAX_CALLS:
            raise ValueError(f"--sip-max-calls must be within 1..{PJSIP_MAX_CALLS}, got {self.max_calls}: this "
                             f"PJSIP build holds {PJSIP_MAX_CALLS} calls a process (run more doors for more: "
                             "docs/telephony.md#sip)")
        if self.rtp_timeout_s <= 0 or self.ring_timeout_s <= 0:
            raise ValueError("--sip-rtp-timeout and ring_timeout_s must be positive")
        if self.tls_listen is not None and not (self.tls_cert and self.tls_key):
            raise ValueError("--sip-tls-listen needs --sip-tls-cert and --sip-tls-key")
        ports = self.rtp_ports[1] - self.rtp_ports[0] + 1
        if ports < 2 * self.max_calls:
            raise ValueError(f"--sip-rtp-ports {self.rtp_ports[0]}-{self.rtp_ports[1]} holds {ports // 2} calls "
                             f"(RTP and RTCP each take a port), fewer than --sip-max-calls {self.max_calls}")

    def for_call(self, called: str, trunk: Trunk | None) -> dict[str, Any]:
        """A call's session settings: every call's, then its trunk's, then its number's."""
        return {**self.session, **(trunk.session if trunk else {}), **self.numbers.get(called, {})}

    def may_transfer_to(self, target: str) -> bool:
        return any(fnmatch.fnmatchcase(target, p) for p in self.transfer_allow)


def load_file(path: str) -> dict[str, Any]:
    """The --sip-config file's settings, as SipConfig keyword arguments."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ValueError(f"--sip-config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--sip-config {path}: not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--sip-config {path}: expected a mapping at the top")
    known = {"session", "numbers", "trunks", "accept", "transfer", "headers", "codecs"}
    if unknown := sorted(set(data) - known):
        raise ValueError(f"--sip-config {path}: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    out: dict[str, Any] = {"session": session_settings(data.get("session"), f"{path}: session")}
    numbers = data.get("numbers") or {}
    if not isinstance(numbers, dict):
        raise ValueError(f"{path}: numbers must map called numbers to session settings")
    out["numbers"] = {str(k): session_settings(v, f"{path}: numbers.{k}") for k, v in numbers.items()}
    trunks = []
    for i, t in enumerate(data.get("trunks") or []):
        where = f"{path}: trunks[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("register"), str):
            raise ValueError(f"{where}: each trunk needs `register: sip:user@host`")
        if unknown := sorted(set(t) - {"name", "register", "username", "password_file", "expires_s", "max_calls",
                                       "session"}):
            raise ValueError(f"{where}: unknown keys {', '.join(unknown)}")
        password = read_password(t.get("password_file"), f"{where}: password_file") if t.get("password_file") else None
        trunks.append(Trunk.from_uri(str(t.get("name") or f"trunk{i}"), t["register"], password,
                                     username=t.get("username"), expires_s=int(t.get("expires_s", 300)),
                                     max_calls=t.get("max_calls"),
                                     session=session_settings(t.get("session"), f"{where}: session")))
    out["trunks"] = tuple(trunks)
    accept = data.get("accept") or {}
    if not isinstance(accept, dict) or set(accept) - {"allow", "deny", "webhook", "webhook_timeout_s"}:
        raise ValueError(f"{path}: accept takes allow, deny (lists of caller patterns), webhook and "
                         "webhook_timeout_s")
    if accept.get("webhook") and urlsplit(str(accept["webhook"])).scheme not in ("http", "https"):
        raise ValueError(f"{path}: accept.webhook must be an http(s) URL")
    out["accept"] = AcceptRules(tuple(map(str, accept.get("allow") or ())), tuple(map(str, accept.get("deny") or ())),
                                accept.get("webhook"), float(accept.get("webhook_timeout_s", 3.0)))
    transfer = data.get("transfer") or {}
    if not isinstance(transfer, dict) or set(transfer) - {"allow"}:
        raise ValueError(f"{path}: transfer takes allow (a list of target patterns)")
    out["transfer_allow"] = tuple(map(str, transfer.get("allow") or ()))
    if "headers" in data:
        out["headers"] = tuple(map(str, data["headers"] or ()))
    if "codecs" in data:
        codecs = tuple(str(c).upper() for c in data["codecs"] or ())
        if not codecs or set(codecs) - {"G722", "PCMU", "PCMA"}:
            raise ValueError(f"{path}: codecs must list some of G722, PCMU, PCMA")
        out["codecs"] = codecs
    return out
