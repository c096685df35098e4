"""Session recordings (docs/operations.md#recordings): with `--record-dir DIR`, every Converse
session (or, with `--record-on-request`, each that sets `recording`) is written as
`DIR/<session_id>.ogg`, stereo Ogg Opus with the user on the left and the agent on the right as
the user heard it, and `DIR/<session_id>.jsonl`, the session's events with their times.

The clock is the session's: milliseconds of the user's input audio. The user's audio lies where
it is in the input; the agent's audio lies from when it went to the client, mapped onto the input
clock by when the input arrived (`_Live.clock`), continuous after that, and it is cut where
the user stopped hearing it: at an output_audio_buffer.cleared (where playback was then), at a
conversation.item.truncate (its audio_end_ms). The timeline is encoded HOLD_MS behind the input
(`Timeline.due`), so a cut removes audio not yet written.

On the event loop the hooks only note the time and enqueue what they saw (a bounded queue: a
writer that falls behind makes them drop, counted, never wait). One writer thread decodes,
resamples, encodes (rtmedia.protocol.recording) and writes every recording. A recording ends at
the session's end, at its bounds (size, duration), or at a file error (an unwritable directory,
a full disk), logged and counted: never the session. Files are the owner's only (0600, the
directory 0700); files older than the retention are deleted at start and hourly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from rtmedia.engines.audio.resample import make_resampler, pcm16_to_float
from rtmedia.protocol.events import to_json
from rtmedia.protocol.recording import (
    FILE_RATE,
    RATE,
    WRITE_EVERY_MS,
    InputClock,
    OggOpusFile,
    Timeline,
    open_private,
)
from rtmedia.server.hearing.audio_input import DECODERS
from rtmedia.server.observe.metrics import Metrics
from rtmedia.server.session.config import ConfigError, SessionSettings

log = logging.getLogger(__name__)
LINES_BUFFER = 64 * 1024  # JSON lines are written with the audio, or once this many bytes wait
INPUT_BATCH = 10  # input chunks queued as one item (200 ms of 20 ms chunks; the audio is held 2 s anyway)
QUEUE_ITEMS = 8192  # what the writer may fall behind by (all sessions), before the hooks drop
RETENTION_EVERY_S = 3600.0
SUFFIXES = (".ogg", ".jsonl")
USER, AGENT = 0, 1
MiB = 1024 * 1024


@dataclass(frozen=True)
class RecordingPolicy:
    """The server's recording settings (ServerConfig record_*): `directory` None: none."""

    directory: str | None = None
    on_request: bool = False
    max_bytes: int = 64 * MiB
    max_s: float = 3600.0
    retention_h: float = 0.0

    @property
    def every(self) -> bool:
        return self.directory is not None and not self.on_request

    def setting(self) -> bool | None:
        """A new session's `recording`: True (recorded), False (only if it asks), None (the
        server records nothing: the field is absent from session.created)."""
        return None if self.directory is None else self.every

    def checked(self, settings: SessionSettings) -> SessionSettings:
        """`settings` with the `recording` a session.update asked for, as the server grants it;
        ConfigError (naming `recording`) when it cannot be had."""
        asked = bool(settings.recording)
        if self.directory is None and asked:
            raise ConfigError("recording", "recording: this server records no sessions (it runs without "
                                           "--record-dir); the session goes on unrecorded")
        if self.every and not asked:
            raise ConfigError("recording", "recording: this server records every session (--record-dir without "
                                           "--record-on-request); it cannot be turned off")
        return dataclasses.replace(settings, recording=asked if self.directory is not None else None)


NO_RECORDINGS = RecordingPolicy()


class _Live:
    """The loop's side of one session's recording: the clock and whether it still records."""

    def __init__(self, session: Any) -> None:
        self.origin_ms = session.input_ms  # the recording's start on the session clock
        self.clock = InputClock(session.input_ms)  # the session clock from when the input arrived
        self.stopped = False  # set by the writer (a bound, a failure) or at the session's end
        self.inputs: list[tuple[Any, ...]] = []  # input chunks not queued yet (`Recordings._input`)

    def position(self, clock_ms: float) -> int:
        """A session-clock time as a sample of the recording's timeline."""
        return round((clock_ms - self.origin_ms) * RATE / 1000)


class Recordings:
    """The server's recordings: the policy, the loop's hooks (`sync`, `received`, `sent`,
    `closed`), the writer thread, retention and metrics."""

    def __init__(self, policy: RecordingPolicy, metrics: Metrics) -> None:
        self.policy = policy
        self.metrics = metrics
        self.live: dict[str, _Live] = {}
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(QUEUE_ITEMS)
        self._thread: threading.Thread | None = None
        self._retention: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.policy.directory is not None

    def start(self) -> None:
        """Make the directory (0700), start the writer, and the retention's hourly round (on
        the loop, at the server's start)."""
        if not self.enabled or self._thread is not None:
            return
        directory = Path(self.policy.directory)  # type: ignore[arg-type]
        try:
            _make_private_dir(directory)
        except OSError as exc:  # counted and logged; each session's recording then fails alike
            self.metrics.recording_failures.labels(_reason(exc)).inc()
            log.error("recording directory %s: %s; sessions are not recorded until it is writable", directory, exc)
        self._thread = threading.Thread(target=_Writer(self).run, name="recording-writer", daemon=True)
        self._thread.start()
        if self.policy.retention_h > 0:
            self._retention = asyncio.create_task(self._retain(), name="recording-retention")

    async def _retain(self) -> None:
        while True:
            self._put(("retain", None))
            await asyncio.sleep(RETENTION_EVERY_S)

    async def close(self) -> None:
        """Finish every recording still open and stop the writer (after the sessions closed)."""
        if self._retention is not None:
            self._retention.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retention
        for session_id in list(self.live):
            self._end(session_id, "session_closed")
        if self._thread is not None:
            await asyncio.to_thread(self._queue.put, None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def _put(self, item: tuple[Any, ...]) -> bool:
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.metrics.recording_dropped.inc()
            return False

    # ---- the loop's hooks ------------------------------------------------------------
    def sync(self, session: Any) -> None:
        """Start or end the session's recording to match its `recording` setting (at its start
        and after each session.update)."""
        wanted = bool(session.settings.recording) and self.enabled
        if wanted and session.id not in self.live:
            live = self.live[session.id] = _Live(session)
            if self._put(("open", live, session.id, time.time())):
                self.metrics.recordings_active.inc()
            else:
                live.stopped = True
        elif not wanted and session.id in self.live:
            self._end(session.id, "session_update")

    def closed(self, session: Any) -> None:
        """The session ended: its recording is finished."""
        if session.id in self.live:
            self._end(session.id, "session_closed")

    def _end(self, session_id: str, reason: str) -> None:
        live = self.live.pop(session_id)
        self._input(live)
        live.stopped = True
        # The end waits its turn in the queue, never dropped: nothing else closes the files.
        item = ("end", live, reason, time.time())
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # the files must close: the loop hands the end to a thread that waits
            threading.Thread(target=self._queue.put, args=(item,), daemon=True).start()

    def received(self, session: Any, request: Any, input_before_ms: float) -> None:
        """A client event the session handled (`input_before_ms`: its input clock before)."""
        live = self.live.get(session.id)
        if live is None or live.stopped:
            return
        now = time.perf_counter()
        kind = request.WhichOneof("event")
        if kind == "input_audio_buffer_append":
            if session.input_ms > input_before_ms:  # kept: it is on the input clock
                live.clock.sent(session.input_ms, now)
                settings = session.settings
                live.inputs.append((request, live.position(input_before_ms), settings.input_encoding,
                                    settings.input_rate, input_before_ms, time.time()))
                if len(live.inputs) >= INPUT_BATCH:
                    self._input(live)
            else:
                self._event(live, ("event", live, "client", request, live.clock.ms(now), time.time()))
            return
        self._event(live, ("event", live, "client", request, live.clock.ms(now), time.time()))
        if kind == "conversation_item_truncate":
            item_id = request.conversation_item_truncate.item_id
            response = next((r for r in session.replies.responses.values() if r.item_id == item_id), None)
            if response is not None:
                self._put(("cut", live, response.response_id, request.conversation_item_truncate.audio_end_ms, None))

    def _input(self, live: _Live) -> None:
        """The session's gathered input chunks, queued as one item (a queue item per 20 ms chunk
        cost the writer more than their audio)."""
        if live.inputs:
            self._put(("in", live, live.inputs))
            live.inputs = []

    def _event(self, live: _Live, item: tuple[Any, ...]) -> None:
        """Any other item: after the input that came before it."""
        self._input(live)
        self._put(item)

    def sent(self, session: Any, event: Any) -> None:
        """A server event as it goes to the client."""
        live = self.live.get(session.id)
        if live is None or live.stopped:
            return
        now = time.perf_counter()
        clock = live.clock.ms(now)
        kind = event.WhichOneof("event")
        if kind == "response_output_audio_delta":
            self._event(live, ("out", live, event, live.position(clock), clock, time.time()))
            return
        self._event(live, ("event", live, "server", event, clock, time.time()))
        if kind == "output_audio_buffer_cleared":  # the client stopped playing it now
            self._put(("cut", live, event.output_audio_buffer_cleared.response_id, None, live.position(clock)))
        elif kind == "response_done":
            self._put(("done", live, event.response_done.response_id))


def _make_private_dir(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_mode & 0o077:
        log.warning("recording directory %s can be read by others than its owner (mode %o); recordings are "
                    "created 0600", directory, directory.stat().st_mode & 0o777)


def _reason(exc: BaseException) -> str:
    """A failure's label: permission, disk_full, exists, io_error."""
    if isinstance(exc, PermissionError):
        return "permission"
    if isinstance(exc, FileExistsError):
        return "exists"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk_full"
    return "io_error"


class _File:
    """One session's files and timeline, owned by the writer thread."""

    def __init__(self, directory: Path, session_id: str) -> None:
        self.session_id = session_id
        self.paths = [directory / f"{session_id}{suffix}" for suffix in SUFFIXES]
        self.events_fd = -1
        self.audio: OggOpusFile | None = None
        self.events_bytes = 0
        self.timeline = Timeline(make_resampler)
        self.input_end = 0  # the timeline position the input reached
        self._lines = bytearray()  # JSON lines not written yet (`write_lines`)
        # The user's latest contiguous input chunks (float32 at `_user_rate`), laid as one (`lay_user`).
        self._user: list[np.ndarray] = []
        self._user_n = self._user_rate = self._user_pos = self._user_next = 0
        audio_fd = open_private(self.paths[0])
        try:
            self.events_fd = open_private(self.paths[1])
            self.audio = OggOpusFile(audio_fd)
        except BaseException:
            os.close(audio_fd)
            if self.events_fd >= 0:
                os.close(self.events_fd)
            raise

    @property
    def bytes(self) -> int:
        return self.events_bytes + (self.audio.bytes if self.audio is not None else 0)

    def line(self, obj: dict[str, Any]) -> int:
        """One JSON line, written with the next audio (a write per line cost more than the rest)."""
        return self.text(json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n")

    def text(self, line: str) -> int:
        """A JSON line already made (the input's, 50 a second: a format string, not json.dumps)."""
        data = line.encode()
        self._lines += data
        self.events_bytes += len(data)
        if len(self._lines) >= LINES_BUFFER:
            self.write_lines()
        return len(data)

    def write_lines(self) -> None:
        view = memoryview(self._lines)
        while view:
            view = view[os.write(self.events_fd, view):]
        view.release()
        self._lines.clear()

    def user_audio(self, samples: np.ndarray, rate: int, pos: int) -> None:
        """The user's input chunk at timeline position `pos`: contiguous chunks gather, up to
        WRITE_EVERY_MS, and reach the timeline as one (its resampling per 20 ms chunk cost more
        than the encoding)."""
        if self._user and (rate != self._user_rate or abs(pos - self._user_next) > RATE // 1000):
            self.lay_user()
        if not self._user:
            self._user_rate, self._user_pos = rate, pos
        self._user.append(samples)
        self._user_n += samples.size
        self._user_next = self._user_pos + self._user_n * RATE // rate
        if self._user_n >= rate * WRITE_EVERY_MS // 1000:
            self.lay_user()

    def lay_user(self) -> None:
        """The gathered input onto the timeline (before anything else reads or changes it)."""
        if self._user:
            samples = self._user[0] if len(self._user) == 1 else np.concatenate(self._user)
            self.timeline.add(USER, "user", samples, self._user_rate, self._user_pos)
            self._user, self._user_n = [], 0

    def encode(self, upto: int) -> int:
        assert self.audio is not None
        self.lay_user()
        written = self.audio.write(self.timeline.take(upto))
        self.write_lines()
        return written

    def close(self, finish: bool) -> int:
        written = 0
        try:
            if self.audio is not None:
                audio, self.audio = self.audio, None
                written = audio.close(finish)
        finally:
            if self.events_fd >= 0:
                try:
                    if finish:
                        self.write_lines()
                finally:
                    os.close(self.events_fd)
                self.events_fd = -1
        return written


class _Writer:
    """The writer thread: takes the hooks' items in order and keeps every open recording."""

    def __init__(self, recordings: Recordings) -> None:
        self.r = recordings
        self.metrics = recordings.metrics
        self.policy = recordings.policy
        self.directory = Path(recordings.policy.directory)  # type: ignore[arg-type]
        self.files: dict[int, _File] = {}  # by id() of the _Live
        self.max_samples = int(self.policy.max_s * RATE)

    def run(self) -> None:
        while (item := self.r._queue.get()) is not None:
            op, live = item[0], item[1]
            if op == "retain":
                self._retain()
                continue
            if op == "open":
                self._open(live, *item[2:])
                continue
            file = self.files.get(id(live))
            if file is None:
                continue  # its recording ended (a bound, a failure) or never opened
            try:
                if op != "in":  # what changes or reads the timeline comes after the input before it
                    file.lay_user()
                getattr(self, f"_{op}")(file, live, *item[2:])
                if op != "end" and file.bytes > self.policy.max_bytes:
                    self._stop(file, live, "max_bytes", f"the recording reached its size bound of "
                                                        f"{self.policy.max_bytes} bytes")
            except Exception as exc:  # a full disk, a file gone: the recording ends, the session goes on
                reason = _reason(exc)
                self.metrics.recording_failures.labels(reason).inc()
                log.error("recording failed (%s): %s; the session goes on unrecorded", reason, exc,
                          extra={"session_id": file.session_id})
                self._finish(file, live, "failed", finish=False)

    def _open(self, live: _Live, session_id: str, wall: float) -> None:
        try:
            file = _File(self.directory, session_id)
        except Exception as exc:
            reason = _reason(exc)
            self.metrics.recording_failures.labels(reason).inc()
            self.metrics.recordings_active.dec()
            self.metrics.recordings_total.labels("failed").inc()
            log.error("recording could not start (%s): %s; the session goes on unrecorded", reason, exc,
                      extra={"session_id": session_id})
            live.stopped = True
            return
        self.files[id(live)] = file
        self._count(file.line({"type": "recording.started", "session_id": session_id, "wall": wall,
                               "clock_ms": live.origin_ms, "audio_file": file.paths[0].name, "sample_rate": FILE_RATE,
                               "channels": ["user", "agent"]}))
        log.info("recording", extra={"session_id": session_id, "path": str(file.paths[0])})

    def _count(self, written: int) -> None:
        if written:
            self.metrics.recording_bytes.inc(written)

    def _in(self, file: _File, live: _Live, chunks: list[tuple[Any, ...]]) -> None:
        for chunk in chunks:
            if id(live) not in self.files:  # a bound ended it
                return
            self._chunk(file, live, *chunk)

    def _chunk(self, file: _File, live: _Live, request: Any, pos: int, encoding: int, rate: int, clock: float,
               wall: float) -> None:
        audio = request.input_audio_buffer_append.audio
        event_id = f'"event_id":{json.dumps(request.event_id)},' if request.event_id else ""
        self._count(file.text(f'{{"clock_ms":{round(clock, 1)},"wall":{wall!r},"from":"client","event":'
                              f'{{"type":"input_audio_buffer.append",{event_id}"audio_bytes":{len(audio)}}}}}\n'))
        samples = DECODERS[encoding](audio)
        file.user_audio(samples, rate, pos)
        file.input_end = pos + samples.size * RATE // rate
        if upto := file.timeline.due(file.input_end, self.max_samples):
            self._count(file.encode(upto))
        if file.input_end >= self.max_samples:
            self._stop(file, live, "max_duration", f"the recording reached its duration bound of "
                                                   f"{self.policy.max_s:g} s")

    def _out(self, file: _File, live: _Live, event: Any, pos: int, clock: float, wall: float) -> None:
        delta = event.response_output_audio_delta
        self._count(file.line({"clock_ms": round(clock, 1), "wall": wall, "from": "server",
                               "event": _audio_json("response.output_audio.delta", "", {
                                   "response_id": delta.response_id, "item_id": delta.item_id,
                                   "audio_bytes": len(delta.audio), "sample_rate": delta.sample_rate})}))
        if delta.sample_rate and delta.audio and pos < self.max_samples:
            file.timeline.add(AGENT, delta.response_id, pcm16_to_float(delta.audio), delta.sample_rate, pos)

    def _event(self, file: _File, live: _Live, side: str, event: Any, clock: float, wall: float) -> None:
        self._count(file.line({"clock_ms": round(clock, 1), "wall": wall, "from": side, "event": event_json(event)}))

    def _cut(self, file: _File, live: _Live, response_id: str, heard_ms: int | None, at: int | None) -> None:
        timeline = file.timeline
        if heard_ms is not None:
            timeline.cut(response_id, heard_ms * RATE // 1000)
        elif at is not None:
            timeline.cut_from(response_id, at)

    def _done(self, file: _File, live: _Live, response_id: str) -> None:
        file.timeline.finish(response_id, AGENT)

    def _end(self, file: _File, live: _Live, reason: str, wall: float) -> None:
        self._finish(file, live, "completed", reason=reason, wall=wall)

    def _stop(self, file: _File, live: _Live, outcome: str, why: str) -> None:
        log.warning("recording stopped: %s; the session goes on unrecorded", why, extra={"session_id": file.session_id})
        self._finish(file, live, outcome, reason=why)

    def _finish(self, file: _File, live: _Live, outcome: str, reason: str = "", wall: float = 0.0,
                finish: bool = True) -> None:
        """The recording ends: the rest of its audio is encoded (up to its duration bound), the
        files closed, with a last JSONL line saying why (when they can still be written)."""
        live.stopped = True
        self.files.pop(id(live), None)
        self.metrics.recordings_active.dec()
        self.metrics.recordings_total.labels(outcome).inc()
        try:
            if finish:
                file.lay_user()
                timeline = file.timeline
                timeline.finish_all()
                end = min(max(timeline.end, file.input_end), self.max_samples)
                if outcome == "max_bytes":  # what is held back stays out: the file keeps its bound
                    end = timeline.taken
                self._count(file.encode(end))
                self._count(file.line({"type": "recording.stopped", "outcome": outcome, "reason": reason,
                                       "wall": wall or time.time(), "audio_ms": round(end * 1000 / RATE),
                                       "late_ms": round(timeline.late * 1000 / RATE)}))
        except Exception as exc:
            self.metrics.recording_failures.labels(_reason(exc)).inc()
            log.error("recording could not be finished: %s", exc, extra={"session_id": file.session_id})
            finish = False
        finally:
            try:
                self._count(file.close(finish))
            except Exception as exc:
                self.metrics.recording_failures.labels(_reason(exc)).inc()
                log.error("recording could not be closed: %s", exc, extra={"session_id": file.session_id})

    def _retain(self) -> None:
        """Delete recordings older than the retention (not those still being written)."""
        cutoff = time.time() - self.policy.retention_h * 3600
        open_paths = {path for file in self.files.values() for path in file.paths}
        removed = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            log.warning("recording retention: %s", exc)
            return
        for entry in entries:
            path = Path(entry.path)
            if path.suffix not in SUFFIXES or path in open_paths:
                continue
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                    os.unlink(path)
                    removed += 1
            except OSError as exc:
                log.warning("recording retention: %s", exc)
        if removed:
            log.info("recording retention: deleted %d files older than %g h", removed, self.policy.retention_h)


def _audio_json(name: str, event_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": name, **({"event_id": event_id} if event_id else {}), **fields}


def event_json(event: Any) -> dict[str, Any]:
    """An event's canonical JSON with every bytes field (audio, images) replaced by its size
    (`<field>_bytes`)."""
    sizes: list[tuple[tuple[Any, ...], int]] = []
    if _has_bytes(event):
        event = type(event).FromString(event.SerializeToString())
        for field, value in event.ListFields():  # the event's own message: the JSON's top level
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                _strip(value, (), sizes)
    out = to_json(event)
    for path, size in sizes:
        node: Any = out
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
        node[f"{path[-1]}_bytes"] = size
    return out


def _has_bytes(msg: Any) -> bool:
    for field, value in msg.ListFields():
        if field.type == FieldDescriptor.TYPE_BYTES:
            return True
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            values = value if field.is_repeated else [value]
            if any(_has_bytes(v) for v in values if hasattr(v, "ListFields")):
                return True
    return False


def _strip(msg: Any, path: tuple[Any, ...], sizes: list[tuple[tuple[Any, ...], int]]) -> None:
    """Clear `msg`'s bytes fields, noting each one's JSON path and size."""
    for field, value in msg.ListFields():
        at = (*path, field.name)
        if field.type == FieldDescriptor.TYPE_BYTES:
            if field.is_repeated:
                sizes.append((at, sum(len(v) for v in value)))
            else:
                sizes.append((at, len(value)))
            msg.ClearField(field.name)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for n, v in enumerate(value):
                    if hasattr(v, "ListFields"):
                        _strip(v, (*at, n), sizes)
            else:
                _strip(value, at, sizes)

