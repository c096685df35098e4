"""Session recordings (docs/operations.md#recordings), in-process with the real engines and the echo
responder: the stereo Ogg Opus file decodes with PyAV and holds the user's speech on the left where
it was sent and the agent's on the right where the client played it (cross-correlated, within
20 ms), cut at a barge-in where the client stopped hearing it; the JSON Lines file holds the
events without audio; the files are the owner's only. A size bound stops a recording and an
unwritable directory keeps one from starting, the session going on either way; with
--record-on-request only the sessions that ask are recorded; asking a server without a record
directory is an error event naming `recording`. The module's one server changes its recording
policy per test (`RealtimeService.record`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import stat
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from rtmedia.engines.audio.resample import make_resampler
from rtmedia.server.observe.recording import RecordingPolicy, Recordings

from tests.support.converse import Conversation
from tests.support.speech import write_wav

RTMEDIA = str(Path(sys.executable).with_name("rtmedia"))
RATE = 16000
CHUNK_MS = 20
TOLERANCE_MS = 20
SILENCE_MS = 600
FIRST = "Please remember to buy milk and bread and a box of eggs on your way home tonight."
SECOND = "Stop, wait a moment please."


class Mic:
    """A client's microphone: 20 ms chunks in real time, what `say` queued, else silence. Keeps
    what it sent, and the session clock (input ms) at a time of the conversation."""

    def __init__(self, c: Conversation) -> None:
        self.c = c
        self.queued = bytearray()
        self.sent = bytearray()
        self.started = 0.0
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    def say(self, pcm: np.ndarray) -> None:
        self.queued += pcm.tobytes()

    def clock_ms(self, t: float) -> float:
        """The input clock at conversation time `t` (chunk n goes at n * 20 ms and ends at (n + 1) * 20)."""
        return (t - self.started) * 1000 + CHUNK_MS

    async def _run(self) -> None:
        step = RATE * CHUNK_MS // 1000 * 2
        self.started = self.c.now
        n = 0
        while True:
            chunk = bytes(self.queued[:step]).ljust(step, b"\0")
            del self.queued[:step]
            self.c.send("input_audio_buffer.append", audio=chunk)
            self.sent += chunk
            n += 1
            await asyncio.sleep(max(0.0, self.started + n * CHUNK_MS / 1000 - self.c.now))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


@contextlib.asynccontextmanager
async def recorded(server, directory: Path | None, **policy):
    """The server records by this policy for the test's sessions; at the end its recordings are
    finished and written."""
    realtime = server.realtime
    before = realtime.recordings
    recordings = Recordings(RecordingPolicy(str(directory) if directory else None, **policy), server.metrics)
    realtime.record(recordings)
    recordings.start()
    try:
        yield recordings
    finally:
        realtime.record(before)
        await recordings.close()


def played(c: Conversation, mic: Mic) -> tuple[np.ndarray, dict[str, tuple[float, float]]]:
    """The agent's audio as the client played it, on the session clock at RATE: each reply from its
    first delta, continuous, a delta that came after its place played when it came, cut where
    output_audio_buffer.cleared came; and each reply's (first, last) ms played."""
    out = np.zeros(int(len(mic.sent) / 2 + RATE * 10), np.float32)
    spans: dict[str, tuple[float, float]] = {}
    ends: dict[str, float] = {}
    cleared = {e["response_id"]: mic.clock_ms(e["t"]) for e in c.of_type("output_audio_buffer.cleared")}
    resamplers: dict[str, object] = {}
    for e in c.of_type("response.output_audio.delta"):
        rid = e["response_id"]
        pcm = np.frombuffer(base64.b64decode(e["audio"]), "<i2").astype(np.float32) / 32768
        resampler = resamplers.setdefault(rid, make_resampler(e["sample_rate"], RATE))
        audio = resampler.process(pcm)
        at = max(ends[rid], mic.clock_ms(e["t"])) if rid in ends else mic.clock_ms(e["t"])
        end = at + audio.size * 1000 / RATE
        if rid in cleared:
            if at >= cleared[rid]:
                continue
            audio = audio[: int((cleared[rid] - at) * RATE / 1000)]
            end = min(end, cleared[rid])
        start = int(at * RATE / 1000)
        out[start:start + audio.size] += audio[: out.size - start]
        spans[rid] = (spans.get(rid, (at, 0))[0], end)
        ends[rid] = end
    return out, spans


def decode(path: Path) -> np.ndarray:
    """The stereo file as float32 (n, 2) at RATE, through PyAV."""
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name in ("opus", "libopus") and stream.channels == 2
        frames = [f.to_ndarray() for f in container.decode(stream)]
    audio = np.concatenate(frames, axis=1).T.astype(np.float32)  # planar float: (2, n)
    left, right = (make_resampler(48000, RATE) for _ in range(2))
    channels = [np.concatenate([r.process(audio[:, i]), r.flush()]) for i, r in enumerate((left, right))]
    return np.stack(channels, axis=1)


def offset_ms(recorded: np.ndarray, expected: np.ndarray, search_ms: int = 200) -> float:
    """The lag of `expected` in `recorded` (positive: later), by cross-correlation within +-search_ms."""
    n = max(recorded.size, expected.size)
    a, b = np.zeros(n, np.float32), np.zeros(n, np.float32)
    a[:recorded.size], b[:expected.size] = recorded, expected
    size = 1 << (2 * n - 1).bit_length()
    corr = np.fft.irfft(np.fft.rfft(a, size) * np.conj(np.fft.rfft(b, size)), size)
    lags = np.r_[corr[: search_ms * RATE // 1000 + 1], corr[-(search_ms * RATE // 1000):]]
    best = int(np.argmax(lags))
    lag = best if best <= search_ms * RATE // 1000 else best - lags.size
    return lag * 1000 / RATE


def events_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_session_is_recorded_in_stereo_as_it_was_heard(server, channel, speaker, tmp_path):
    directory = tmp_path / "recordings"
    async with recorded(server, directory):
        async with Conversation(channel) as c:
            created = await c.wait_for("session.created")
            assert created["session"]["recording"] is True  # the client knows
            c.send("session.update", session={
                "input_audio_format": {"encoding": "pcm16", "sample_rate": RATE},
                "turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}})
            await c.wait_for("session.updated")
            mic = Mic(c)
            mic.say(speaker.silence(0.5))
            mic.say(speaker.say(FIRST))
            mic.start()
            first = await c.wait_for("response.output_audio.delta", timeout=30)
            await asyncio.sleep(1.2)  # the reply plays a while, then the user talks over it
            mic.say(speaker.say(SECOND))
            await c.wait_for("output_audio_buffer.cleared", timeout=15)
            await c.wait_for("response.done", count=2, timeout=30)
            done = c.of_type("response.done")[-1]
            await asyncio.sleep(done["usage"]["output_audio_ms"] / 1000 + 0.5)  # its playback, and the hold
            await mic.stop()
            c.end_requests()
            await c.ended()
    session_id = created["session_id"]
    audio_path, events_path = directory / f"{session_id}.ogg", directory / f"{session_id}.jsonl"
    for path in (audio_path, events_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700

    stereo = decode(audio_path)
    sent = np.frombuffer(bytes(mic.sent), "<i2").astype(np.float32) / 32768
    assert abs(offset_ms(stereo[:, 0], sent)) <= TOLERANCE_MS
    expected, spans = played(c, mic)
    assert len(spans) == 2, spans
    assert abs(offset_ms(stereo[:, 1], expected)) <= TOLERANCE_MS
    # the interrupted reply ends where the client stopped hearing it
    cut_rid = c.of_type("output_audio_buffer.cleared")[0]["response_id"]
    assert cut_rid == first["response_id"]
    cut_ms = spans[cut_rid][1]
    second_start = min(start for rid, (start, _) in spans.items() if rid != cut_rid)
    # both edges within the alignment tolerance (and Opus's pre-echo before the next reply's onset)
    between = stereo[int((cut_ms + TOLERANCE_MS) * RATE / 1000): int((second_start - TOLERANCE_MS) * RATE / 1000), 1]
    assert between.size > RATE // 10 and np.abs(between).max() < 0.01, "audio after the cut"
    before = stereo[int((cut_ms - 300) * RATE / 1000): int(cut_ms * RATE / 1000), 1]
    assert np.abs(before).max() > 0.05, "the reply was not heard up to the cut"

    lines = events_of(events_path)
    assert lines[0]["type"] == "recording.started" and lines[-1]["type"] == "recording.stopped"
    assert lines[-1]["outcome"] == "completed"
    kinds = [line["event"]["type"] for line in lines[1:-1]]
    for kind in ("session.created", "session.update", "input_audio_buffer.append", "input_audio_buffer.speech_started",
                 "response.output_audio.delta", "output_audio_buffer.cleared", "response.done"):
        assert kind in kinds, kind
    appends = [line for line in lines[1:-1] if line["event"]["type"] == "input_audio_buffer.append"]
    assert appends[0]["from"] == "client" and appends[0]["event"]["audio_bytes"] == RATE * CHUNK_MS // 1000 * 2
    assert all("audio" not in line["event"] for line in lines[1:-1])
    clocks = [line["clock_ms"] for line in appends]
    assert clocks == sorted(clocks)
    text = events_path.read_text()
    assert '"audio":' not in text and all("wall" in line for line in lines)


async def spoken_turn(c: Conversation, speaker, text: str) -> dict:
    """One sentence spoken into a server_vad session; its reply's response.done."""
    c.send("session.update", session={"input_audio_format": {"encoding": "pcm16", "sample_rate": RATE},
                                      "turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}})
    await c.wait_for("session.updated")
    pcm = np.concatenate([speaker.silence(0.3), speaker.say(text), speaker.silence(1.0)])
    await c.stream(pcm.tobytes(), RATE)
    return await c.wait_for("response.done", timeout=30)


async def test_a_size_bound_stops_the_recording_and_the_session_goes_on(server, channel, speaker, tmp_path):
    stopped = server.metrics.recordings_total.labels("max_bytes")._value.get()
    async with recorded(server, tmp_path, max_bytes=20_000):
        async with Conversation(channel) as c:
            created = await c.wait_for("session.created")
            done = await spoken_turn(c, speaker, FIRST)
            assert done["status"] == "completed"
    lines = events_of(tmp_path / f"{created['session_id']}.jsonl")
    assert lines[-1]["type"] == "recording.stopped" and lines[-1]["outcome"] == "max_bytes", lines[-1]
    assert server.metrics.recordings_total.labels("max_bytes")._value.get() == stopped + 1
    size = sum((tmp_path / f"{created['session_id']}{suffix}").stat().st_size for suffix in (".ogg", ".jsonl"))
    assert size < 30_000


async def test_an_unwritable_directory_leaves_the_session_working(server, channel, speaker, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    failures = server.metrics.recording_failures.labels("io_error")._value.get()
    async with recorded(server, blocker / "recordings"):
        async with Conversation(channel) as c:
            await c.wait_for("session.created")
            done = await spoken_turn(c, speaker, SECOND)
            assert done["status"] == "completed" and c.of_type("response.output_audio.delta")
    assert server.metrics.recording_failures.labels("io_error")._value.get() >= failures + 1


async def test_on_request_only_the_sessions_that_ask_are_recorded(server, channel, tmp_path):
    async with recorded(server, tmp_path, on_request=True):
        async with Conversation(channel) as quiet, Conversation(channel) as asking:
            created = [await quiet.wait_for("session.created"), await asking.wait_for("session.created")]
            assert [e["session"]["recording"] for e in created] == [False, False]
            asking.send("session.update", session={"recording": True})
            updated = await asking.wait_for("session.updated")
            assert updated["session"]["recording"] is True
            for c in (quiet, asking):
                c.send("input_audio_buffer.append", audio=bytes(4800))
                c.end_requests()
                await c.ended()
    names = sorted(p.name for p in tmp_path.iterdir())
    asked = created[1]["session_id"]
    assert names == [f"{asked}.jsonl", f"{asked}.ogg"]


async def test_recording_without_a_record_dir_is_an_error_naming_it(server, channel):
    async with recorded(server, None):
        async with Conversation(channel) as c:
            created = await c.wait_for("session.created")
            assert "recording" not in created["session"]
            c.send("session.update", session={"recording": True}, event_id="ask")
            error = await c.wait_for("error")
            assert error["param"] == "recording" and error["event_id"] == "ask"
            assert "--record-dir" in error["message"]
            assert not c.of_type("session.updated")


async def rtmedia(*args: str) -> tuple[int, str, str]:
    """`rtmedia ARGS` as a process (the server runs on this loop, so never block it)."""
    proc = await asyncio.create_subprocess_exec(RTMEDIA, *args, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_talk_records_what_it_sent_and_played_in_stereo(server, speaker, tmp_path):
    spoken = np.concatenate([speaker.silence(0.3), speaker.say(SECOND)])
    wav = write_wav(tmp_path / "said.wav", RATE, spoken)
    target = f"127.0.0.1:{server.port}"
    code, out, err = await rtmedia("talk", str(wav), "--responder", "echo", "--record", str(tmp_path / "x" / "a.ogg"),
                                   "--target", target)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "--record" in err and "Traceback" not in err, err
    path = tmp_path / "talk.ogg"
    code, out, err = await rtmedia("talk", str(wav), "--responder", "echo", "--record", str(path), "--json",
                                   "--target", target)
    assert code == 0, err
    summary = json.loads(out.splitlines()[-1])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stereo = decode(path)
    sent = spoken.astype(np.float32) / 32768
    assert abs(offset_ms(stereo[:, 0], sent)) <= TOLERANCE_MS
    reply = stereo[int((spoken.size / RATE + 0.3) * RATE):, 1]  # the reply plays after the turn
    assert summary["reply_audio_s"] > 1 and np.abs(reply).max() > 0.05
    voiced = np.flatnonzero(np.abs(stereo[:, 1]) > 0.02)
    assert (voiced[-1] - voiced[0]) / RATE == pytest.approx(summary["reply_audio_s"], abs=0.3)
