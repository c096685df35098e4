"""The recognisers by name: what the `asr` setting (`--asr`) chooses.

Each entry builds a `Recognizer` (engines/asr/contract.py) from `RecognizerSettings`, reading the
settings that are its own, and imports its backend only when it is built. Adding a recogniser is its
module plus one `RECOGNIZERS.add(name, factory)`; the server builds whichever the setting names
(server/lanes/recognizer.py) and runs its lanes from the recogniser's own `lane_plan`.
"""

from __future__ import annotations

from pathlib import Path

from rtmedia.engines.asr.contract import Recognizer, RecognizerSettings
from rtmedia.engines.registry import Registry

RECOGNIZERS: Registry[Recognizer] = Registry("recogniser")


def whisper(settings: RecognizerSettings) -> Recognizer:
    """Whisper (engines/asr/whisper.py): its model directory (the embedded tiny.en for ""), its runtime
    (`auto`: torch with CUDA graphs on CUDA, CTranslate2 on a CPU; engines/asr/whisper_runtimes.py) and
    precision; `threads` cores per decode batch, `parallel` batches at once. A directory that is no
    Whisper model is an EngineError naming the file."""
    from rtmedia.engines.asr.whisper import WhisperEngine
    from rtmedia.engines.asr.whisper_runtimes import resolve_runtime

    runtime = resolve_runtime(settings.runtime, settings.cuda)
    graphs = settings.graph_runner(settings.max_graphs) if runtime == "torch" and settings.graph_runner else None
    return WhisperEngine(Path(settings.model) if settings.model else None, intra_threads=settings.threads,
                         inter_threads=settings.parallel, on_batch=settings.on_batch, runtime=runtime,
                         device=settings.device, compute_type=settings.compute_type, graphs=graphs)


def pocketsphinx(settings: RecognizerSettings) -> Recognizer:
    """PocketSphinx (engines/asr/pocketsphinx.py): `workers` processes, each building `decoders`
    fast-final decoders at warm-up; a worker silent past `reply_timeout_s` is restarted."""
    from rtmedia.engines.asr.pocketsphinx import AsrEngine

    timeout = {"reply_timeout_s": settings.reply_timeout_s} if settings.reply_timeout_s else {}
    return AsrEngine(workers=settings.workers, decoders=settings.decoders, on_restart=settings.on_restart,
                     **timeout)


RECOGNIZERS.add("whisper", whisper)
RECOGNIZERS.add("pocketsphinx", pocketsphinx)
