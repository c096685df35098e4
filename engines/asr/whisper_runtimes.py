"""The runtimes Whisper runs on, by name: `ct2` (CTranslate2, engines/asr/whisper_ct2.py) and `torch`
(engines/asr/whisper_torch.py, CUDA graphs on a GPU).

Each factory imports its runtime only when called, so a server on CTranslate2 never imports the torch
model code and the reverse. `auto` is not a runtime but a choice among them: torch on CUDA, else ct2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rtmedia.engines.asr.whisper_model import WhisperBackend
from rtmedia.engines.base import EngineError
from rtmedia.engines.registry import Registry

AUTO = "auto"

WHISPER_RUNTIMES: Registry[WhisperBackend] = Registry("Whisper runtime")


def _ct2(path: Path, device: str, compute_type: str, intra_threads: int, inter_threads: int,
         graphs: Any = None) -> WhisperBackend:
    from rtmedia.engines.asr.whisper_ct2 import CTranslate2Backend

    try:
        return CTranslate2Backend(path, device, compute_type, intra_threads, inter_threads)
    except ValueError as exc:  # an unsupported compute type on this device
        raise EngineError(f"{path}: CTranslate2 cannot run it: {exc}") from None


def _torch(path: Path, device: str, compute_type: str, intra_threads: int, inter_threads: int,
           graphs: Any = None) -> WhisperBackend:
    from rtmedia.engines.asr.whisper_torch import TorchBackend

    return TorchBackend(path, device, compute_type, threads=intra_threads, graphs=graphs)


WHISPER_RUNTIMES.add("ct2", _ct2)
WHISPER_RUNTIMES.add("torch", _torch)


def runtime_choices() -> tuple[str, ...]:
    """What a setting may name: `auto` and each runtime."""
    return (AUTO, *WHISPER_RUNTIMES.names())


def resolve_runtime(name: str, cuda: bool) -> str:
    """The runtime `name` chooses on a machine with (`cuda`) or without a CUDA device: `auto` is torch
    on CUDA (its CUDA graphs) and CTranslate2 on a CPU (int8); a runtime's name is itself."""
    if name == AUTO:
        return "torch" if cuda else "ct2"
    WHISPER_RUNTIMES.factory(name)  # ValueError names the runtimes there are
    return name
