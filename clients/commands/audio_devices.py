"""The computer's microphone and speaker through PortAudio (sounddevice), for `rtmedia talk --mic`
and `rtmedia devices`.

`Microphone` hands the event loop fixed-size PCM16 chunks at a session input rate, each stamped
with when its last sample reached the converter (PortAudio's input ADC time). `Speaker` plays
replies from a small jitter buffer and knows, from PortAudio's output DAC times, how much of each
reply has come out of the speaker: that is what `playback.ack` reports, so a barge-in truncates
the history at what the user heard. PortAudio callbacks run on its own thread; both classes keep
their shared state under one lock and do no more in a callback than copy samples.

Every failure to find or open a device is a `DeviceError` with one line saying what and which.
An audio system that cannot start is one too: PortAudio first starts in a short child process
(`probe_audio_system`), because on a broken ALSA configuration it does not fail but aborts the
whole process (an assert in its ALSA device listing) before Python can say anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from rtmedia.engines.audio.resample import float_to_pcm16, make_resampler

SESSION_RATES = (24000, 16000, 8000)  # input rates a session takes, best first
RESAMPLE_TO = 24000
OUTPUT_BLOCK_MS = 5  # the speaker's callback period: the device buffer is a few periods deep, so it sets latency


class DeviceError(RuntimeError):
    """An audio device is missing, unknown, or failed; the message is one line for the user."""


@contextlib.contextmanager
def native_quiet() -> Any:
    """Standard error closed at the file descriptor while PortAudio works: ALSA and PortAudio print
    their diagnostics there (several lines per failed open), and each failure comes back as an
    exception whose message says it in one line."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_ALSA_ERROR = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p)
_alsa_handler: Any = None


def _quiet_alsa() -> None:
    """ALSA prints a line to standard error for each underrun it recovers from, under the live view;
    its error handler is set to one that says nothing (PortAudio reports the same through its
    callback status, which the speaker counts)."""
    global _alsa_handler
    if _alsa_handler is not None:
        return
    try:
        alsa = ctypes.CDLL("libasound.so.2")
    except OSError:  # not ALSA (or not Linux): nothing to quiet
        return
    _alsa_handler = _ALSA_ERROR(lambda *_: None)
    alsa.snd_lib_error_set_handler(_alsa_handler)


PROBE_TIMEOUT_S = 20.0
_PROBE_MARK = "-- rtmedia: PortAudio starts --"
# The child: ALSA loads its configuration (and says on stderr what is wrong with it), then PortAudio
# starts as `import sounddevice` starts it (Pa_Initialize, which lists every ALSA device), and the
# last line of stdout says how that went; a crash is the child's exit status.
_PROBE = f"""
import ctypes, sys
try:
    ctypes.CDLL("libasound.so.2").snd_config_update()
except (OSError, AttributeError):
    pass
print({_PROBE_MARK!r}, file=sys.stderr, flush=True)
def load():
    try:
        return ctypes.CDLL("libportaudio.so.2")
    except OSError:
        from ctypes.util import find_library
        name = find_library("portaudio")
        try:
            return ctypes.CDLL(name) if name else None
        except OSError:
            return None
pa = load()
if pa is None:
    print("absent")
    sys.exit()
pa.Pa_GetErrorText.restype = ctypes.c_char_p
class HostError(ctypes.Structure):
    _fields_ = [("api", ctypes.c_int), ("code", ctypes.c_long), ("text", ctypes.c_char_p)]
pa.Pa_GetLastHostErrorInfo.restype = ctypes.POINTER(HostError)
code = pa.Pa_Initialize()
if code == 0:
    print("ok")
    sys.exit()
text = pa.Pa_GetErrorText(code).decode(errors="replace")
host = pa.Pa_GetLastHostErrorInfo().contents.text if code == -9999 else None
print("error", text + (": " + host.decode(errors="replace") if host else ""))
"""
_ALSA_LINE = re.compile(r"^ALSA lib \S+:\d+:\(\w+\) (.+)$")
_probed: str | None = None  # the probe's finding ("" when PortAudio starts), once per process


def _alsa_said(stderr: str) -> list[str]:
    """ALSA's complaints about its configuration, without their source-file prefixes."""
    said: list[str] = []
    for line in stderr.split(_PROBE_MARK)[0].splitlines():
        match = _ALSA_LINE.match(line.strip())
        if match and " ".join(match[1].split()) not in said:
            said.append(" ".join(match[1].split()))
    return said[:3]


def _config_hint(alsa_said: list[str]) -> str:
    """Where to look: the files ALSA_CONFIG_PATH names, or ALSA's configuration when it complained."""
    path = os.environ.get("ALSA_CONFIG_PATH")
    if path is not None:
        unreadable = [p for p in re.split("[: ]", path) if p and not (os.path.isfile(p) and os.access(p, os.R_OK))]
        if unreadable == [path]:
            return f"; ALSA_CONFIG_PATH={path} is not a readable file"
        if unreadable:
            return f"; ALSA_CONFIG_PATH={path} names files that cannot be read: {', '.join(unreadable)}"
        return f"; check ALSA_CONFIG_PATH={path}"
    return "; check the ALSA configuration (/etc/asound.conf, ~/.asoundrc)" if alsa_said else ""


def probe_audio_system() -> str:
    """Start PortAudio in a child process first: "" when it starts, else the one-line problem.
    Once per process (the child costs about as much as PortAudio's own start, tens of ms); a probe
    that cannot run at all says nothing, and PortAudio starts here as it would have."""
    global _probed
    if _probed is not None:
        return _probed
    _probed = ""
    if not sys.executable:
        return _probed
    try:
        child = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _probed = f"the audio system failed to start: PortAudio did not list the audio devices in {PROBE_TIMEOUT_S:g} s"
        return _probed
    except OSError:
        return _probed
    said = _alsa_said(child.stderr.decode(errors="replace"))
    last = (child.stdout.decode(errors="replace").strip().splitlines() or [""])[-1]
    if child.returncode < 0:
        try:
            name = signal.Signals(-child.returncode).name
        except ValueError:
            name = f"signal {-child.returncode}"
        what = f"PortAudio crashed ({name}) while it listed the audio devices"
    elif child.returncode == 0 and last.startswith("error "):
        what = f"PortAudio: {last.removeprefix('error ')}"
    else:  # it started ("ok"), there is no PortAudio ("absent": importing sounddevice says so), or the probe broke
        return _probed
    notes = f" (ALSA: {'; '.join(said)})" if said else ""
    _probed = f"the audio system failed to start: {what}{notes}{_config_hint(said)}"
    return _probed


def portaudio() -> Any:
    """The sounddevice module, or a DeviceError when the PortAudio library is missing or the audio
    system fails to start."""
    if "sounddevice" not in sys.modules:
        problem = probe_audio_system()
        if problem:
            raise DeviceError(problem)
    _quiet_alsa()
    try:
        with native_quiet():  # importing it initialises PortAudio, which probes every ALSA device
            import sounddevice
    except OSError as exc:  # sounddevice raises OSError when libportaudio cannot be loaded
        raise DeviceError(f"audio devices need the PortAudio library ({exc}); on Debian: apt install libportaudio2") \
            from None
    except Exception as exc:  # sounddevice.PortAudioError: Pa_Initialize failed (the module is not there to name it)
        if type(exc).__name__ != "PortAudioError":
            raise
        raise DeviceError(f"the audio system failed to start: {_reason(exc)}") from None
    return sounddevice


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _device(sd: Any, device: str | int | None, kind: str) -> dict[str, Any]:
    """The device's info dict; `device` is an index, a name (substring), or None for the default."""
    if isinstance(device, str) and device.isdigit():
        device = int(device)
    try:
        with native_quiet():
            info = sd.query_devices(device, kind)
    except (ValueError, sd.PortAudioError) as exc:
        which = "the default" if device is None else repr(device)
        raise DeviceError(f"no audio {kind} device: {which} ({_reason(exc)}); `rtmedia devices` lists them") from None
    return dict(info)


def list_devices() -> list[dict[str, Any]]:
    """Every device PortAudio sees: index, name, host API, channels, default rate, default marks."""
    sd = portaudio()
    try:
        with native_quiet():
            devices, apis = sd.query_devices(), sd.query_hostapis()
        default_in, default_out = sd.default.device
    except sd.PortAudioError as exc:
        raise DeviceError(f"PortAudio cannot list audio devices: {_reason(exc)}") from None
    return [{"index": d["index"], "name": d["name"], "host_api": apis[d["hostapi"]]["name"],
             "input_channels": d["max_input_channels"], "output_channels": d["max_output_channels"],
             "default_sample_rate": int(d["default_samplerate"]),
             "default_input": d["index"] == default_in, "default_output": d["index"] == default_out}
            for d in devices]


def _pick_rate(sd: Any, device: int, kind: str, rates: tuple[int, ...], fallback: float) -> int:
    """The first of `rates` the device opens mono PCM16 at, else its default rate."""
    check = sd.check_input_settings if kind == "input" else sd.check_output_settings
    for rate in rates:
        try:
            with native_quiet():
                check(device=device, channels=1, dtype="int16", samplerate=rate)
            return rate
        except (ValueError, sd.PortAudioError):
            continue
    return int(fallback)


def dbfs(pcm: np.ndarray) -> float:
    """The RMS level of int16 samples in dBFS (-inf for silence)."""
    if not len(pcm):
        return -math.inf
    rms = math.sqrt(float(np.mean(pcm.astype(np.float64) ** 2))) / 32768
    return 20 * math.log10(rms) if rms > 0 else -math.inf


@dataclass
class Chunk:
    pcm: bytes  # PCM16 at the microphone's session rate
    captured_t: float  # perf_counter when its last sample was captured
    level_dbfs: float


class _Device:
    """One open PortAudio stream of mono int16 blocks: what the microphone and speaker share."""

    what = "device"  # how errors name it
    info: dict[str, Any]
    stream: Any
    _stopping = False

    @property
    def name(self) -> str:
        return str(self.info["name"])

    def _open(self, sd: Any, stream_type: Any, rate: int, block_ms: int) -> None:
        try:
            with native_quiet():
                self.stream = stream_type(samplerate=rate, blocksize=rate * block_ms // 1000,
                                          device=self.info["index"], channels=1, dtype="int16", latency="low",
                                          callback=self._callback, finished_callback=self._finished)
                self.stream.start()
        except (sd.PortAudioError, ValueError) as exc:
            raise DeviceError(f"cannot open the {self.what} {self.name!r}: {_reason(exc)}") from None

    def _callback(self, data: np.ndarray, frames: int, t: Any, status: Any) -> None:
        raise NotImplementedError

    def _finished(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stopping = True
        with native_quiet():
            self.stream.abort()
            self.stream.close()


class Microphone(_Device):
    """The input device as `chunk_ms` PCM16 chunks at a session rate (24/16/8 kHz, else resampled to
    24 kHz), queued to the event loop; `await next()` returns one, or raises DeviceError when the
    stream stopped."""

    what = "microphone"

    def __init__(self, device: str | int | None, chunk_ms: int, loop: asyncio.AbstractEventLoop) -> None:
        sd = portaudio()
        self.info = _device(sd, device, "input")
        self.device_rate = _pick_rate(sd, self.info["index"], "input", SESSION_RATES, self.info["default_samplerate"])
        self.rate = self.device_rate if self.device_rate in SESSION_RATES else RESAMPLE_TO
        self._resampler: Any = None
        if self.rate != self.device_rate:
            self._resampler = make_resampler(self.device_rate, self.rate)
        self.loop, self.overflows = loop, 0
        self.queue: asyncio.Queue[Chunk | DeviceError] = asyncio.Queue()
        self._open(sd, sd.InputStream, self.device_rate, chunk_ms)

    def _callback(self, indata: np.ndarray, frames: int, t: Any, status: Any) -> None:
        if status.input_overflow:
            self.overflows += 1
        captured = time.perf_counter() - (t.currentTime - t.inputBufferAdcTime) + frames / self.device_rate
        self.loop.call_soon_threadsafe(self._arrived, indata[:, 0].copy(), captured)

    def _arrived(self, samples: np.ndarray, captured: float) -> None:
        if self._resampler is not None:
            pcm = float_to_pcm16(self._resampler.process(samples.astype(np.float32) / 32768))
            samples = np.frombuffer(pcm, "<i2")
        self.queue.put_nowait(Chunk(samples.astype("<i2").tobytes(), captured, dbfs(samples)))

    def _finished(self) -> None:
        if not self._stopping:
            self.loop.call_soon_threadsafe(self.queue.put_nowait,
                                           DeviceError(f"the microphone {self.name!r} stopped"))

    async def next(self) -> Chunk:
        item = await self.queue.get()
        if isinstance(item, DeviceError):
            raise item
        return item



@dataclass
class _Segment:
    """Frames of one reply placed on the speaker's timeline (frames since the stream started)."""
    response_id: str
    start: int
    frames: int


class Speaker(_Device):
    """The output device, playing replies in order from a jitter buffer.

    The timeline counts every frame handed to PortAudio, silence included. After each callback the
    speaker knows which timeline frame reaches the DAC when (PortAudio's outputBufferDacTime), so
    `played_ms(r)` is how much of reply r has come out of the speaker by now. Playback of a reply
    starts once `jitter_ms` is buffered or the reply has ended; an underrun plays silence and
    buffers again. While `paused` (voice over a reply being judged) it plays silence and keeps
    what is queued.
    """

    what = "speaker"

    def __init__(self, device: str | int | None, rate_hint: int, jitter_ms: int) -> None:
        sd = portaudio()
        self.info = _device(sd, device, "output")
        self.rate = _pick_rate(sd, self.info["index"], "output", (rate_hint, 48000, 44100),
                               self.info["default_samplerate"])
        self.jitter_frames = self.rate * jitter_ms // 1000
        self.lock = threading.Lock()
        self.queue: deque[tuple[str, np.ndarray]] = deque()  # (response_id, int16 samples) not yet handed over
        self.queued = 0
        self.ended: set[str] = set()  # replies whose audio is complete
        self.segments: deque[_Segment] = deque()
        self.first_dac: dict[str, float] = {}  # perf_counter when a reply's first frame reaches the DAC
        self.timeline = 0
        self.anchor = (0, math.inf)  # (timeline frame, perf_counter it reaches the DAC)
        self.buffering = True
        self.paused = False
        self.underruns = 0  # the jitter buffer ran dry inside a reply
        self.device_underflows = 0  # PortAudio's: the callback came too late for the device
        self.output_latency_s = 0.0
        self.failed: str = ""
        self._open(sd, sd.OutputStream, self.rate, OUTPUT_BLOCK_MS)

    # ---- the event loop's side -----------------------------------------------------------------
    def play(self, response_id: str, pcm: bytes) -> None:
        samples = np.frombuffer(pcm, "<i2")
        with self.lock:
            self.queue.append((response_id, samples))
            self.queued += len(samples)

    def end(self, response_id: str) -> None:
        """No more audio comes for this reply: what is buffered plays without waiting for more."""
        with self.lock:
            self.ended.add(response_id)

    def clear(self, response_id: str) -> None:
        """Drop the reply's audio not yet handed to the device (what the device holds still plays)."""
        with self.lock:
            kept = deque((r, s) for r, s in self.queue if r != response_id)
            self.queued = sum(len(s) for _, s in kept)
            self.queue = kept
            self.ended.add(response_id)

    def _heard_frame(self, now: float) -> float:
        frame, dac = self.anchor
        return min(self.timeline, max(0.0, frame + (now - dac) * self.rate))

    def played_ms(self, response_id: str, now: float | None = None) -> int:
        """Whole ms of the reply that have come out of the speaker by `now`."""
        with self.lock:
            heard = self._heard_frame(time.perf_counter() if now is None else now)
            frames = sum(min(max(0.0, heard - s.start), s.frames) for s in self.segments if s.response_id == response_id)
        return int(frames * 1000 // self.rate)

    def pending(self, response_id: str, now: float | None = None) -> bool:
        """The reply has audio still to come out: queued, or in the device and not played yet."""
        with self.lock:
            if any(r == response_id for r, _ in self.queue):
                return True
            heard = self._heard_frame(time.perf_counter() if now is None else now)
            return any(s.response_id == response_id and s.start + s.frames > heard for s in self.segments)

    def audible(self, now: float | None = None) -> bool:
        """Anything is queued or still in the device to be played."""
        with self.lock:
            if self.queue:
                return True
            heard = self._heard_frame(time.perf_counter() if now is None else now)
            return bool(self.segments) and self.segments[-1].start + self.segments[-1].frames > heard

    def forget(self, response_id: str) -> None:
        """The reply is done with (played out or cleared and acknowledged)."""
        with self.lock:
            self.segments = deque(s for s in self.segments if s.response_id != response_id)
            self.ended.discard(response_id)

    # ---- PortAudio's thread --------------------------------------------------------------------
    def _callback(self, out: np.ndarray, frames: int, t: Any, status: Any) -> None:
        dac = time.perf_counter() + (t.outputBufferDacTime - t.currentTime)
        if status.output_underflow:
            self.device_underflows += 1
        with self.lock:
            self.anchor = (self.timeline, dac)
            self.output_latency_s = t.outputBufferDacTime - t.currentTime
            filled = 0
            if self.paused:
                out[:, 0] = 0
                self.timeline += frames
                return
            if self.buffering and self.queue:
                last = self.queue[-1][0]
                self.buffering = self.queued < self.jitter_frames and last not in self.ended
            while filled < frames and self.queue and not self.buffering:
                response_id, samples = self.queue[0]
                n = min(frames - filled, len(samples))
                out[filled:filled + n, 0] = samples[:n]
                self.first_dac.setdefault(response_id, dac + filled / self.rate)
                tail = self.segments[-1] if self.segments else None
                if tail is not None and tail.response_id == response_id and tail.start + tail.frames == \
                        self.timeline + filled:
                    tail.frames += n
                else:
                    self.segments.append(_Segment(response_id, self.timeline + filled, n))
                filled += n
                self.queued -= n
                if n == len(samples):
                    self.queue.popleft()
                else:
                    self.queue[0] = (response_id, samples[n:])
            if filled < frames:
                out[filled:, 0] = 0
            if not self.queue and not self.buffering:  # drained: the next audio waits for the jitter buffer
                self.buffering = True
                if self.segments and self.segments[-1].response_id not in self.ended:
                    self.underruns += 1  # the reply's audio ran out before its end
            self.timeline += frames

    def _finished(self) -> None:
        if not self._stopping:
            self.failed = f"the speaker {self.name!r} stopped"

