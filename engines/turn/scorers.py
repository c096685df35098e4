"""End-of-turn scorers for semantic_vad (docs/protocol.md#semantic-vad): is the user done?

The text scorer asks a causal LM (the embedded SmolLM2 by default) for the
probability that the next token after the user's words, inside its chat
template and before the end-of-turn token, is an end-of-turn or a
sentence-final token (`<|im_end|>` or the template's end token, `.`, `?`,
`!`). A finished sentence makes that likely and an unfinished one ("can you
tell me how long the") very unlikely. The prompt is short and the same for
every session, so the scores mean the same whatever a session's instructions:
a fixed system message, the conversation's last assistant message (if any), then
the user's words lowercased and unpunctuated (`ids`). `TurnPrompt` builds
its token ids; the LM lane runs it (server/lanes/lm_lane.py `score`).

The acoustic scorer is Smart Turn (pipecat-ai's BSD-2 ONNX model, v3.2 CPU build),
which hears the last 8 s of the turn: `input_features` [batch, 80, 800] are
transformers' `WhisperFeatureExtractor(chunk_length=8)` log-mels of that audio
zero-padded at the start to 128,000 samples (the reference implementation's
padding; the extractor's own pads at the end), normalised; its `logits` [batch, 1]
are already a probability. It is optional and off by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rtmedia.engines.asr.contract import normal_words
from rtmedia.engines.base import EngineError, package_file

# The system message of every scoring prompt (the thresholds were measured with it).
SCORING_SYSTEM = "You are a helpful voice assistant. Answer in one or two short spoken sentences."
END_TEXTS = (".", "?", "!")
_MARK = "\x00"  # where the user's words go when the template is rendered
FLOOR = -12.0  # log10 of a probability that underflowed

SMART_TURN_PACKAGE = "pipecat"
SMART_TURN_FILE = Path("audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx")
SMART_TURN_RATE = 16000
SMART_TURN_SAMPLES = 8 * SMART_TURN_RATE


@dataclass(frozen=True)
class TurnPrompt:
    """Scoring prompts for one tokenizer: `ids(assistant, words)` is `prefix(assistant)`
    followed by the words' tokens; `end_ids` are the tokens whose probability is the score."""

    tokenizer: Any
    end_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> TurnPrompt:
        ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        end_token = getattr(tokenizer, "eot_token", None) or "<|im_end|>"
        if (end := tokenizer.convert_tokens_to_ids(end_token)) not in (None, tokenizer.unk_token_id):
            ends.add(end)
        for text in END_TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids:
                ends.add(ids[0])
        return cls(tokenizer, tuple(sorted(ends)))

    def prefix(self, assistant: str = "") -> list[int]:
        """Token ids up to where the user's words start."""
        messages = [{"role": "system", "content": SCORING_SYSTEM}]
        if assistant:
            messages.append({"role": "assistant", "content": assistant})
        messages.append({"role": "user", "content": _MARK})
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
        return list(self.tokenizer.encode(text[:text.index(_MARK)], add_special_tokens=False))

    def ids(self, assistant: str, words: str) -> list[int]:
        """The prompt of `words` lowercased without punctuation, whatever the recogniser wrote
        (a transcript's "?" would say the turn is finished; the thresholds were measured so)."""
        plain = " ".join(normal_words(words))
        return self.prefix(assistant) + list(self.tokenizer.encode(plain, add_special_tokens=False))

    def score(self, logits: Any) -> float:
        """log10 of the probability of an end token after the prompt, from its last logits."""
        import torch

        probs = torch.softmax(logits.float(), -1)
        p = float(probs[list(self.end_ids)].sum())
        return math.log10(p) if p > 10 ** FLOOR else FLOOR


# --------------------------------------------------------------------------- the acoustic scorer


def smart_turn_path() -> Path:
    """Smart Turn's ONNX file inside the installed `pipecat-ai` wheel (the package is not
    imported: its __init__ pulls dependencies rtmedia does not install)."""
    return package_file(SMART_TURN_PACKAGE, SMART_TURN_FILE, "the acoustic turn model", "pipecat-ai")


def smart_turn_input(audio: np.ndarray) -> np.ndarray:
    """The last 8 s of 16 kHz float audio, zero-padded at the start to exactly 8 s."""
    audio = np.asarray(audio, np.float32)[-SMART_TURN_SAMPLES:]
    return np.concatenate([np.zeros(SMART_TURN_SAMPLES - len(audio), np.float32), audio])


class AcousticTurnModel:
    """Smart Turn v3 (or a model of the same contract): P(the turn is complete) from audio.
    Single calls (batching gains nothing on a CPU); `score` runs in the caller's thread."""

    name = "turn_audio"

    def __init__(self, path: str | Path | None = None, threads: int = 1) -> None:
        self.path = Path(path) if path is not None else None
        self.threads = threads
        self._session: Any = None
        self._features: Any = None

    def load(self) -> None:
        if self._session is not None:
            return
        import onnxruntime as ort
        from transformers import WhisperFeatureExtractor

        path = self.path or smart_turn_path()
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = self.threads
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own types for a bad file
            raise EngineError(f"turn audio model {path}: {exc}") from exc
        inputs = {i.name: i.shape for i in session.get_inputs()}
        if list(inputs) != ["input_features"] or list(inputs["input_features"][1:]) != [80, 800]:
            raise EngineError(f"turn audio model {path}: expected one input input_features [batch, 80, 800], "
                              f"got {inputs}")
        self._features = WhisperFeatureExtractor(chunk_length=8)
        self._session = session

    def warmup(self) -> None:
        self.score(np.zeros(SMART_TURN_RATE, np.float32))

    def step(self, items: list[np.ndarray]) -> list[float]:
        return [self.score(audio) for audio in items]

    def close(self) -> None:
        self._session = self._features = None

    def features(self, audio: np.ndarray) -> np.ndarray:
        """input_features [1, 80, 800] of 16 kHz float audio (see the module docstring)."""
        assert self._features is not None, "load() first"
        return self._features(smart_turn_input(audio), sampling_rate=SMART_TURN_RATE, return_tensors="np",
                              padding="max_length", max_length=SMART_TURN_SAMPLES, truncation=True,
                              do_normalize=True).input_features.astype(np.float32)

    def score(self, audio: np.ndarray) -> float:
        """P(complete) of the turn whose 16 kHz float audio ends with `audio`."""
        self.load()
        out = self._session.run(None, {"input_features": self.features(audio)})[0]
        return float(np.asarray(out).reshape(-1)[0])
