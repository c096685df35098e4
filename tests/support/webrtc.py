"""A WebRTC peer for tests and benchmarks of the bridge, on aiortc: it speaks PCM into a
microphone track at real-time pace, records the reply audio it receives with arrival
times, and keeps the `events` data channel's messages."""

from __future__ import annotations

import asyncio
import json
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
from rtmedia.web.tracks import FRAME_SAMPLES, PLAYOUT_RATE, PlayoutBuffer, ReplyAudioTrack, set_audio_prefetch

from tests.support.serve import RTMEDIA, free_port, running_server

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
        super().__init__(PlayoutBuffer(max_ms=600_000))
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
                        "--web-port", str(web_port), *extra, log=log) as (target, process):
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
