"""Media tracks of the WebRTC bridge: the reply audio the browser hears, the decoded
video it watches, and the microphone resampler that feeds the session.

Media is pulled at the pace of a clock (aiortc calls `recv()`); nothing pushes into
an unbounded queue:

- `ReplyAudioTrack`: 20 ms frames at 48 kHz from a `PlayoutBuffer` (rtmedia.web.playout: the
  reply audio, shared with the SIP door), paced by the clock;
  the first frame of a reply goes out as soon as its audio arrives, not on the next tick.
- `VideoFrameTrack`: decoded RGB frames from a bounded queue, paced at the clip's fps.
- `MicResampler`: browser audio frames (Opus decodes to 48 kHz stereo) to PCM16 mono
  at the session's input rate, with `av.AudioResampler`.
- `PacketAudioBuffer` / `set_audio_prefetch`: how long the microphone's packets wait
  before they are decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import time

import av
import numpy as np
from aiortc import RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtpPacket
from aiortc.utils import uint16_add
from rtmedia.web.playout import FRAME_MS, PlayoutBuffer

PLAYOUT_RATE = 48000
FRAME_SAMPLES = PLAYOUT_RATE * FRAME_MS // 1000  # 960
VIDEO_CLOCK = 90000  # RTP video clock


class ReplyAudioTrack(MediaStreamTrack):
    """The outgoing audio track: a 20 ms, 48 kHz mono frame per tick from a PlayoutBuffer.

    Frames are due at `start + pts / rate`; a late caller gets frames back to back
    until it has caught up (as aiortc's own AudioStreamTrack does). While the buffer is
    empty the track waits for the next tick or for audio, whichever comes first: a
    reply's first frame leaves as soon as its audio arrives (up to a frame earlier
    than the tick), and the clock restarts from it. The RTP timestamps then run ahead
    of real time by what was gained; silent frames give it back, 1 ms each, so over a
    conversation the track sends exactly in real time."""

    kind = "audio"

    def __init__(self, buffer: PlayoutBuffer) -> None:
        super().__init__()
        self.buffer = buffer
        self._start: float | None = None
        self._pts = 0
        self._time_base = fractions.Fraction(1, buffer.rate)
        self._frame_samples = buffer.rate * FRAME_MS // 1000
        self.ahead_s = 0.0  # how far the clock was moved forward by early first frames, not yet given back

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        buffer = self.buffer
        if self._start is None:
            self._start = time.perf_counter()
        else:
            self._pts += self._frame_samples
            idle = not buffer.queued_samples
            if idle and self.ahead_s > 0:  # a silent frame gives back up to 1 ms of the lead
                payback = min(self.ahead_s, 0.001)
                self._start += payback
                self.ahead_s -= payback
            delay = self._start + self._pts / buffer.rate - time.perf_counter()
            if delay > 0 and idle:
                buffer.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(buffer.arrived.wait(), delay)
                early = self._start + self._pts / buffer.rate - time.perf_counter()
                if buffer.arrived.is_set() and early > 0:  # audio arrived before the tick: this frame is due now
                    self._start -= early
                    self.ahead_s += early
            elif delay > 0:
                await asyncio.sleep(delay)
        samples = buffer.pull(self._frame_samples)
        frame = av.AudioFrame(format="s16", layout="mono", samples=self._frame_samples)
        frame.planes[0].update(samples.tobytes())
        frame.sample_rate = buffer.rate
        frame.pts = self._pts
        frame.time_base = self._time_base
        return frame


class VideoFrameTrack(MediaStreamTrack):
    """The outgoing video track: RGB24 frames from a bounded queue, paced at their fps.

    `put()` waits while the queue is full (flow control back to the decode stream).
    A frame is due at `clip_start + index / fps`; the clip clock restarts when a frame
    arrives after the queue ran dry, so a slow decode shows frames as they come
    instead of rushing to catch up. `recv()` waits for a frame (nothing is sent
    between clips). RTP timestamps advance with the frames' own durations.
    """

    kind = "video"

    def __init__(self, max_frames: int = 32) -> None:
        super().__init__()
        self._queue: asyncio.Queue[tuple[np.ndarray, float]] = asyncio.Queue(max_frames)
        self._clip_start: float | None = None
        self._index = 0
        self._pts = 0
        self._next_pts = 0
        self._time_base = fractions.Fraction(1, VIDEO_CLOCK)

    async def put(self, frame: np.ndarray, fps: float) -> None:
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
            raise ValueError(f"expected an H x W x 3 uint8 frame, got {frame.dtype} {frame.shape}")
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        await self._queue.put((frame, fps))

    def restart_clip(self) -> None:
        """The next frame starts a new clip clock (a new decode)."""
        self._clip_start = None

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._queue.empty():
            self._clip_start = None  # ran dry: restart the clock with the next frame
        rgb, fps = await self._queue.get()
        now = time.perf_counter()
        if self._clip_start is None:
            self._clip_start, self._index = now, 0
        else:
            self._index += 1
            delay = self._clip_start + self._index / fps - now
            if delay > 0:
                await asyncio.sleep(delay)
        frame = av.VideoFrame.from_ndarray(_even(rgb), format="rgb24")
        self._pts = self._next_pts
        self._next_pts += max(1, round(VIDEO_CLOCK / fps))
        frame.pts = self._pts
        frame.time_base = self._time_base
        return frame


def _even(rgb: np.ndarray) -> np.ndarray:
    """Pad a frame to even width and height (YUV 4:2:0 encoders need them)."""
    h, w = rgb.shape[:2]
    if h % 2 == 0 and w % 2 == 0:
        return np.ascontiguousarray(rgb)
    return np.pad(rgb, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")


class MicResampler:
    """Browser audio frames -> PCM16 mono bytes at `rate`, streaming.

    One `av.AudioResampler` per input format: when the source's rate, layout or
    sample format changes mid-stream (a renegotiated codec), the old resampler is
    flushed and a new one made, so no audio is lost or misread. Input timestamps
    are ignored (packet loss leaves gaps in them; the session counts samples)."""

    def __init__(self, rate: int) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate
        self._resampler: av.AudioResampler | None = None
        self._source: tuple[int, str, str] | None = None
        self.frames_in = 0
        self.samples_out = 0

    def _new(self) -> av.AudioResampler:
        return av.AudioResampler(format="s16", layout="mono", rate=self.rate)

    def resample(self, frame: av.AudioFrame) -> bytes:
        source = (frame.sample_rate, frame.layout.name, frame.format.name)
        out = b""
        if source != self._source:
            out = self.flush()
            self._resampler, self._source = self._new(), source
        self.frames_in += 1
        if not frame.samples:
            return out
        frame.pts = None
        assert self._resampler is not None
        return out + self._collect(self._resampler.resample(frame))

    def flush(self) -> bytes:
        """The resampler's tail (call at the end of the stream)."""
        if self._resampler is None:
            return b""
        tail = self._collect(self._resampler.resample(None))
        self._resampler, self._source = None, None
        return tail

    def _collect(self, frames: list[av.AudioFrame]) -> bytes:
        data = b"".join(bytes(f.planes[0])[: f.samples * 2] for f in frames)
        self.samples_out += len(data) // 2
        return data


class PacketAudioBuffer(JitterBuffer):
    """An audio receive buffer that hands each RTP packet to the decoder as it arrives.

    aiortc's JitterBuffer knows a frame is complete only when a packet of the next frame
    arrives, so even its smallest setting holds every frame one packet time (20 ms). An
    Opus RTP packet is always one whole frame (RFC 7587), so it can be decoded at once.
    A packet that is not newer than the newest one seen (late, reordered or repeated)
    is dropped and counted in `late`: the decoder needs packets in order, and a late one
    would be played after audio that followed it.
    """

    def __init__(self) -> None:
        super().__init__(capacity=16)
        self.newest: int | None = None
        self.late = 0

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        seq = packet.sequence_number
        if self.newest is not None and not 0 < uint16_add(seq, -self.newest) < 0x8000:
            self.late += 1
            return False, None
        self.newest = seq
        return False, JitterFrame(data=packet._data, timestamp=packet.timestamp)


def set_audio_prefetch(pc: RTCPeerConnection, frames: int) -> list[JitterBuffer]:
    """Set how many audio frames each audio receiver holds before decoding (aiortc holds
    4, i.e. 80 ms, and exposes no setting): 0 decodes each packet as it arrives
    (`PacketAudioBuffer`); N >= 1 is aiortc's JitterBuffer with prefetch N, which adds
    20 ms per frame (a frame is complete when the next one starts). Call after
    setRemoteDescription, before media flows. Returns the buffers it installed."""
    installed = []
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        if transceiver.kind == "audio" and hasattr(receiver, "_RTCRtpReceiver__jitter_buffer"):
            buffer = PacketAudioBuffer() if frames == 0 else JitterBuffer(capacity=16, prefetch=frames)
            receiver._RTCRtpReceiver__jitter_buffer = buffer
            installed.append(buffer)
    return installed
