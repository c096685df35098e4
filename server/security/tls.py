"""TLS on the gRPC port, optionally mutual, with certificates reloaded without a restart.

grpc's dynamic server credentials ask `fetch` for a configuration at every new handshake:
it returns None (keep the current one) until `reload()` (SIGHUP) has read new files, then
the new configuration once. Live connections keep the certificate they were made with;
sessions are not dropped. A reload that cannot read or parse the files keeps the old
configuration and says why.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

log = logging.getLogger(__name__)


class ServerTls:
    """`cert`/`key`: the server's PEM certificate chain and key; `client_ca`: PEM CA bundle that
    client certificates must chain to (mutual TLS: a client without one is refused)."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._initial = self._read()

    def _read(self) -> grpc.ServerCertificateConfiguration:
        """The files as a grpc configuration; ValueError naming the file that is wrong."""
        cert, key = _pem(self.cert, "--tls-cert"), _pem(self.key, "--tls-key")
        try:
            x509.load_pem_x509_certificates(cert)
        except ValueError as exc:
            raise ValueError(f"--tls-cert {self.cert}: not a PEM certificate") from exc
        try:
            load_pem_private_key(key, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--tls-key {self.key}: not an unencrypted PEM private key") from exc
        ca = None
        if self.client_ca:
            ca = _pem(self.client_ca, "--tls-client-ca")
            try:
                x509.load_pem_x509_certificates(ca)
            except ValueError as exc:
                raise ValueError(f"--tls-client-ca {self.client_ca}: not a PEM certificate bundle") from exc
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._initial, self._fetch,
                                                   require_client_authentication=bool(self.client_ca))

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> bool:
        """Read the files again; new handshakes use them. False (and the old ones stay) if they are bad."""
        try:
            config = self._read()
        except ValueError as exc:
            log.error("TLS reload failed, keeping the previous certificate: %s", exc)
            return False
        with self._lock:
            self._pending = config
        log.info("TLS certificate reloaded", extra={"cert": self.cert})
        return True


def _pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from exc
