"""A WebRTC peer for tests and benchmarks of the bridge, on aiortc: it speaks PCM into a
microphone track at real-time pace, records the reply audio it receives with arrival
times, and keeps the `events` data channel's messages."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import av
import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from rtmedia.web.playout import PlayoutBuffer
from rtmedia.web.webrtc.tracks import FRAME_SAMPLES, PLAYOUT_RATE, ReplyAudioTrack, set_audio_prefetch

from tests.support.serve import FEW_SPEAKERS, RTMEDIA, free_port, running_server

RATE = PLAYOUT_RATE  # 48 kHz
FRAME = FRAME_SAMPLES  # 20 ms
VOICED_RMS = 10 ** (-45 / 20)  # -45 dBFS, as `rtmedia talk` counts a chunk voiced


def frame_rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean((samples.astype(np.float64) / 32768) ** 2))) if len(samples) else 0.0


class SpeechTrack(ReplyAudioTrack):
    """A microphone: the bridge's own paced 20 ms track, over a playout buffer that holds
    what is queued to say (silence in between); remembers when each voiced frame went
    out (perf_counter)."""

    def __init__(self) -> None:
        super().__init__(PlayoutBuffer(PLAYOUT_RATE, max_ms=600_000))
        self.voiced_sent: list[float] = []

    def say(self, samples: np.ndarray) -> float:
        """Queue audio; returns its duration in seconds."""
        samples = samples.astype(np.int16)
        self.buffer.push("speech", samples)
        return len(samples) / RATE

    async def recv(self) -> av.AudioFrame:
        frame = await super().recv()
        if frame_rms(frame.to_ndarray().reshape(-1)) > VOICED_RMS:
            self.voiced_sent.append(time.perf_counter())
        return frame


class BridgePeer:
    """One aiortc peer connected to a bridge through POST /offer (or /whip)."""

    def __init__(self, base_url: str, video: bool = False, prefetch: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.video = video
        self.prefetch = prefetch  # audio jitter-buffer frames (None: aiortc's 4)
        self.pc = RTCPeerConnection()
        self.mic = SpeechTrack()
        self.events: list[dict[str, Any]] = []
        self.received: list[tuple[float, float]] = []  # (arrival perf_counter, rms) per reply frame
        self.video_frames: list[tuple[float, tuple[int, int]]] = []
        self.peer_id = ""
        self._arrived = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self.channel = self.pc.createDataChannel("events")
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)

    def _on_message(self, message: str) -> None:
        event = json.loads(message)
        event["t"] = time.perf_counter()
        self.events.append(event)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._arrived:
            self._arrived.notify_all()

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(self._record(track)))

    async def _record(self, track: MediaStreamTrack) -> None:
        with_audio = track.kind == "audio"
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            now = time.perf_counter()
            if with_audio:
                data = frame.to_ndarray().reshape(-1)
                if len(frame.layout.channels) > 1:
                    data = data.reshape(-1, len(frame.layout.channels))[:, 0]
                self.received.append((now, frame_rms(data)))
            else:
                self.video_frames.append((now, (frame.width, frame.height)))

    async def offer_sdp(self) -> str:
        self.pc.addTrack(self.mic)
        if self.video:
            self.pc.addTransceiver("video", direction="recvonly")
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(self, session: aiohttp.ClientSession) -> None:
        sdp = await self.offer_sdp()
        async with session.post(f"{self.base_url}/offer", json={"sdp": sdp, "type": "offer"}) as res:
            body = await res.json()
            if res.status != 200:
                raise AssertionError(f"offer refused ({res.status}): {body}")
        self.peer_id = body["id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type="answer"))
        if self.prefetch is not None:
            set_audio_prefetch(self.pc, self.prefetch)

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    async def wait_for(self, kind: str, timeout: float = 20.0, count: int = 1, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            hits = [e for e in self.events if e["type"] == kind and all(e.get(k) == v for k, v in match.items())]
            return hits[count - 1] if len(hits) >= count else None

        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: found() is not None), timeout)
            except TimeoutError:
                types = [e["type"] for e in self.events]
                raise AssertionError(f"no {kind} {match} within {timeout} s; got {types}") from None
        result = found()
        assert result is not None
        return result

    def first_audible(self, after: float) -> float | None:
        """Arrival time of the first received reply frame above -45 dBFS after `after`."""
        return next((t for t, level in self.received if t > after and level > VOICED_RMS), None)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pc.close()


# ---- hostile clients ------------------------------------------------------------------------------

def _strip_codecs(sdp: str) -> str:
    return "\r\n".join(line for line in sdp.split("\r\n") if not line.startswith(("a=rtpmap", "a=fmtp", "a=rtcp-fb")))


def _unknown_codecs(sdp: str) -> str:
    return re.sub(r"a=rtpmap:(\d+) [\w-]+/", r"a=rtpmap:\1 nosuchcodec/", sdp)


def _audio_section(sdp: str) -> str:
    start = sdp.index("m=audio")
    end = sdp.find("m=", start + 1)
    return sdp[start:end if end > 0 else len(sdp)]


def repeat_audio(sdp: str, times: int, fresh_mids: bool) -> str:
    audio = _audio_section(sdp)
    copies = [audio.replace("a=mid:0", f"a=mid:a{i}") if fresh_mids else audio for i in range(times)]
    return sdp.replace(audio, audio + "".join(copies))


def hostile_requests(sdp: str) -> list[tuple[str, str, bytes, str, int, str]]:
    """Bad requests a hostile client may send the bridge, made from a good offer `sdp` (with audio,
    video and a data channel): (name, path, body, content type, the status the bridge answers
    with the default limits, a word its JSON error must contain)."""
    bundle = re.search(r"a=group:BUNDLE [^\r\n]*", sdp).group(0)
    deep = b"[" * 30000 + b"]" * 30000

    def as_offer(text: str) -> bytes:
        return json.dumps({"sdp": text, "type": "offer"}).encode()

    return [
        ("whip body not UTF-8", "/whip", b"v=0\r\n\xff\xfe\r\n", "application/sdp", 400, "UTF-8"),
        ("offer body not UTF-8", "/offer", b'{"sdp": "v=0\xff", "type": "offer"}', "application/json", 400, "UTF-8"),
        ("whip unknown charset", "/whip", sdp.encode(), "application/sdp; charset=no-such-charset", 415, "charset"),
        ("offer unknown charset", "/offer", as_offer(sdp), "application/json; charset=no-such-charset", 415,
         "charset"),
        ("offer non-text charset", "/offer", as_offer(sdp), "application/json; charset=base64", 415, "charset"),
        ("deeply nested JSON", "/offer", deep, "application/json", 400, "nested"),
        ("deeply nested sdp field", "/offer", b'{"type": "offer", "sdp": ' + deep + b"}", "application/json", 400,
         "nested"),
        ("lone surrogate", "/offer", b'{"type": "offer", "sdp": "v=0\\r\\n\\ud800"}', "application/json", 400,
         "Unicode"),
        ("too large", "/offer", b'{"sdp": "' + b"x" * 70000 + b'"}', "application/json", 413, "max-body-bytes"),
        ("too large whip", "/whip", b"v=0\r\n" + b"a=x\r\n" * 14000, "application/sdp", 413, "max-body-bytes"),
        ("no codecs", "/offer", as_offer(_strip_codecs(sdp)), "application/json", 400, "codec"),
        ("unknown codecs", "/whip", _unknown_codecs(sdp).encode(), "application/sdp", 400, "codec"),
        ("BUNDLE names a missing mid", "/offer", as_offer(sdp.replace(bundle, "a=group:BUNDLE 9 0 1 2")),
         "application/json", 400, "BUNDLE"),
        ("BUNDLE names a mid twice", "/offer", as_offer(sdp.replace(bundle, "a=group:BUNDLE 0 0 1 2")),
         "application/json", 400, "BUNDLE"),
        ("sections without mids", "/offer", as_offer(re.sub(r"a=mid:\w+\r\n", "", sdp)), "application/json", 400,
         "mid"),
        ("sections sharing a mid", "/whip", sdp.replace("a=mid:1", "a=mid:0").replace("a=mid:2", "a=mid:0").encode(),
         "application/sdp", 400, "mid"),
        ("50 duplicated m=audio", "/whip", repeat_audio(sdp, 49, fresh_mids=False).encode(), "application/sdp",
         400, "max-media-sections"),
        ("20 distinct m=audio", "/offer", as_offer(repeat_audio(sdp, 19, fresh_mids=True)), "application/json",
         400, "max-media-sections"),
        ("unknown media kind", "/offer", as_offer(sdp.replace("m=video", "m=text")), "application/json", 400,
         "text"),
        ("two data channel sections", "/whip",
         (sdp + sdp[sdp.index("m=application"):].replace("a=mid:2", "a=mid:3")).encode(), "application/sdp", 400,
         "application"),
        ("wrong content type", "/whip", sdp.encode(), "text/plain", 415, "application/sdp"),
        ("offer is not an object", "/offer", b"[1, 2]", "application/json", 400, "JSON object"),
    ]


def wait_http(url: str, process: subprocess.Popen, timeout: float = 30) -> None:
    """Block until `url` answers; raise if the process exits or it takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer")


@contextmanager
def serve_with_web(log_dir: Path, *extra: str) -> Iterator[dict[str, Any]]:
    """`rtmedia serve --web` (echo responder, no LM): the server and the bridge beside it."""
    web_port = free_port()
    log = log_dir / "serve.log"
    with running_server("--metrics-port", "0", "--grace", "2", "--no-llm", "--responder", "echo", "--web",
                        "--web-port", str(web_port), *extra, log=log,
                        asr_decoders=FEW_SPEAKERS) as (target, process):
        wait_http(f"http://127.0.0.1:{web_port}/healthz", process)
        yield {"target": target, "url": f"http://127.0.0.1:{web_port}", "process": process, "log": log}


@contextmanager
def running_bridge(target: str, *extra: str) -> Iterator[str]:
    """`rtmedia web --target TARGET EXTRA` on a free port, once /healthz answers: its URL."""
    port = free_port()
    process = subprocess.Popen([RTMEDIA, "web", "--target", target, "--port", str(port), *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", process)
        yield url
    finally:
        process.terminate()
        process.wait(15)
