"""A private PulseAudio server with clocked devices, for `talk --mic` tests and benchmarks.

PortAudio reaches it through ALSA's pulse plugin (Debian's libasound2-plugins), as it reaches a
desktop's sound server. The speaker is a null sink (clocked by PulseAudio's timer); its monitor is
recorded by `parec`, so a test sees exactly what came out. The microphone is a pipe source fed by
`Voice`, which writes the test's audio (and silence between, as a live microphone keeps sending)
at real-time pace.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tests.support.serve import RTMEDIA

MIC_RATE = 24000
SINK_RATE = 24000
FEED_MS = 10


def available() -> str:
    """Empty when the pieces are installed, else what is missing."""
    missing = [tool for tool in ("pulseaudio", "parec", "pactl") if shutil.which(tool) is None]
    plugin = list(Path("/usr/lib").glob("*/alsa-lib/libasound_module_pcm_pulse.so"))
    return ", ".join(missing + ([] if plugin else ["ALSA's pulse plugin (libasound2-plugins)"]))


class Voice:
    """The pipe source's writer: real-time pace, silence when nothing is queued."""

    def __init__(self, fifo: Path) -> None:
        self.fifo = fifo
        self.lock = threading.Lock()
        self.queue = np.zeros(0, np.int16)
        self.stopped = threading.Event()
        self.spoken: list[tuple[float, float]] = []  # (perf_counter written, seconds) of each say()
        self.thread = threading.Thread(target=self._run, name="pulse-voice", daemon=True)

    def say(self, samples: np.ndarray) -> float:
        """Queue int16 samples at MIC_RATE; returns how long they last."""
        with self.lock:
            self.queue = np.concatenate([self.queue, samples.astype(np.int16)])
        return len(samples) / MIC_RATE

    def busy(self) -> bool:
        with self.lock:
            return bool(len(self.queue))

    def _run(self) -> None:
        step = MIC_RATE * FEED_MS // 1000
        with open(self.fifo, "wb", buffering=0) as out, contextlib.suppress(BrokenPipeError):
            start, n = time.perf_counter(), 0
            while not self.stopped.is_set():
                with self.lock:
                    chunk, self.queue = self.queue[:step], self.queue[step:]
                chunk = np.concatenate([chunk, np.zeros(step - len(chunk), np.int16)])
                out.write(chunk.astype("<i2").tobytes())
                n += 1
                delay = start + n * FEED_MS / 1000 - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)


class Pulse:
    """The running server: `env` reaches it (ALSA device `pulse`), `voice` speaks into the microphone,
    `recording()` is what the speaker played so far."""

    def __init__(self, root: Path) -> None:
        self.root = root
        runtime = root / "runtime"
        runtime.mkdir(parents=True, exist_ok=True)
        self.socket = runtime / "native"
        self.env = {**os.environ, "PULSE_SERVER": f"unix:{self.socket}", "PULSE_RUNTIME_PATH": str(runtime),
                    "PULSE_SINK": "speaker", "PULSE_SOURCE": "microphone", "HOME": str(root),
                    "XDG_RUNTIME_DIR": str(runtime), "PULSE_COOKIE": str(root / "cookie")}
        self.fifo = root / "mic.fifo"
        self.record_path = root / "speaker.raw"
        self.log = root / "pulseaudio.log"
        self.process: subprocess.Popen | None = None
        self.recorder: subprocess.Popen | None = None
        self.drain: subprocess.Popen | None = None
        self.voice = Voice(self.fifo)

    def start(self) -> None:
        modules = [
            f"module-native-protocol-unix socket={self.socket} auth-anonymous=1",
            f"module-null-sink sink_name=speaker rate={SINK_RATE} channels=1 format=s16le",
            f"module-pipe-source source_name=microphone file={self.fifo} rate={MIC_RATE} channels=1 format=s16le",
        ]
        args = ["pulseaudio", "-n", "--daemonize=no", "--exit-idle-time=-1", "--use-pid-file=no",
                "--disable-shm=yes", "--log-target=stderr", "--realtime=no", "--high-priority=no"]
        for module in modules:
            args += ["-L", module]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not self.fifo.exists() or \
                subprocess.run(["pactl", "info"], env=self.env, capture_output=True).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pulseaudio did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.voice.thread.start()  # the pipe source (it made the FIFO) reads what the voice writes
        # The pipe source queues what it reads while nothing records from it, and a client would get
        # that backlog as one burst: a recorder that never stops keeps it live.
        self.drain = subprocess.Popen(["parec", "-d", "microphone", "--raw", "--latency-msec=20"], env=self.env,
                                      stdout=subprocess.DEVNULL)
        with open(self.record_path, "wb") as out:
            self.recorder = subprocess.Popen(
                ["parec", "-d", "speaker.monitor", "--format=s16le", f"--rate={SINK_RATE}", "--channels=1", "--raw",
                 "--latency-msec=20"], env=self.env, stdout=out)

    def recording(self) -> np.ndarray:
        """What the speaker has played (int16 at SINK_RATE), from the start of the recording."""
        return np.frombuffer(self.record_path.read_bytes() if self.record_path.exists() else b"", "<i2")

    def stop(self) -> None:
        self.voice.stop()
        for process in (self.recorder, self.drain, self.process):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()


@contextmanager
def running_pulse(root: Path) -> Iterator[Pulse]:
    pulse = Pulse(root)
    try:
        pulse.start()
        yield pulse
    finally:
        pulse.stop()


class LiveTalk:
    """A running `rtmedia talk --mic --json --responder echo` on `pulse`'s devices against
    `served` ({"target", "log"}): its events as they arrive."""

    def __init__(self, served, pulse, *args: str, stdin=None) -> None:
        cmd = [RTMEDIA, "talk", "--mic", "--json", "--responder", "echo", "--target", served["target"], *args]
        self.process = subprocess.Popen(cmd, env=pulse.env, stdin=stdin, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.lines: list[dict] = []
        self.served = served
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(json.loads(line))

    def events(self, kind: str) -> list[dict]:
        return [e for e in list(self.lines) if e["type"] == kind]

    def wait(self, what, timeout: float = 60.0, why: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.process.poll() is not None and not self.reader.is_alive():
                raise AssertionError(f"talk --mic exited {self.process.returncode} waiting for {why}: {self.end()}")
            if time.monotonic() > deadline:
                types = [e["type"] for e in self.lines][-30:]
                raise AssertionError(f"timed out waiting for {why}; events: {types}\nstderr: {self.end()}\n"
                                     f"server log: {self.served['log'].read_text()[-2000:]}")
            time.sleep(0.05)

    def end(self) -> str:
        """Stop the process (if it still runs) and close its pipes; its stderr."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.reader.join(timeout=10)
        stderr = self.process.stderr.read()
        self.process.stdout.close()
        self.process.stderr.close()
        return stderr

    def interrupt(self) -> tuple[list[dict], dict, str]:
        """Ctrl-C, then the events, the summary and stderr."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=30)
        stderr = self.end()
        assert self.process.returncode == 0, stderr
        assert self.lines and self.lines[-1]["type"] == "summary", stderr
        return self.lines[:-1], self.lines[-1], stderr


def voiced_spans(samples: np.ndarray, rate: int = SINK_RATE, window_ms: int = 10, threshold: int = 200,
                 gap_ms: int = 400) -> list[tuple[float, float]]:
    """(start, end) seconds of the sound in `samples`: windows whose peak is over `threshold`,
    merged across gaps shorter than `gap_ms` (the pauses inside a reply)."""
    step = rate * window_ms // 1000
    n = len(samples) // step
    if not n:
        return []
    loud = np.abs(samples[:n * step].reshape(n, step).astype(np.int32)).max(axis=1) > threshold
    spans: list[list[float]] = []
    for i in np.flatnonzero(loud):
        t = i * window_ms / 1000
        if spans and t - spans[-1][1] <= gap_ms / 1000:
            spans[-1][1] = t + window_ms / 1000
        else:
            spans.append([t, t + window_ms / 1000])
    return [(a, b) for a, b in spans]
