"""The recogniser contract: what the server asks of any speech recogniser, and the kind's shared types.

A recogniser is a batched engine (engines/base.py) that holds per-stream state. The server opens a
stream per utterance source (`open_stream`), sends it PCM16 16 kHz audio as `AsrItem`s through
`step`, and reads back `AsrEvent`s: partials while an utterance goes on, one final when it ends.
Items that only end an utterance (`AsrItem.only_ends`) are stepped apart with `urgent=True`, on a
lane of their own, so a turn's final never queues behind other streams' audio.

What differs between recognisers is data, not code the server branches on: what the recogniser
offers (`languages`, `finds_utterances`, `takes_prompt`, `describe`) and how its two lanes are laid
out (`lane_plan`: batch size, runners, which items a runner takes, the gauges it reads for the
metrics). A backend is built by name from `RecognizerSettings` through the registry
(engines/asr/registry.py); backends import this module, never each other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rtmedia.engines.base import EngineError

if TYPE_CHECKING:
    from rtmedia.engines.graphs import GraphStats

SAMPLE_RATE = 16000  # every recogniser's input: PCM16 mono at 16 kHz
ENGLISH = ("en",)  # the languages of an English-only recogniser (ISO 639-1)
_NORMAL = re.compile(r"[^\w']+")


@dataclass(frozen=True, slots=True)
class AsrStream:
    """Handle of one recognition stream; `worker` is the process holding its state.

    `segment`: the engine finds utterances itself (endpointer); else each `end=True` ends one.
    `fast_final`: a faster final for a little accuracy (decoders without the fwdflat pass).
    `partials`: whether its caller uses partial results (a recogniser that decodes them apart
    from its finals, Whisper, skips them when not).
    """

    id: int
    worker: int
    segment: bool = True
    fast_final: bool = False
    partials: bool = True


@dataclass(frozen=True, slots=True)
class AsrItem:
    """PCM16 mono 16 kHz audio for a stream; `end=True` flushes the open utterance; `eager`:
    a caller deciding on the words early wants partials more often (recognisers that
    decode partials on a cadence), and no context from the utterance before."""

    stream: AsrStream
    audio: bytes
    end: bool = False
    eager: bool = False

    @property
    def only_ends(self) -> bool:
        """Only ends the utterance (no audio): what the urgent pipe answers."""
        return self.end and not self.audio


@dataclass(slots=True)
class AsrEvent:
    """A partial or final transcript of one utterance; offsets are in the stream's audio."""

    utterance_index: int
    is_final: bool
    text: str
    delta: str
    start_ms: int
    end_ms: int
    words: list[tuple[str, int, int, float]] = field(default_factory=list)  # finals only
    # Finals of a recogniser that has them (Whisper): the text tokens as (id, UTF-8 bytes,
    # natural log-probability), and the model's probability that the audio held no speech.
    tokens: list[tuple[int, bytes, float]] = field(default_factory=list)
    no_speech_prob: float = 0.0
    # Partials: the latest decode's words of the utterance, agreed or not (what a caller that
    # must decide early reads; `text` holds only the agreed words).
    hypothesis: str = ""
    # Finals: the utterance's language (ISO 639-1), asked for or detected; "" when unknown.
    language: str = ""


def language_code(code: str, served: Sequence[str], field: str = "language") -> str:
    """The ISO 639-1 code of the served language `code` names: an ISO 639-1 code ("fr"), a BCP-47
    tag ("fr-FR", "en_US") or Whisper's name for it ("french"), in any case; "" (none asked)
    stays "". ValueError names what `served` holds (an English-only recogniser's ("en",), or a
    multilingual one's codes), and the request's `field`. The one rule every recogniser and door
    applies."""
    plain = code.strip().lower().replace("_", "-")
    base = plain.split("-")[0]
    if base not in served:  # a name ("french", "english") or a code not served
        base = _language_names().get(plain, base)
    if base and base not in served:
        what = "en (an English-only model)" if tuple(served) == ENGLISH else \
            f"{len(served)} languages ({', '.join(served[:8])}{', ...' if len(served) > 8 else ''})"
        quoted = repr(code) if len(code) <= 32 else f"{code[:32]!r}... ({len(code)} characters)"  # clients choose it
        raise ValueError(f"{field} {quoted} is not served by this recogniser; it serves {what}")
    return base


def _language_names() -> dict[str, str]:
    """Whisper's language names (and their aliases) -> codes: transformers' table, imported only
    when a name is asked for."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    return TO_LANGUAGE_CODE


def normal_words(text: str) -> list[str]:
    """Words lowercased without punctuation: what hypotheses are compared by."""
    return [w for w in _NORMAL.sub(" ", text.lower()).split() if w.strip("'")]


@dataclass(frozen=True, slots=True)
class LaneGauge:
    """A gauge the server reads from the recogniser when it is scraped: the metric's name in
    server/observe/metrics.py (`asr_streams`, `asr_decoders`, `asr_partial_cadence`), its label
    value (a worker's index; None for an unlabelled gauge) and the reading."""

    metric: str
    label: str | None
    read: Callable[[], float]


@dataclass(frozen=True, slots=True)
class LanePlan:
    """How the server lays out a recogniser's two lanes, `asr` (audio) and `asr_final` (items that
    only end an utterance, stepped with `urgent=True`).

    `runners` steps of the `asr` lane run at once, each taking the items whose `shard(item)` falls
    to it (None: any runner takes any item); the `asr_final` lane has `final_runners` and
    `final_shard`. `max_batch` bounds a step of either lane. `gauges`: what the metrics read."""

    max_batch: int
    runners: int
    shard: Callable[[AsrItem], int] | None
    final_runners: int = 1
    final_shard: Callable[[AsrItem], int] | None = None
    gauges: tuple[LaneGauge, ...] = ()


def by_stream(item: AsrItem) -> int:
    """Shard by stream: a stream's items stay in order on one runner."""
    return item.stream.id


def by_worker(item: AsrItem) -> int:
    """Shard by the worker process that holds the stream's state: no runner waits on another's."""
    return item.stream.worker


@dataclass(frozen=True, slots=True)
class RecognizerSettings:
    """What a recogniser is built from (the server's `asr_*` settings and its placement); each
    backend reads the fields that are its own and ignores the rest.

    `model`: a model directory ("" for the backend's default); `runtime`: a Whisper runtime name
    or "auto"; `threads`: cores one decode uses; `parallel`: decodes at once in this process;
    `workers`, `decoders`: worker processes and the decoders each builds at warm-up;
    `device`/`cuda`: where torch runs; `graph_runner(max_graphs)`: a CUDA-graph runner for a
    backend that captures graphs (None: eager); `reply_timeout_s`: a worker silent this long is
    restarted (None: the backend's default); `on_batch(kind, decodes)` and `on_restart(worker)`:
    told of each decode batch and each worker restart, for the metrics."""

    model: str = ""
    runtime: str = "auto"
    compute_type: str = ""
    threads: int = 1
    parallel: int = 2
    max_graphs: int = 48
    workers: int = 2
    decoders: int = 10
    device: str = "cpu"
    cuda: bool = False
    graph_runner: Callable[[int], Any] | None = None
    reply_timeout_s: float | None = None
    on_batch: Callable[[str, int], None] | None = None
    on_restart: Callable[[int], None] | None = None


@runtime_checkable
class Recognizer(Protocol):
    """A streaming speech recogniser, as the server drives it (server/lanes/access.py's `Asr`)."""

    name: str  # the engine protocol's name ("asr")

    @property
    def model(self) -> str:
        """The recogniser's name as the APIs show it: whisper-tiny, pocketsphinx, ..."""

    @property
    def languages(self) -> tuple[str, ...]:
        """The languages it transcribes (ISO 639-1): ENGLISH for an English-only one."""

    @property
    def finds_utterances(self) -> bool:
        """Whether it cuts a `segment=True` stream into utterances itself; else the VAD must."""

    @property
    def takes_prompt(self) -> bool:
        """Whether it uses a stream's prompt (the text said before its audio)."""

    @property
    def describe(self) -> dict[str, str]:
        """Its name, model path, runtime, compute type and languages, for the APIs and logs."""

    @property
    def workers(self) -> int:
        """The processes holding stream state (a stream is pinned to one)."""

    @property
    def open_streams(self) -> int:
        """Streams open now."""

    @property
    def lane_plan(self) -> LanePlan:
        """How the server lays out its lanes."""

    @property
    def graph_stats(self) -> GraphStats | None:
        """Its CUDA-graph runner's statistics (`rtmedia doctor`), None when it captures no graphs."""

    def load(self) -> None: ...

    def warmup(self) -> None: ...

    def close(self) -> None: ...

    def fault(self) -> str | None:
        """Why it cannot serve now and cannot recover by itself, or None (engines/base.py)."""

    def open_stream(self, segment: bool = True, fast_final: bool = False, partials: bool = True,
                    prompt: str = "", language: str = "") -> AsrStream:
        """A new stream; `language` is a code `language_code` accepts, "" to detect (or English)."""

    def close_stream(self, stream: AsrStream) -> None: ...

    def step(self, items: Sequence[AsrItem], urgent: bool = False) -> list[list[AsrEvent] | EngineError]:
        """Decode a batch: for each item, its events or the error that failed it alone."""


RecognizerFactory = Callable[[RecognizerSettings], Recognizer]
Shard = Callable[[AsrItem], Hashable]
