"""WAV (RIFF) framing for streamed PCM16 audio."""

from __future__ import annotations

import struct

# Sizes unknown while streaming: the largest values, as streaming WAV writers use.
STREAMING_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int, channels: int, data_bytes: int) -> bytes:
    """A 44-byte PCM16 WAV header for `data_bytes` of sample data."""
    riff_size = min(36 + data_bytes, STREAMING_SIZE)
    block_align = channels * 2
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, 16)
        + b"data" + struct.pack("<I", min(data_bytes, STREAMING_SIZE))
    )


def wav_stream_header(sample_rate: int, channels: int) -> bytes:
    """The header sent before the first audio of a stream whose length is not known yet."""
    return wav_header(sample_rate, channels, STREAMING_SIZE)
