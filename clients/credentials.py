"""How a client command proves itself to the server: TLS, a client certificate (mutual TLS)
and a bearer token, from the --tls, --ca, --cert, --key and --token flags, made into a grpc
channel (sync or aio) and into one-line messages for the server's refusals.

The token travels as the metadata `authorization: Bearer TOKEN`. Over TLS it is call
credentials composed with the channel's (gRPC's own way). gRPC refuses call credentials on
an insecure channel, so in plaintext a client interceptor adds it to every call instead, and
only to a loopback target: a token sent in the clear over a network is a token given away.
"""

from __future__ import annotations

import argparse
import collections
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from rtmedia.protocol.tokens import is_loopback, target_host

TOKEN_ENV = "RTMEDIA_TOKEN"
AUTHORIZATION = "authorization"


class CredentialsError(ValueError):
    """A bad flag or an unreadable file: the CLI reports it as one line."""


def add_credential_flags(p: argparse.ArgumentParser) -> None:
    """The connection-security flags, in their own help group."""
    g = p.add_argument_group("connection security")
    g.add_argument("--tls", action="store_true",
                   help="connect with TLS, checking the server's certificate against the default roots (or --ca)")
    g.add_argument("--ca", type=Path, default=None, metavar="FILE",
                   help="PEM root certificates to check the server's certificate with (implies --tls)")
    g.add_argument("--cert", type=Path, default=None, metavar="FILE",
                   help="PEM client certificate for mutual TLS, with --key (implies --tls)")
    g.add_argument("--key", type=Path, default=None, metavar="FILE",
                   help="PEM private key of --cert (implies --tls)")
    g.add_argument("--token", default=None, metavar="TOKEN",
                   help=f"bearer token sent as `authorization: Bearer TOKEN` (default: ${TOKEN_ENV}); "
                        "without TLS only to a loopback address")


@dataclass(frozen=True)
class Credentials:
    """What a channel is opened with; the default is plaintext without a token."""

    tls: bool = False
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    token: str | None = None

    @property
    def mutual(self) -> bool:
        return self.certificate_chain is not None

    def describe(self) -> str:
        """How it connects, for messages: "with TLS", "with mutual TLS", "without TLS"."""
        return "with mutual TLS" if self.mutual else "with TLS" if self.tls else "without TLS"

    def check(self, target: str) -> None:
        """Refuse to send a token in plaintext anywhere but to this machine."""
        if self.token and not self.tls and not is_loopback(target_host(target)):
            raise CredentialsError(f"refusing to send a token in plaintext to {target_host(target)}; use --tls")

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        creds = grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)
        if self.token:
            creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(self.token))
        return creds

    def channel(self, target: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A sync channel to `target`."""
        self.check(target)
        if self.tls:
            return grpc.secure_channel(target, self._channel_credentials(), options=options)
        channel = grpc.insecure_channel(target, options=options)
        return grpc.intercept_channel(channel, _Bearer(self.token)) if self.token else channel

    def aio_channel(self, target: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        """A grpc.aio channel to `target`."""
        self.check(target)
        if self.tls:
            return grpc.aio.secure_channel(target, self._channel_credentials(), options=options)
        interceptors = _aio_bearers(self.token) if self.token else None
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def from_args(args: argparse.Namespace) -> Credentials:
    """The flags' credentials (files read now, so a bad one fails before any work), checked
    against args.target."""
    ca, cert, key = getattr(args, "ca", None), getattr(args, "cert", None), getattr(args, "key", None)
    if (cert is None) != (key is None):
        raise CredentialsError("--cert and --key go together: give both for mutual TLS, or neither")
    token = token_of(args)
    if token and not all("!" <= c <= "~" for c in token):
        raise CredentialsError("--token: a token is printable ASCII without spaces")
    creds = Credentials(
        tls=bool(getattr(args, "tls", False) or ca or cert),
        root_certificates=read_pem("--ca", ca, b"CERTIFICATE"),
        private_key=read_pem("--key", key, b"PRIVATE KEY"),
        certificate_chain=read_pem("--cert", cert, b"CERTIFICATE"),
        token=token,
    )
    creds.check(args.target)
    return creds


def token_of(args: argparse.Namespace) -> str | None:
    """--token, else $RTMEDIA_TOKEN, for a command that takes the flags (None: no token)."""
    if not hasattr(args, "token"):
        return None
    token = (args.token if args.token is not None else os.environ.get(TOKEN_ENV)) or ""
    return token.strip() or None


def read_pem(flag: str, path: str | Path | None, kind: bytes) -> bytes | None:
    """A PEM file's bytes; an unreadable or non-PEM file is a CredentialsError naming it
    (gRPC itself would only fail later, at the handshake, without saying which file)."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CredentialsError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or kind not in data:
        raise CredentialsError(f"{flag} {path}: not a PEM file holding a {kind.decode().lower()}")
    return data


# ---- the token in plaintext: an interceptor adds it to every call ------------------------------

class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Sync interceptor: `authorization: Bearer TOKEN` on every call."""

    def __init__(self, token: str) -> None:
        self.header = (AUTHORIZATION, f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), self.header), d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)


class _AioBearer:
    """grpc.aio interceptors: `authorization: Bearer TOKEN` on every call. One class per kind of
    call, as a grpc.aio channel files each interceptor under the first kind it is."""

    def __init__(self, token: str) -> None:
        self.header = (AUTHORIZATION, f"Bearer {token}")

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return d._replace(metadata=grpc.aio.Metadata(*(d.metadata or ()), self.header))


class _AioUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), requests)


def _aio_bearers(token: str) -> list[_AioBearer]:
    return [kind(token) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


# ---- the server's refusals as one line ------------------------------------------------------------

def status_refusal(code: grpc.StatusCode, details: str, reason: str, metadata: dict[str, str],
                   token_sent: bool) -> str | None:
    """A refusal for want of a token or over a token's quota, as one line; None for other statuses."""
    lines = details.strip().splitlines()
    said = f": {lines[0]}" if lines else ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if token_sent:
            return f"the server refused the token (UNAUTHENTICATED){said}"
        return f"the server wants a token (UNAUTHENTICATED){said}; give --token or set {TOKEN_ENV}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason == "QUOTA":
        retry = metadata.get("retry_after_s")
        return f"over the token's quota (QUOTA){said}" + (f"; retry in {retry} s" if retry else "")
    return None


def unavailable_hint(args: argparse.Namespace, details: str) -> str:
    """What to try when the server could not be reached, from the flags given: a TLS server
    just closes a plaintext connection, and one that requires a client certificate closes a
    TLS connection that brings none (a failed handshake says what failed by itself)."""
    said = details.lower()
    if not hasattr(args, "tls") or args.cert is not None or "handshake" in said:
        return ""
    if args.tls or args.ca:
        return "; if the server requires a client certificate, give --cert and --key"
    if "refused" in said:  # nothing listens there: TLS is not the question
        return ""
    return "; if the server uses TLS, give --tls (and --ca FILE for a private CA)"
