"""The bridge's media parts: playout buffer, paced tracks, microphone resampling, offer checks."""

from __future__ import annotations

import asyncio
import time

import av
import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtpPacket
from rtmedia.web.bridge import OfferError, cap_sctp_chunk_size, ice_server, parse_udp_ports, validate_offer
from rtmedia.web.playout import PlayoutBuffer
from rtmedia.web.webrtc.tracks import (
    FRAME_SAMPLES,
    PLAYOUT_RATE,
    MicResampler,
    PacketAudioBuffer,
    ReplyAudioTrack,
    VideoFrameTrack,
    set_audio_prefetch,
)


def ramp(n: int, start: int = 1) -> np.ndarray:
    return (np.arange(n) + start).astype(np.int16)


# ---- PlayoutBuffer -------------------------------------------------------------------------------

def test_playout_fifo_order_and_silence_padding():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    buf.push("r1", ramp(1000))
    buf.push("r1", ramp(500, 1001))
    first, second = buf.pull(), buf.pull()
    assert np.array_equal(first, ramp(960))
    assert np.array_equal(second[:540], ramp(540, 961)) and not second[540:].any()
    assert buf.played("r1") == 1500 and buf.received("r1") == 1500 and buf.queued_samples == 0
    assert not buf.pull().any()  # dry: silence
    assert buf.stats.audio_frames == 2 and buf.stats.frames == 3


def test_playout_counts_underruns_only_inside_a_reply():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    buf.pull()
    assert buf.stats.underruns == 0  # idle silence is not an underrun
    buf.push("r1", ramp(960 * 2 + 10))
    buf.pull()
    buf.pull()  # a full frame, 10 samples left
    buf.pull()  # ran dry: the reply's end, or a gap in it
    assert buf.stats.underruns == 0
    buf.push("r1", ramp(960))  # more of it: the listener heard a gap
    assert buf.stats.underruns == 1
    buf.pull()
    buf.pull()
    buf.push("r2", ramp(960))  # the next reply after r1's end is no underrun
    buf.pull()
    buf.pull()
    assert buf.stats.underruns == 1


def test_playout_clear_drops_everything_at_once():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    buf.push("r1", ramp(4800))
    buf.pull()
    dropped = buf.clear()
    assert dropped == 4800 - 960 and buf.queued_samples == 0 and not buf.holds("r1")
    assert buf.played("r1") == 960  # what was played stays known, for the final ack
    assert not buf.pull().any()
    assert buf.clear() == 0 and buf.stats.cleared == 1


def test_a_paused_playout_plays_silence_and_keeps_its_place():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    buf.push("r1", ramp(4800))
    first = buf.pull()
    buf.paused = True
    assert not buf.pull().any() and not buf.pull().any()
    assert buf.played("r1") == 960 and buf.queued_samples == 4800 - 960 and buf.stats.underruns == 0
    buf.paused = False
    assert (buf.pull() == ramp(4800)[960:1920]).all() and first.any()


def test_playout_tracks_responses_separately():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    buf.push("a", ramp(500))
    buf.push("b", ramp(800))
    buf.pull()
    assert (buf.played("a"), buf.played("b")) == (500, 460)
    assert not buf.holds("a") and buf.holds("b")


def test_playout_overflow_drops_the_oldest():
    buf = PlayoutBuffer(PLAYOUT_RATE, max_ms=100)  # 4800 samples
    buf.push("r", ramp(4000))
    buf.push("r", ramp(2000, 5000))
    assert buf.queued_samples == 4800 and buf.stats.overflow_samples == 1200
    assert buf.pull()[0] == 1201  # the first 1200 samples went


def test_playout_rejects_bad_input():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    with pytest.raises(ValueError, match="mono int16"):
        buf.push("r", np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="mono int16"):
        buf.push("r", np.zeros((10, 2), np.int16))
    buf.push("r", np.zeros(0, np.int16))
    assert buf.responses() == []
    with pytest.raises(ValueError, match="positive"):
        PlayoutBuffer(PLAYOUT_RATE, max_ms=0)


# ---- microphone receive buffer ----------------------------------------------------------------------

def rtp(seq: int) -> RtpPacket:
    packet = RtpPacket(payload_type=111, sequence_number=seq, timestamp=seq * 960)
    packet._data = bytes([seq % 256])  # the depayloaded frame, as aiortc's receiver sets it
    return packet


def test_packet_audio_buffer_decodes_each_packet_at_once_and_drops_late_ones():
    buf = PacketAudioBuffer()
    got = [buf.add(rtp(seq)) for seq in (65534, 65535, 0, 2)]  # the sequence wraps; 1 is lost
    assert [(pli, f.data, f.timestamp) for pli, f in got] == \
        [(False, bytes([s % 256]), s * 960) for s in (65534, 65535, 0, 2)]
    assert buf.add(rtp(1)) == (False, None)  # late (after 2): dropped, not played out of order
    assert buf.add(rtp(2)) == (False, None)  # repeated
    assert buf.late == 2
    assert buf.add(rtp(3))[1].data == b"\x03"


async def test_set_audio_prefetch_installs_the_buffers():
    from aiortc import RTCPeerConnection
    from aiortc.jitterbuffer import JitterBuffer

    async def installed(frames: int) -> list:
        pc = RTCPeerConnection()
        pc.addTransceiver("audio")
        pc.addTransceiver("video")
        try:
            return set_audio_prefetch(pc, frames)
        finally:
            await pc.close()

    [packet] = await installed(0)
    assert isinstance(packet, PacketAudioBuffer)
    [held] = await installed(2)
    assert type(held) is JitterBuffer and held._prefetch == 2


# ---- tracks -------------------------------------------------------------------------------------------

async def test_reply_track_paces_20ms_frames():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    buf.push("r", ramp(960 * 3))
    track = ReplyAudioTrack(buf)
    started = time.perf_counter()
    frames = [await track.recv() for _ in range(11)]
    elapsed = time.perf_counter() - started
    assert 0.19 <= elapsed <= 0.35, elapsed  # ten frame intervals after the first
    assert [f.pts for f in frames] == [n * FRAME_SAMPLES for n in range(11)]
    assert all(f.samples == 960 and f.sample_rate == 48000 and f.layout.name == "mono" for f in frames)
    assert np.array_equal(frames[0].to_ndarray().reshape(-1), ramp(960))
    assert not frames[5].to_ndarray().any()
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


async def test_reply_track_barge_in_is_immediate():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    buf.push("r", np.full(48000, 1000, np.int16))
    track = ReplyAudioTrack(buf)
    assert (await track.recv()).to_ndarray().any()
    buf.clear()
    assert not (await track.recv()).to_ndarray().any()  # the very next frame is silent


async def test_reply_track_sends_a_replys_first_frame_as_its_audio_arrives():
    buf = PlayoutBuffer(PLAYOUT_RATE)
    track = ReplyAudioTrack(buf)
    assert not (await track.recv()).to_ndarray().any()  # silence: the next frame is due in 20 ms
    asyncio.get_running_loop().call_later(0.001, buf.push, "r", ramp(960))
    started = time.perf_counter()
    frame = await track.recv()
    assert time.perf_counter() - started < 0.0185, "the reply frame waited for the tick"
    assert np.array_equal(frame.to_ndarray().reshape(-1), ramp(960)) and frame.pts == FRAME_SAMPLES
    gained = track.ahead_s
    assert 0.0015 < gained < 0.02, gained
    # Silent frames give the gain back, 1 ms each, so the track keeps to real time.
    started = time.perf_counter()
    frames = [await track.recv() for _ in range(25)]
    assert track.ahead_s == 0.0
    assert [f.pts for f in frames] == [n * FRAME_SAMPLES for n in range(2, 27)]
    assert time.perf_counter() - started > 25 * 0.02 - 0.02 + gained - 0.005


async def test_video_track_paces_at_fps_and_restarts_after_a_gap():
    track = VideoFrameTrack(max_frames=4)
    fps = 25.0
    frame = np.zeros((5, 7, 3), np.uint8)  # odd sizes are padded for the encoder

    async def feed(n: int) -> None:
        for _ in range(n):
            await track.put(frame, fps)

    feeder = asyncio.create_task(feed(6))  # more than the queue holds: put() waits
    started = time.perf_counter()
    got = [await track.recv() for _ in range(6)]
    elapsed = time.perf_counter() - started
    await feeder
    assert 5 / fps - 0.01 <= elapsed <= 5 / fps + 0.1, elapsed
    assert (got[0].width, got[0].height) == (8, 6)
    assert [f.pts for f in got] == [n * 3600 for n in range(6)]
    await asyncio.sleep(0.3)  # dry: the next clip starts at once, not "late"
    await track.put(frame, fps)
    t0 = time.perf_counter()
    nxt = await track.recv()
    assert time.perf_counter() - t0 < 0.02 and nxt.pts == 6 * 3600
    with pytest.raises(ValueError, match="uint8"):
        await track.put(np.zeros((4, 4, 3), np.float32), fps)
    with pytest.raises(ValueError, match="fps"):
        await track.put(frame, 0)


# ---- microphone resampling --------------------------------------------------------------------------

def mic_frame(samples: np.ndarray, rate: int = 48000, layout: str = "stereo") -> av.AudioFrame:
    channels = 2 if layout == "stereo" else 1
    data = np.repeat(samples, channels).reshape(1, -1).astype(np.int16)
    frame = av.AudioFrame.from_ndarray(data, format="s16", layout=layout)
    frame.sample_rate = rate
    return frame


def tone(seconds: float, rate: int, hz: float = 440.0, amp: float = 8000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * hz * t)).astype(np.int16)


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_mic_resampler_length_and_level(rate):
    mic = MicResampler(rate)
    signal = tone(1.0, 48000)
    out = b"".join(mic.resample(mic_frame(chunk)) for chunk in np.split(signal, 50)) + mic.flush()
    samples = np.frombuffer(out, "<i2")
    assert abs(len(samples) - rate) <= 2  # 1 s in, 1 s out, tail included
    middle = samples[rate // 10: -rate // 10].astype(np.float64)
    assert np.sqrt(np.mean(middle ** 2)) == pytest.approx(8000 / np.sqrt(2), rel=0.05)  # stereo -> mono keeps level


def test_mic_resampler_edges():
    mic = MicResampler(16000)
    assert mic.resample(mic_frame(np.zeros(0, np.int16))) == b""  # an empty frame
    # Frames of any size, down to one sample, add up to the right length.
    signal = tone(1.0, 48000)
    cuts = np.cumsum(np.concatenate([[1, 1, 3], np.random.default_rng(1).integers(1, 2000, 200)]))
    pieces = [p for p in np.split(signal, cuts[cuts < len(signal)]) if len(p)]
    assert min(map(len, pieces)) == 1
    out = b"".join(mic.resample(mic_frame(p)) for p in pieces) + mic.flush()
    assert abs(len(out) // 2 - 16000) <= 2
    assert mic.flush() == b""  # nothing left, twice


def test_mic_resampler_follows_a_format_change():
    """A renegotiated source (48 kHz stereo, then 8 kHz mono): the tail of the first
    format is kept and the second is not misread at the first one's rate."""
    mic = MicResampler(16000)
    first = mic.resample(mic_frame(tone(0.5, 48000)))
    second = mic.resample(mic_frame(tone(0.5, 8000), rate=8000, layout="mono")) + mic.flush()
    total = (len(first) + len(second)) // 2
    assert abs(total - 16000) <= 4, total
    with pytest.raises(ValueError, match="positive"):
        MicResampler(0)


# ---- offers and options ------------------------------------------------------------------------------

OFFER = """v=0\r
o=- 1 2 IN IP4 127.0.0.1\r
s=-\r
t=0 0\r
a=group:BUNDLE 0\r
m=audio 9 UDP/TLS/RTP/SAVPF 111\r
c=IN IP4 0.0.0.0\r
a=mid:0\r
a={direction}\r
a=rtcp-mux\r
a=rtpmap:111 opus/48000/2\r
a=ice-ufrag:abcd\r
a=ice-pwd:abcdefghijklmnopqrstuvwx\r
a=fingerprint:sha-256 {fingerprint}\r
a=setup:actpass\r
"""
FINGERPRINT = ":".join(["AB"] * 32)


def test_offer_validation_names_the_problem():
    assert validate_offer(OFFER.format(direction="sendrecv", fingerprint=FINGERPRINT)).media[0].kind == "audio"
    cases = {
        "": "no SDP",
        "hello": "must start with 'v=0'",
        "v=0\r\nm=audio\r\n": "malformed SDP offer",
        "v=0\r\ns=-\r\n": "no audio section",
        OFFER.format(direction="recvonly", fingerprint=FINGERPRINT): "receive-only",
        OFFER.format(direction="sendrecv", fingerprint=FINGERPRINT).replace("a=ice-ufrag:abcd\r\n", ""): "ICE",
        "v=0\r\n" + "a=x\r\n" * 20000: "bytes",
    }
    for sdp, message in cases.items():
        with pytest.raises(OfferError, match=message) as info:
            validate_offer(sdp)
        assert 400 <= info.value.status < 500
    with pytest.raises(OfferError, match="no SDP"):
        validate_offer(None)


def test_options():
    assert parse_udp_ports("40000-40100") == (40000, 40100)
    with pytest.raises(ValueError, match="40000-40100"):
        parse_udp_ports("40000")
    turn = ice_server("turn:alice:secret@turn.example.org:3478")
    assert (turn.urls, turn.username, turn.credential) == ("turn:turn.example.org:3478", "alice", "secret")
    assert ice_server("stun:stun.example.org:3478").username is None
    assert cap_sctp_chunk_size() <= 1100
