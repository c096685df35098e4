"""A stand-in SIP registrar (the trunk's side of a registration, the one fake of the SIP door's
registration test): answers REGISTER over UDP with a digest challenge (RFC 2617, MD5, no qop),
then 200 OK with the Contact and Expires when the Authorization's response is right for
`password`, 403 when it is wrong. Keeps every REGISTER it got."""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from dataclasses import dataclass, field

REALM = "trunk.test"
NONCE = "5f0c2a1b"


def _md5(text: str) -> str:
    return hashlib.md5(text.encode()).hexdigest()


@dataclass
class Registrar:
    user: str
    password: str
    registers: list[str] = field(default_factory=list)
    accepted: int = 0
    refused: int = 0

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(65536)
            except OSError:
                return
            text = data.decode(errors="replace")
            if not text.startswith("REGISTER "):
                continue
            self.registers.append(text)
            head = {}
            for line in text.split("\r\n\r\n", 1)[0].split("\r\n")[1:]:
                name, _, value = line.partition(":")
                head.setdefault(name.strip().lower(), []).append(value.strip())
            auth = (head.get("authorization") or [""])[0]
            if not auth:
                reply = ("401 Unauthorized", [f'WWW-Authenticate: Digest realm="{REALM}", nonce="{NONCE}", '
                                              'algorithm=MD5'])
            else:
                fields = dict(re.findall(r'(\w+)="?([^",]*)"?', auth))
                ha1 = _md5(f"{self.user}:{REALM}:{self.password}")
                expected = _md5(f"{ha1}:{NONCE}:{_md5('REGISTER:' + fields.get('uri', ''))}")
                if fields.get("username") == self.user and fields.get("response") == expected:
                    self.accepted += 1
                    contact = (head.get("contact") or [""])[0]
                    reply = ("200 OK", [f"Contact: {contact};expires=60" if contact else "Expires: 60", "Expires: 60"])
                else:
                    self.refused += 1
                    reply = ("403 Forbidden", [])
            lines = [f"SIP/2.0 {reply[0]}", *(f"{k}: {v}" for k in ("via", "from", "to", "call-id", "cseq")
                                              for v in head.get(k, [])),
                     *reply[1], "Content-Length: 0"]
            self.sock.sendto(("\r\n".join(lines) + "\r\n\r\n").encode(), peer)

    def close(self) -> None:
        self.sock.close()
