"""Throwaway certificates for TLS tests: a CA, a server certificate for this machine
(127.0.0.1, ::1, localhost) and a client certificate, all signed by the CA, written as PEM
files with the `cryptography` package (EC P-256 keys: quick to make)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    """The PEM files' paths."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
           *, ca: bool = False, sans: list[x509.GeneralName] | None = None,
           usage: list[x509.ObjectIdentifier] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path) -> Certs:
    """A fresh CA and the server and client certificates it signed, as PEM files in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("rtmedia test CA")
    ca_cert = _issue("rtmedia test CA", ca_key, ca_name, ca_key, ca=True)
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                    x509.IPAddress(ipaddress.ip_address("::1"))]
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server_cert = _issue("localhost", server_key, ca_name, ca_key, sans=sans, usage=[ExtendedKeyUsageOID.SERVER_AUTH])
    client_cert = _issue("rtmedia test client", client_key, ca_name, ca_key,
                         usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    certs = Certs(directory / "ca.pem", directory / "server.pem", directory / "server.key",
                  directory / "client.pem", directory / "client.key")
    certs.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    certs.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    certs.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(certs.server_key, server_key)
    _write_key(certs.client_key, client_key)
    return certs
