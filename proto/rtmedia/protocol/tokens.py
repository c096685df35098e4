"""Bearer tokens: the token file, and matching a presented token in constant time.

The server (gRPC) and the web front (HTTP) check the same tokens, so the file format is part
of the protocol (docs/operations.md#tokens-and-quotas). One token per line:

    TOKEN [NAME] [max_sessions=N] [sessions_per_minute=N]

`#` starts a comment; blank lines are ignored. A token is at least 16 characters of
letters, digits and `-._~+/=` (what a Bearer header may carry); NAME (default `token-LINE`)
is what sessions, metrics and logs show, never the token. The limits are per token:
concurrent sessions, and sessions opened in any 60 s. The same text may come from the
RTMEDIA_AUTH_TOKENS environment variable (lines, or tokens separated by commas).

A presented token is compared with every token of the table (SHA-256 digests, with
hmac.compare_digest), so the time taken does not depend on how much of it matched.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ENV = "RTMEDIA_AUTH_TOKENS"
MIN_TOKEN_CHARS = 16
_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/=]+$")
_NAME = re.compile(r"^[A-Za-z0-9\-._]{1,64}$")
_LIMITS = ("max_sessions", "sessions_per_minute")
BEARER = "bearer "
# Browsers cannot set headers on a WebSocket: they offer the token as this subprotocol.
WEBSOCKET_PROTOCOL_PREFIX = "rtmedia.bearer."
OPENAI_KEY_PROTOCOL_PREFIX = "openai-insecure-api-key."  # the Realtime API's browser form


@dataclass(frozen=True)
class Token:
    """One token of the table: its name, the digest of its secret, and its limits (None: none)."""
    name: str
    digest: bytes
    max_sessions: int | None = None
    sessions_per_minute: int | None = None


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse_tokens(text: str, source: str) -> list[Token]:
    """The tokens of a token file's text; ValueError naming `source`, the line and the problem
    (never the token itself)."""
    tokens: list[Token] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source} line {number}"
        secret, rest = fields[0], fields[1:]
        if len(secret) < MIN_TOKEN_CHARS or not _TOKEN.match(secret):
            raise ValueError(f"{where}: a token is at least {MIN_TOKEN_CHARS} characters of letters, digits "
                             "and -._~+/=")
        name, limits = f"token-{number}", {}
        for field_ in rest:
            key, eq, value = field_.partition("=")
            if not eq:
                if name != f"token-{number}" or not _NAME.match(field_):
                    raise ValueError(f"{where}: {field_[:64]!r} is not a name (1-64 letters, digits, -._) "
                                     "or a limit (max_sessions=N, sessions_per_minute=N)")
                name = field_
            elif key in _LIMITS and value.isdigit() and int(value) >= 1:
                limits[key] = int(value)
            else:
                raise ValueError(f"{where}: {field_[:64]!r}: the limits are max_sessions=N and "
                                 "sessions_per_minute=N, N >= 1")
        d = digest(secret)
        if d in digests:
            raise ValueError(f"{where}: the same token is listed twice")
        if name in names:
            raise ValueError(f"{where}: the name {name!r} is used twice")
        digests.add(d)
        names.add(name)
        tokens.append(Token(name, d, **limits))
    return tokens


class TokenTable:
    """The tokens in force; `match` a presented one. Empty table: authentication is off."""

    def __init__(self, tokens: Iterable[Token] = (), path: str | None = None) -> None:
        self.tokens = list(tokens)
        self.path = path

    @classmethod
    def load(cls, path: str | None = None, env: dict[str, str] | None = None) -> TokenTable:
        """From the token file `path`, else from RTMEDIA_AUTH_TOKENS, else empty (off)."""
        if path:
            try:
                text = Path(path).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the token file {path}: {exc.strerror or exc}") from exc
            return cls(parse_tokens(text, path), path)
        value = (os.environ if env is None else env).get(ENV, "")
        return cls(parse_tokens(value.replace(",", "\n"), ENV))

    def reloaded(self) -> TokenTable:
        """The table read again from its file (SIGHUP); a table from the environment stays as is."""
        return TokenTable.load(self.path) if self.path else self

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def match(self, presented: str | None) -> Token | None:
        """The token whose secret is `presented`, compared with every one in constant time."""
        if presented is None:
            return None
        wanted, found = digest(presented), None
        for token in self.tokens:
            if hmac.compare_digest(wanted, token.digest):
                found = token
        return found


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` value (scheme case-insensitive), else None."""
    if header is None or not header[: len(BEARER)].lower() == BEARER:
        return None
    return header[len(BEARER):].strip() or None


def target_host(target: str) -> str:
    """The host of a gRPC target: HOST:PORT, [V6]:PORT, dns:[//AUTH/]HOST:PORT, ipv4:/ipv6:ADDR,
    unix:PATH (this machine: "localhost")."""
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("unix", "unix-abstract"):
        return "localhost"
    if sep and scheme in ("dns", "ipv4", "ipv6"):
        target = rest.split("/")[-1] if rest.startswith("//") else rest
        target = target.split(",")[0]
    if target.startswith("["):
        return target[1:].partition("]")[0]
    if target.count(":") == 1:
        return target.rsplit(":", 1)[0]
    return target  # a bare name, or a bare IPv6 address


def is_loopback(host: str) -> bool:
    """localhost or a loopback address: where a token may travel in plaintext."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
