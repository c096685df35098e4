"""Whisper on CTranslate2: int8 on a CPU, float16 on CUDA (the `ct2` runtime of engines/asr/whisper_runtimes.py).

CTranslate2 releases the GIL while it computes, so it runs in the server's process; `inter_threads`
computations run at once, each on `intra_threads` cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rtmedia.engines.asr.whisper_model import Decoded


class CTranslate2Backend:
    """Whisper on CTranslate2 (int8 on a CPU, float16 on CUDA)."""

    runtime = "ct2"

    def __init__(self, path: Path, device: str = "cpu", compute_type: str = "", intra_threads: int = 1,
                 inter_threads: int = 2) -> None:
        import ctranslate2

        self._ct2 = ctranslate2
        kind, _, index = device.partition(":")
        self.compute_type = compute_type or ("float16" if kind == "cuda" else "int8")
        self.model = ctranslate2.models.Whisper(str(path), device=kind, device_index=int(index or 0),
                                                compute_type=self.compute_type,
                                                intra_threads=intra_threads, inter_threads=inter_threads)
        self.n_mels = self.model.n_mels
        self.multilingual = self.model.is_multilingual

    def encode(self, features: np.ndarray) -> Any:
        return self.model.encode(self._ct2.StorageView.from_array(np.ascontiguousarray(features)), to_cpu=True)

    def generate(self, encoded: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[Decoded]:
        # (CTranslate2's max_length counts the prompt's tokens too; a batch's prompts are of one length)
        results = self.model.generate(encoded, prompts, beam_size=1,
                                      max_length=max(max_tokens) + 4 + max(map(len, prompts)),
                                      return_scores=True, return_no_speech_prob=True, suppress_blank=True)
        out = []
        for result, cap in zip(results, max_tokens, strict=True):
            ids = result.sequences_ids[0][:cap]
            length = max(1, len(result.sequences_ids[0]))
            out.append(Decoded(list(ids), result.scores[0] / length, result.no_speech_prob))
        return out

    def align(self, encoded: Any, start: list[int], tokens: list[list[int]], frames: list[int]) -> list[Any]:
        return list(self.model.align(encoded, start, tokens, frames))

    def detect_language(self, encoded: Any) -> list[str]:
        return [found[0][0] for found in self.model.detect_language(encoded)]
