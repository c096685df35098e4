"""The SIP door's tests and benchmark: the door as a process (`rtmedia sip`), and Debian's
baresip as the caller (a real SIP user agent no one here wrote): its `aufile` module plays a WAV
as the microphone, its `sndfile` module records what the caller hears, `ctrl_tcp` takes its
commands and reports its events (netstring JSON). Its player is ALSA's `pulse` device on a
PulseAudio null sink (tests/support/pulse.py: clocked, so baresip's playback thread waits as on a
sound card; ALSA's `null` device takes frames as fast as they come and the thread spins a core)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.serve import RTMEDIA, free_port
from tests.support.speech import write_wav
from tests.support.waits import until_sync

BARESIP = "/usr/bin/baresip"
MODULES = "/usr/lib/baresip/modules"


def free_udp_port() -> int:
    """A port free for UDP and TCP both (SIP listens on both), the next one free for TCP too
    (baresip's SIP over TLS listens there: a port taken there stops it starting)."""
    while True:
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tls:
            try:
                udp.bind(("127.0.0.1", port))
                tls.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


@dataclass
class Door:
    sip_port: int
    control: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log: Path
    rtp_ports: tuple[int, int]

    @property
    def uri(self) -> str:
        return f"sip:rtmedia@127.0.0.1:{self.sip_port}"

    def calls(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(f"{self.control}/v1/sip/calls", timeout=5) as res:
            return json.loads(res.read())

    def ended(self, count: int = 1, timeout: float = 20.0) -> list[dict[str, Any]]:
        """The last `count` ended calls, once there are that many more than `before`."""
        deadline = time.monotonic() + timeout
        while True:
            ended = self.calls()["ended"]
            if len(ended) >= count or time.monotonic() > deadline:
                return ended
            time.sleep(0.1)


@contextmanager
def running_door(target: str, *args: str, log: Path) -> Iterator[Door]:
    """`rtmedia sip --target TARGET ARGS` on free ports, once it listens."""
    sip, control = free_udp_port(), free_port()
    rtp = free_port() // 2 * 2
    with open(log, "wb") as out:
        process = subprocess.Popen([RTMEDIA, "sip", "--target", target, "--sip-listen", f"127.0.0.1:{sip}",
                                    "--sip-control", f"127.0.0.1:{control}", "--sip-rtp-ports",
                                    f"{rtp}-{rtp + 99}", *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        def started() -> bool:
            assert process.poll() is None, log.read_text(errors="replace")
            return b"rtmedia sip: SIP on" in log.read_bytes()

        until_sync(started, timeout=30, interval=0.1, what="the SIP door starting")
        yield Door(sip, f"http://127.0.0.1:{control}", process, log, (rtp, rtp + 99))
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Baresip:
    """One baresip process: a caller (or callee) with a WAV as its microphone."""

    def __init__(self, folder: Path, source: Path | None = None, answer: str = "manual",
                 jitter: str = "5-10", codecs: tuple[str, ...] = ("g711",), user: str = "caller",
                 env: dict[str, str] | None = None, config: str = "", account: str = "") -> None:
        """`env`: a PulseAudio server's (Pulse.env), for a clocked player; `config`: more config
        lines (and `module X.so` lines); `account`: more parameters of its account line."""
        self.folder, self.user = folder, user
        player = "alsa,pulse" if env and "PULSE_SERVER" in env else "alsa,null"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rec").mkdir(exist_ok=True)
        self.sip_port, self.ctrl_port = free_udp_port(), free_port()
        if source is None:  # (baresip's tone generator runs at 48 kHz only)
            source = write_wav(folder / "silence.wav", 8000, np.zeros(8000 * 120, np.int16))
        modules = "\n".join(f"module {m}.so" for m in (*codecs, "aufile", "alsa", "sndfile"))
        (folder / "config").write_text(f"""poll_method epoll
sip_listen 127.0.0.1:{self.sip_port}
audio_player {player}
audio_source aufile,{source}
audio_alert alsa,null
jitter_buffer_delay {jitter}
module_path {MODULES}
{modules}
module_app account.so
module_app menu.so
module_app ctrl_tcp.so
ctrl_tcp_listen 127.0.0.1:{self.ctrl_port}
snd_path {folder / "rec"}
{config}
""")
        (folder / "accounts").write_text(f"<sip:{user}@127.0.0.1:{self.sip_port}>;regint=0;answermode={answer}{account}\n")
        self.log = open(folder / "baresip.log", "wb")
        self.process = subprocess.Popen([BARESIP, "-f", str(folder)], stdout=self.log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env)
        self.events: list[dict[str, Any]] = []
        self._buffer = b""
        deadline = time.monotonic() + 10
        while True:
            try:
                self.ctrl = socket.create_connection(("127.0.0.1", self.ctrl_port), timeout=1)
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() >= deadline:
                    self.process.kill()
                    self.process.wait()
                    self.log.close()
                    said = (folder / "baresip.log").read_text(errors="replace").strip().splitlines()[-3:]
                    raise AssertionError(f"baresip did not start: {' / '.join(said)}") from None
                time.sleep(0.05)

    @property
    def uri(self) -> str:
        return f"sip:{self.user}@127.0.0.1:{self.sip_port}"

    def command(self, name: str, params: str = "") -> None:
        body = json.dumps({"command": name, "params": params, "token": name}).encode()
        self.ctrl.sendall(b"%d:%s," % (len(body), body))

    def _read(self, timeout: float) -> dict[str, Any] | None:
        self.ctrl.settimeout(timeout)
        while True:
            head, colon, rest = self._buffer.partition(b":")
            if colon and len(rest) > int(head):
                self._buffer = rest[int(head) + 1:]
                return json.loads(rest[: int(head)])
            try:
                chunk = self.ctrl.recv(65536)
            except TimeoutError:
                return None
            if not chunk:
                return None
            self._buffer += chunk

    def wait(self, kind: str, timeout: float = 20.0) -> dict[str, Any]:
        """The next event of `kind` (CALL_ESTABLISHED, CALL_CLOSED, CALL_TRANSFER, ...)."""
        for event in self.events:
            if event.get("type") == kind:
                self.events.remove(event)
                return event
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self._read(left)
            if msg is None:
                break
            if msg.get("event"):
                if msg.get("type") == kind:
                    return msg
                self.events.append(msg)
        raise AssertionError(f"baresip: no {kind} within {timeout:g} s (events: {[e.get('type') for e in self.events]})")

    def heard(self) -> tuple[np.ndarray, int]:
        """What the caller heard (sndfile's decode recording of the last call): samples, rate."""
        files = sorted((self.folder / "rec").glob("*-dec.wav"))
        assert files, "baresip recorded nothing"
        with wave.open(str(files[-1])) as f:
            return np.frombuffer(f.readframes(f.getnframes()), "<i2").copy(), f.getframerate()

    def close(self) -> None:
        with_quit = self.process.poll() is None
        if with_quit:
            self.command("quit")
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.ctrl.close()
        self.log.close()


@contextmanager
def baresip(folder: Path, source: Path | None = None, **kwargs: Any) -> Iterator[Baresip]:
    phone = Baresip(folder, source, **kwargs)
    try:
        yield phone
    finally:
        phone.close()
