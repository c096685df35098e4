"""Twilio's side of a Media Streams call, for the Twilio door's tests and benchmark: requests
signed by Twilio's own RequestValidator (the `twilio` SDK) and the documented message shapes."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp
import numpy as np
from rtmedia.engines.audio.resample import float_to_ulaw
from twilio.request_validator import RequestValidator

from tests.support.waits import until

TOKEN = "0123456789abcdef0123456789abcdef"  # the auth token the door under test is given
RATE = 8000


def signed(url: str, params: dict[str, str] | None = None) -> dict[str, str]:
    return {"X-Twilio-Signature": RequestValidator(TOKEN).compute_signature(url, params or {})}


def ulaw(speaker, text: str, lead_s: float = 0.3, tail_s: float = 1.2) -> bytes:
    audio = np.concatenate([speaker.silence(lead_s, RATE), speaker.say(text, RATE), speaker.silence(tail_s, RATE)])
    return float_to_ulaw(audio.astype(np.float32) / 32768)


class Twilio:
    """Twilio's side of one Media Streams socket: sends the caller at real-time pace, plays what
    it receives on a clock and returns each mark once the audio before it has played."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.received: list[tuple[float, dict]] = []
        self.audio = bytearray()
        self.play_until = 0.0
        self.returned: list[str] = []
        self.pending: dict[str, asyncio.Task] = {}  # marks not yet returned

    async def start(self, sid: str = "MZ0001", **parameters: str) -> None:
        await self.ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self.ws.send_json({"event": "start", "sequenceNumber": "1", "streamSid": sid, "start": {
            "accountSid": "AC0001", "streamSid": sid, "callSid": "CA0001", "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            "customParameters": parameters}})
        self.sid = sid

    async def say(self, audio: bytes) -> None:
        t0 = time.perf_counter()
        for n, i in enumerate(range(0, len(audio), 160)):
            await self.ws.send_json({"event": "media", "streamSid": self.sid, "media": {
                "track": "inbound", "chunk": str(n + 1), "timestamp": str(n * 20),
                "payload": base64.b64encode(audio[i:i + 160]).decode()}})
            await asyncio.sleep(max(0.0, t0 + (n + 1) * 0.02 - time.perf_counter()))

    async def read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                return
            event, now = json.loads(msg.data), time.perf_counter()
            self.received.append((now, event))
            if event["event"] == "media":
                payload = base64.b64decode(event["media"]["payload"])
                self.audio += payload
                self.play_until = max(now, self.play_until) + len(payload) / RATE
            elif event["event"] == "mark":
                name = event["mark"]["name"]
                self.pending[name] = asyncio.ensure_future(self._return(name, self.play_until - now))
            elif event["event"] == "clear":  # the audio not yet played goes; its marks come back now
                self.play_until = now
                for name, task in list(self.pending.items()):
                    task.cancel()
                    await self._return(name, 0.0)

    async def _return(self, name: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        self.pending.pop(name, None)
        if not self.ws.closed:
            await self.ws.send_json({"event": "mark", "streamSid": self.sid, "mark": {"name": name}})
            self.returned.append(name)

    def of(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, e) for t, e in self.received if e["event"] == kind]

    async def wait(self, what, timeout: float = 30.0) -> None:
        await until(what, timeout, "the Twilio stand-in's condition", interval=0.05,
                    seen=lambda: [e["event"] for _, e in self.received][-20:])
