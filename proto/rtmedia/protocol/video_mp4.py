"""Fragmented MP4 (H.264) for chunked video: one fragment per chunk.

One x264 encoder runs for the whole clip (zero-latency tuning, so a frame's
packet comes out when the frame goes in) and every chunk starts with a key
frame. Each chunk's packets are muxed by a fresh MP4 muxer into exactly one
`moof` + `mdat` fragment (a single long-lived muxer would hold the last frame
of every chunk until the next one arrives). The first chunk carries the init
segment (`ftyp` + `moov`) in front of its fragment; concatenated, the chunks
are one fragmented MP4 file that a player can start on as soon as the first
chunk has arrived.
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

MOVFLAGS = "frag_keyframe+empty_moov+delay_moov+default_base_moof+frag_discont+skip_trailer"


def _boxes(data: bytes) -> list[tuple[str, bytes]]:
    out = []
    offset = 0
    while offset < len(data):
        size = int.from_bytes(data[offset:offset + 4], "big")
        if size < 8:
            raise ValueError(f"bad MP4 box size {size} at offset {offset}")
        out.append((data[offset + 4:offset + 8].decode("latin-1"), data[offset:offset + size]))
        offset += size
    return out


class Fmp4Writer:
    def __init__(self, width: int, height: int, fps: float) -> None:
        if width % 2 or height % 2:
            raise ValueError(f"H.264 needs an even frame size, got {width}x{height}")
        self.width, self.height = width, height
        self.rate = Fraction(fps).limit_denominator(1001)
        self._encoder = av.CodecContext.create("libx264", "w")
        self._encoder.width, self._encoder.height = width, height
        self._encoder.pix_fmt = "yuv420p"
        self._encoder.time_base = 1 / self.rate
        self._encoder.framerate = self.rate
        self._encoder.options = {"tune": "zerolatency", "preset": "veryfast", "threads": "1"}
        self._encoder.open()
        self._pts = 0
        self._init: bytes | None = None

    def fragment(self, frames: np.ndarray, final: bool = False) -> bytes:
        """Encode uint8 T x H x W x 3 frames into one fragment (the init segment first, once)."""
        packets = []
        for n, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = self._pts
            frame.time_base = self._encoder.time_base
            frame.pict_type = av.video.frame.PictureType.I if n == 0 else av.video.frame.PictureType.NONE
            self._pts += 1
            packets += self._encoder.encode(frame)
        if final:
            packets += self._encoder.encode(None)
        out = io.BytesIO()
        with av.open(out, mode="w", format="mp4", options={"movflags": MOVFLAGS}) as container:
            stream = container.add_mux_stream("h264", rate=self.rate, width=self.width, height=self.height)
            for packet in packets:
                packet.stream = stream
                container.mux(packet)
        boxes = _boxes(out.getvalue())
        init = b"".join(data for kind, data in boxes if kind in ("ftyp", "moov"))
        body = b"".join(data for kind, data in boxes if kind in ("moof", "mdat"))
        if self._init is None:
            self._init = init
            return init + body
        if init != self._init:
            raise RuntimeError("the MP4 init segment changed between chunks")
        return body
