"""Streaming speech recognition on PocketSphinx, in worker processes.

Process model: PocketSphinx holds the GIL while decoding, so nothing is decoded
in the server process. `load()` starts `workers` processes ("spawn": the parent
has threads, so no fork), each loading one `pocketsphinx.Decoder` (the en-us
model, LM and dictionary shipped in the wheel). A stream is pinned to the
least-loaded worker for its life, since its state lives there. `step()` sends
each worker its share of the batch before reading any reply, so workers decode
in parallel; one lock per worker pipe (taken in worker order) and request ids
make concurrent `step()` calls from several threads safe; a step whose items
are all on one worker waits for that worker only (the server's ASR lane steps
each worker's items on a runner of its own). The items of one stream must
still arrive in order.

Streams come in two modes (`open_stream(segment=...)`):

- `segment=True` (the default): each stream runs a `pocketsphinx.Endpointer`
  over 30 ms frames (it releases speech ~0.3 s late). Released speech is decoded
  as one utterance (`start_utt` / `process_raw` / `end_utt`) that ends when the
  endpointer leaves speech or an item has `end=True`.
- `segment=False`, for callers that find turns themselves (the duplex sessions'
  VAD): no endpointer. All audio of the stream is decoded, silences included;
  an utterance starts with the first audio after open or after an `end=True`
  and ends only on an item with `end=True`, which always yields exactly one
  final (with empty text when the turn held no words, or no audio at all).
  The stream holds a decoder from its turn's first audio to its end, silences
  included, so send only the audio of turns.

Decoders are leased per utterance: a silent stream holds only its endpointer and
cepstral mean, and a worker builds another decoder (a build takes a noticeable
fraction of a second and a decoder's memory is large; BENCHMARKS.md) only when
more of its streams speak at once; when streams close, the pool shrinks back to
its configured size (or to the streams still open). Before each utterance the lent decoder gets
the stream's cepstral mean and fresh noise statistics: pocketsphinx keeps its
noise-removal estimate across utterances (`start_utt` does not reset it), so
without the reset a hypothesis depended on whatever that decoder decoded last.

`fast_final=True` streams decode on decoders built with `_FAST_SEARCH`:
`fwdflat=False`, i.e. no second (flat-lexicon) pass over the whole utterance in
`end_utt` (a cost that grows with its length, so dropping it shortens the
`end=True` step several times over for slightly more word errors), and a
narrower first pass (at most 2000 active HMMs per frame, 2 of 4 Gaussians per
codebook, a narrower word-exit beam) that cuts their CPU per second of audio
substantially for slightly more word errors (the measurements are in
BENCHMARKS.md, "ASR fast-final decoder settings"). The lattice pass
(`bestpath`) stays: it is cheap, and gives the words' confidences. Partials
come from the first pass (the narrower one, in fast mode). The settings are
fixed when a decoder is built, so a worker keeps a pool per configuration; its
first fast decoder is built when a fast stream first speaks. Default-mode decoders (the SpeechService's
Transcribe) keep PocketSphinx's defaults.

Finals do not queue behind other streams' audio: each worker has a second,
urgent pipe (`step(items, urgent=True)`) for items that only end an utterance
(`AsrItem.only_ends`: `end=True`, no audio; the server gives them a lane of their own).
The worker answers those between two items or two 300 ms pieces of the step it
is decoding, so a turn's final costs its own work (`end_utt` and the lattice
pass) rather than the rest of a step that may carry seconds of other
streams' audio. A stream's
items must still arrive in order: send its end only after its last audio item
came back (an end that follows audio not yet sent travels with that audio, on
the step pipe).

Every 300 ms of decoded speech emits a partial with append-only text: a word is
committed once two consecutive hypotheses agree on it and it is not the newest
word, and is never retracted. The one final per utterance has the authoritative
text, offsets and word timings; its `delta` is empty.

A worker that dies (the kernel's OOM killer) or stops answering is restarted in
the background, and its streams fail clearly (see `AsrEngine`). Every reply of a
worker carries the number of decoders it holds, for the metrics.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import random
import re
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtmedia.engines.base import EngineError, EngineUnavailable
from rtmedia.engines.heap import trim_heap

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
PARTIAL_MS = 300
_PARTIAL_BYTES = SAMPLE_RATE * PARTIAL_MS // 1000 * 2
_REPLY_TIMEOUT_S = 60.0  # a worker silent this long is killed and restarted (AsrEngine(reply_timeout_s))
_WARMUP_TIMEOUT_S = 600.0  # the same for a warm-up, which builds every decoder of the pools
_ALTERNATE = re.compile(r"\(\d+\)$")
# pocketsphinx finds no hypothesis in fewer than ~7 frames (and logs an error when asked for one)
_MIN_FRAMES = 10
_CLOSED_REMEMBERED = 65536  # stream ids a worker remembers as closed (a few MB)
ENGLISH = ("en",)  # the languages of an English-only recogniser (ISO 639-1)

# Settings of the fast-final decoders, used by the duplex sessions (the default-mode decoders keep
# PocketSphinx's defaults: beam=pbeam=1e-48, wbeam=lponlybeam=7e-29, maxhmmpf=30000, topn=4).
# - fwdflat=False: no flat-lexicon second pass in end_utt (see the module docstring).
# - maxhmmpf=2000: at most 2000 active HMMs per frame (histogram pruning); the default beam often
#   keeps more, most of all in noise, so this bounds the per-frame cost where it is worst.
# - topn=2: Gaussian selection, 2 of each codebook's densities per frame instead of 4.
# - wbeam=lponlybeam=1e-24: a narrower beam on word exits (default 7e-29).
# Together these take markedly less CPU per second of audio than fwdflat=False alone, for a small
# rise in word errors, most of it in noisy speech. Not taken: ds=2 or topn=1 on top, and
# maxhmmpf=1500 (little CPU saved for more word errors, nearly all in noise); a narrower
# beam=pbeam (word errors jump at a slightly narrower setting, clean speech included: too near a
# cliff); pl_window=0 (a few word errors fewer for clearly more CPU); maxwpf=10 (no clear gain).
# Measurements: BENCHMARKS.md, "ASR fast-final decoder settings". Explicit feature settings
# (remove_noise, cmn, ...) have no effect: the model's feat.params overrides them.
_FAST_SEARCH: dict[str, Any] = {
    "fwdflat": False,
    "maxhmmpf": 2000,
    "topn": 2,
    "wbeam": 1e-24,
    "lponlybeam": 1e-24,
}


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


def _words(hyp: Any) -> list[str]:
    """Hypothesis words without fillers/silences ('<s>', '<sil>', '[NOISE]'), 'word(2)' -> 'word'."""
    return [_ALTERNATE.sub("", w) for w in (hyp.hypstr.split() if hyp else []) if w[0] not in "<[+"]


# ----------------------------------------------------------------------------- worker process


@dataclass(slots=True)
class _Utterance:
    decoder: Any
    index: int
    start_ms: int
    fed_bytes: int = 0
    committed: list[str] = field(default_factory=list)
    previous: list[str] = field(default_factory=list)

    @property
    def end_ms(self) -> int:
        return self.start_ms + self.fed_bytes * 500 // SAMPLE_RATE


@dataclass(slots=True)
class _StreamState:
    ep: Any  # the endpointer; None for a stream without segmentation
    cmn: str  # cepstral mean carried between this stream's utterances
    fast: bool  # decode on the fast-final decoders
    base_samples: int = 0  # stream offset of the endpointer's time zero
    samples: int = 0  # samples received so far
    pending: bytearray = field(default_factory=bytearray)  # less than one endpointer frame
    next_index: int = 0
    utt: _Utterance | None = None


class _Worker:
    def __init__(self, urgent: Any = None) -> None:
        import pocketsphinx

        self._urgent = urgent  # the pipe of finals answered between two pieces of a step
        self._answering_urgent = False

        pocketsphinx.set_loglevel("ERROR")
        self._ps = pocketsphinx
        first = self._new_decoder(fast=False)
        self._free: dict[bool, list[Any]] = {False: [first], True: []}  # idle decoders by `fast`
        self._keep = {False: 1, True: 0}  # the configured pool sizes (set by warmup)
        self._prior_cmn = first.get_cmn()
        self._ms_per_frame = 1000.0 / float(first.config["frate"])
        self._streams: dict[int, _StreamState] = {}
        self._closed: set[int] = set()  # recently closed stream ids (see _remember_closed)
        self._closed_order: deque[int] = deque()
        self._stepping = False  # inside a step (closes are freed when it ends)
        self._unfreed: list[int] = []  # closed streams whose state is still to be freed
        self._current = 0  # the stream whose item is being decoded

    def _new_decoder(self, fast: bool) -> Any:
        # the search settings are read when the decoder is built (changing them needs a reinit,
        # as slow as a build): one pool each
        extra = _FAST_SEARCH if fast else {}
        return self._ps.Decoder(samprate=SAMPLE_RATE, loglevel="ERROR", **extra)

    def _new_endpointer(self) -> Any:
        return self._ps.Endpointer(sample_rate=SAMPLE_RATE)

    def handle(self, op: str, arg: Any) -> Any:
        if op == "step":
            outer, self._stepping = not self._stepping, True  # an urgent step may run inside a step
            current = self._current
            try:
                events = []
                for item in arg:
                    self.answer_urgent()
                    events.append(self._step(*item))
                return events
            finally:
                self._current = current
                if outer:
                    self._stepping = False
                    self._free_closed()
        if op == "close":  # a batch of stream ids
            for sid in arg:
                self._remember_closed(sid)
            self._unfreed.extend(arg)
            if not self._stepping:  # else the step frees them when it ends (one may be decoding)
                self._free_closed()
        elif op == "warmup":
            # Build the pools up front: building a decoder on demand inside a step would stall
            # every stream of this worker.
            for fast, count in zip((False, True), arg, strict=True):
                self._keep[fast] = count
                while len(self._free[fast]) < count:
                    self._free[fast].append(self._new_decoder(fast))
            rng = random.Random(0)
            noise = array.array("h", (rng.randint(-300, 300) for _ in range(SAMPLE_RATE))).tobytes()
            for decoder in itertools.chain.from_iterable(self._free.values()):
                decoder.start_utt()
                decoder.process_raw(noise)
                decoder.end_utt()
                decoder.set_cmn(self._prior_cmn)
        elif op != "ping":
            raise ValueError(f"unknown ASR worker op {op!r}")
        return None

    def decoders(self, fast: bool) -> int:
        """Decoders of one configuration this worker holds, idle or lent to an utterance."""
        lent = sum(1 for st in self._streams.values() if st.fast == fast and st.utt is not None)
        return len(self._free[fast]) + lent

    def held(self) -> int:
        """Decoders this worker holds in all, idle or lent (sent back with every reply)."""
        lent = sum(1 for st in self._streams.values() if st.utt is not None)
        return len(self._free[False]) + len(self._free[True]) + lent

    def _shrink(self, fast: bool) -> None:
        """Free idle decoders beyond what this worker needs: its configured pool size, or more
        while more of its streams are open (each may speak at once). A decoder's memory is
        large, so glibc is asked to hand the freed memory back to the system."""
        need = max(self._keep[fast], sum(1 for st in self._streams.values() if st.fast == fast))
        pool, freed = self._free[fast], False
        while pool and self.decoders(fast) > need:
            pool.pop()
            freed = True
        if freed:
            trim_heap()

    def answer_urgent(self) -> None:
        """Answer the requests waiting on the urgent pipe, now (called between two pieces of work)."""
        if self._urgent is None or self._answering_urgent:
            return
        self._answering_urgent = True
        try:
            while self._urgent.poll() and _answer(self, self._urgent):
                pass
        finally:
            self._answering_urgent = False

    def _remember_closed(self, sid: int) -> None:
        """The rest of a step skips a closed stream's items, and a step checked before its stream
        closed may arrive after the close: its items must not open the stream again (its state
        would never be freed)."""
        self._closed.add(sid)
        self._closed_order.append(sid)
        if len(self._closed_order) > _CLOSED_REMEMBERED:
            self._closed.discard(self._closed_order.popleft())

    def _free_closed(self) -> None:
        """Free the state and decoders of the streams closed so far."""
        closed = [st for sid in self._unfreed if (st := self._streams.pop(sid, None)) is not None]
        self._unfreed.clear()
        for st in closed:
            if st.utt is not None:
                st.utt.decoder.end_utt()
                self._free[st.fast].append(st.utt.decoder)
                st.utt = None  # the pool holds the only reference: _shrink may free it
        for fast in {st.fast for st in closed}:
            self._shrink(fast)

    def _step(self, sid: int, audio: bytes, end: bool, segment: bool, fast: bool) -> list[AsrEvent]:
        if sid in self._closed:
            return []
        self._current = sid
        st = self._streams.get(sid)
        if st is None:
            ep = self._new_endpointer() if segment else None
            st = self._streams[sid] = _StreamState(ep, self._prior_cmn, fast)
        events: list[AsrEvent] = []
        if st.ep is None:
            self._turn(st, audio, end, events)
            return events
        st.pending += audio
        st.samples += len(audio) // 2
        size, done = st.ep.frame_bytes, 0
        while len(st.pending) - done >= size and sid not in self._closed:
            self._speech(st, st.ep.process(bytes(st.pending[done : done + size])), events)
            done += size
        del st.pending[:done]
        if end and sid not in self._closed:
            if st.ep.in_speech:
                # end_stream(b"") raises IndexError: give it one silent sample instead.
                self._speech(st, st.ep.end_stream(bytes(st.pending) or b"\0\0"), events)
            if st.utt is not None:
                self._finish(st, events)
            # end_stream finishes an endpointer: continue with a fresh one from here.
            st.pending.clear()
            st.ep, st.base_samples = self._new_endpointer(), st.samples
        return events

    def _turn(self, st: _StreamState, audio: bytes, end: bool, events: list[AsrEvent]) -> None:
        """A stream without segmentation: all its audio is the current utterance, `end` ends it."""
        if audio:
            utt = st.utt or self._begin(st, st.samples * 1000 // SAMPLE_RATE)
            self._feed(utt, audio, not end, events)
            st.samples += len(audio) // 2
        if not end:
            return
        if st.utt is not None:
            self._finish(st, events)
        else:  # a turn without audio still gets its one (empty) final
            at = st.samples * 1000 // SAMPLE_RATE
            events.append(AsrEvent(st.next_index, True, "", "", at, at, language="en"))
            st.next_index += 1

    def _speech(self, st: _StreamState, speech: bytes | None, events: list[AsrEvent]) -> None:
        """Decode speech the endpointer released; emit partials and, when speech ends, the final."""
        if speech is None:
            return
        utt = st.utt
        if utt is None:
            utt = self._begin(st, st.base_samples * 1000 // SAMPLE_RATE + round(st.ep.speech_start * 1000))
        self._feed(utt, speech, st.ep.in_speech, events)
        if not st.ep.in_speech:
            self._finish(st, events)

    def _begin(self, st: _StreamState, start_ms: int) -> _Utterance:
        """Lend the stream a decoder, reset to the stream's cepstral mean and fresh noise statistics."""
        pool = self._free[st.fast]
        decoder = pool.pop() if pool else self._new_decoder(st.fast)
        decoder.set_cmn(st.cmn)
        with warnings.catch_warnings():  # deprecated as "unnecessary", but the only reset of the noise stats
            warnings.simplefilter("ignore", DeprecationWarning)
            decoder.start_stream()
        decoder.start_utt()
        utt = st.utt = _Utterance(decoder, st.next_index, start_ms)
        st.next_index += 1
        return utt

    def _feed(self, utt: _Utterance, audio: bytes, more: bool, events: list[AsrEvent]) -> None:
        """Decode `audio`, with a partial at each 300 ms boundary (at its very end only if `more` follows)."""
        view = memoryview(audio)
        while view:  # split at partial boundaries (end_stream may release several frames at once)
            room = _PARTIAL_BYTES - utt.fed_bytes % _PARTIAL_BYTES
            piece, view = view[:room], view[room:]
            self.answer_urgent()
            if self._current in self._closed:  # closed meanwhile: the step frees it when it ends
                return
            utt.decoder.process_raw(bytes(piece))
            utt.fed_bytes += len(piece)
            if utt.fed_bytes % _PARTIAL_BYTES == 0 and (view or more):  # else the final follows
                events.append(self._partial(utt))

    def _partial(self, utt: _Utterance) -> AsrEvent:
        words = _words(utt.decoder.hyp())
        stable, limit = 0, min(len(words) - 1, len(utt.previous))
        while stable < limit and words[stable] == utt.previous[stable]:
            stable += 1
        utt.previous = words
        new = words[len(utt.committed) : stable]
        utt.committed.extend(new)
        return AsrEvent(utt.index, False, " ".join(utt.committed), " ".join(new), utt.start_ms, utt.end_ms,
                        hypothesis=" ".join(words))

    def _finish(self, st: _StreamState, events: list[AsrEvent]) -> None:
        utt, st.utt = st.utt, None
        assert utt is not None
        decoder = utt.decoder
        decoder.end_utt()
        # A short turn without segmentation has no hypothesis (hyp() and seg() give None then).
        hyp = decoder.hyp() if decoder.n_frames() >= _MIN_FRAMES else None
        words = []
        for seg in (decoder.seg() or ()) if hyp is not None else ():
            if seg.word[0] not in "<[+":
                start = utt.start_ms + round(seg.start_frame * self._ms_per_frame)
                end = utt.start_ms + round((seg.end_frame + 1) * self._ms_per_frame)  # end_frame is inclusive
                prob = min(1.0, max(0.0, float(seg.prob)))  # log-math rounding can give 1.0001
                words.append((_ALTERNATE.sub("", seg.word), start, end, prob))
        text = " ".join(_words(hyp))
        st.cmn = decoder.get_cmn()
        self._free[st.fast].append(decoder)
        events.append(AsrEvent(utt.index, True, text, "", utt.start_ms, utt.end_ms, words, language="en"))


def _answer(worker: _Worker, conn: Any) -> bool:
    """Read one request from `conn` and send its reply, (request id, ok, value or error text,
    decoders held); False when the worker is to stop."""
    try:
        rid, op, arg = conn.recv()
    except (EOFError, OSError):
        return False  # the parent went away
    if op == "stop":
        return False
    try:
        reply = (rid, True, worker.handle(op, arg), worker.held())
    except Exception as exc:
        reply = (rid, False, f"{type(exc).__name__}: {exc}", worker.held())
    try:
        conn.send(reply)
    except OSError:  # the parent went away
        return False
    return True


def _worker_main(conn: Any, urgent: Any) -> None:
    try:
        worker = _Worker(urgent)
    except Exception as exc:
        conn.send((0, False, f"ASR worker failed to load: {type(exc).__name__}: {exc}", 0))
        return
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the workers too: the parent closes them
        while True:
            for ready in multiprocessing.connection.wait([conn, urgent]):
                # a step answers the urgent requests that came while it ran: check again before reading
                if ready.poll() and not _answer(worker, ready):
                    return


# ----------------------------------------------------------------------------- parent process

# A worker's state in the parent: answering, being restarted, or not restartable for now.
_UP, _RESTARTING, _FAILED = "up", "restarting", "failed"
_RESTART_ATTEMPTS = 3  # tries of one restart before the worker counts as failed
_RESTART_PAUSE_S = 1.0  # between two tries


def _request(item: AsrItem) -> tuple[int, bytes, bool, bool, bool]:
    """What a worker's `_step` takes for one item (the stream's mode travels with each item)."""
    s = item.stream
    return (s.id, bytes(item.audio), bool(item.end), s.segment, s.fast_final)


def _reap(proc: Any, ask: bool = True) -> None:
    """Make sure a worker process is gone: asked to stop (if `ask`), then terminated, then killed."""
    for stop in ((lambda: None) if ask else proc.kill, proc.terminate, proc.kill):
        if proc.is_alive():
            stop()
            proc.join(timeout=5.0)


class AsrEngine:
    """Streaming PocketSphinx ASR behind the engine protocol (see the module docstring).

    Worker faults: a worker process that dies (the kernel's OOM killer sends SIGKILL) or sends
    no reply within `reply_timeout_s` (it is killed then) is restarted in the background, a
    fresh process loaded and warmed like the first. Its streams' state died with it: their
    items fail with EngineUnavailable saying so (the stream must be opened again), and so do
    the calls that reach the worker while it restarts; new streams go to the workers that are
    up. A worker that cannot be restarted (`_RESTART_ATTEMPTS` tries) is `fault()`; it is
    tried again each `restart_backoff_s`. `on_restart(worker)` is called after each restart."""

    name = "asr"
    model = "pocketsphinx"
    languages = ENGLISH  # the en-us acoustic model, dictionary and LM
    finds_utterances = True  # segment=True streams: PocketSphinx's endpointer cuts the utterances
    takes_prompt = False  # open_stream's prompt is ignored

    def __init__(self, workers: int = 2, decoders: int = 10, reply_timeout_s: float = _REPLY_TIMEOUT_S,
                 on_restart: Callable[[int], None] | None = None) -> None:
        """`decoders`: fast-final decoders each worker builds at warm-up, i.e. the turns
        it can decode at once without building one on demand (each build stalls the worker)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._n = workers
        self._decoders = decoders
        self.reply_timeout_s = reply_timeout_s
        self.restart_backoff_s = 30.0
        self._on_restart = on_restart
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._urgent_conns: list[Any] = []
        self._locks = [threading.Lock() for _ in range(workers)]
        self._urgent_locks = [threading.Lock() for _ in range(workers)]
        self._load = [0] * workers
        self._open: dict[int, AsrStream] = {}
        self._ids = itertools.count(1)
        self._mu = threading.Lock()
        self._state = [_UP] * workers
        self._lost: set[int] = set()  # open streams whose worker died (their state with it)
        self._held = [0] * workers  # decoders each worker holds, as of its last reply
        self._faults: dict[int, tuple[str, float]] = {}  # worker -> (why it could not restart, when it last tried)
        self.restarts = [0] * workers
        self._closed = False

    def _spawn(self, i: int) -> tuple[Any, Any, Any]:
        """Start worker process i ("spawn": the parent has threads, so no fork): (process, step
        pipe, urgent pipe); it answers once it has loaded its decoder."""
        ctx = multiprocessing.get_context("spawn")
        (parent, child), (urgent, urgent_child) = ctx.Pipe(), ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, urgent_child), name=f"rtmedia-asr-{i}", daemon=True)
        proc.start()
        child.close()
        urgent_child.close()
        return proc, parent, urgent

    def load(self) -> None:
        with self._mu:
            if self._procs:
                return
            self._closed = False
            for i in range(self._n):
                proc, parent, urgent = self._spawn(i)
                self._procs.append(proc)
                self._conns.append(parent)
                self._urgent_conns.append(urgent)
            self._state = [_UP] * self._n
        try:
            self._call(dict.fromkeys(range(self._n), ("ping", None)))
        except Exception:
            self.close()
            raise

    def warmup(self) -> None:
        self.load()
        self._call(dict.fromkeys(range(self._n), ("warmup", (1, self._decoders))), timeout=_WARMUP_TIMEOUT_S)

    @property
    def describe(self) -> dict[str, str]:
        """The recogniser: its name, runtime and languages (as WhisperEngine.describe gives them)."""
        return {"model": self.model, "path": "", "runtime": "pocketsphinx", "compute_type": "", "languages": "en"}

    def open_stream(self, segment: bool = True, fast_final: bool = False, partials: bool = True,
                    prompt: str = "", language: str = "") -> AsrStream:
        """A new stream. `segment=False`: no endpointer, each `end=True` ends one utterance (a turn)
        and yields its final; `fast_final=True`: the final comes faster for slightly lower accuracy;
        `partials` and `prompt` (Whisper's) change nothing here; `language`: English or "" (any
        other is a ValueError naming what is served: `language_code`). It goes to the least-loaded
        worker that is up (EngineUnavailable when none is)."""
        language_code(language, self.languages)
        with self._mu:
            if not self._procs:
                raise EngineError("ASR engine is not loaded")
            up = [w for w in range(self._n) if self._state[w] == _UP]
            if not up:
                raise EngineUnavailable(f"no ASR worker is up ({', '.join(self._state)}); retry shortly")
            worker = min(up, key=self._load.__getitem__)
            self._load[worker] += 1
            stream = AsrStream(next(self._ids), worker, bool(segment), bool(fast_final), bool(partials))
            self._open[stream.id] = stream
            return stream

    @property
    def workers(self) -> int:
        """The recogniser worker processes (a stream is pinned to one)."""
        return self._n

    @property
    def open_streams(self) -> int:
        with self._mu:
            return len(self._open)

    def streams_on(self, worker: int) -> int:
        """Streams open on a worker (for the metrics)."""
        return self._load[worker]

    def decoders_on(self, worker: int) -> int:
        """Decoders a worker holds, as of its last reply (for the metrics)."""
        return self._held[worker]

    def close_stream(self, stream: AsrStream) -> None:
        with self._mu:
            if self._open.pop(stream.id, None) is None:
                return
            self._load[stream.worker] -= 1
            if stream.id in self._lost:  # its worker died with its state: nothing to free
                self._lost.discard(stream.id)
                return
        # On the urgent pipe: the worker answers between two pieces of a step it is decoding, so a
        # close never waits for seconds of other streams' audio, and the rest of that step skips
        # the closed stream's audio.
        with contextlib.suppress(EngineError):  # a worker that died meanwhile restarts without it
            self._call({stream.worker: ("close", [stream.id])}, urgent=True)

    def step(self, items: Sequence[AsrItem], urgent: bool = False) -> list[list[AsrEvent] | EngineError]:
        """Decode a batch. `urgent`: items that only end an utterance (`end=True`, no audio),
        answered by each worker between two pieces of the step it is decoding. An item of a
        stream closed meanwhile (its session ended while the item waited) fails alone: its
        result is an EngineError; so do the items of a worker that died (EngineUnavailable)."""
        groups: dict[int, list[int]] = {}
        results: list[Any] = [[] for _ in items]
        for i, item in enumerate(items):
            if urgent and not item.only_ends:
                raise ValueError("an urgent ASR item only ends an utterance: end=True and no audio")
            if len(item.audio) % 2:
                raise ValueError(
                    f"ASR audio must be whole PCM16 samples, got an odd byte count: {len(item.audio)}"
                )
            if self._open.get(item.stream.id) is not item.stream:
                results[i] = EngineError(f"ASR stream {item.stream.id} is not open on this engine")
                continue
            if item.stream.id in self._lost:
                results[i] = EngineUnavailable(
                    f"ASR stream {item.stream.id} lost its state: its worker process ({item.stream.worker}) "
                    "stopped and is restarted; open a new stream")
                continue
            groups.setdefault(item.stream.worker, []).append(i)
        batches = {w: ("step", [_request(items[i]) for i in idx]) for w, idx in groups.items()}
        replies = self._call_each(batches, urgent)
        for reply in replies.values():
            if isinstance(reply, EngineError) and not isinstance(reply, EngineUnavailable):
                raise reply  # the worker's own error: the lane finds out which item it was
        for w, reply in replies.items():
            if isinstance(reply, EngineError):
                for i in groups[w]:
                    results[i] = reply
                continue
            for i, ev in zip(groups[w], reply, strict=True):
                results[i] = ev
        return results

    def _call(self, requests: dict[int, tuple[str, Any]], urgent: bool = False,
              timeout: float | None = None) -> dict[int, Any]:
        """`_call_each`, raising the first error."""
        replies = self._call_each(requests, urgent, timeout)
        for reply in replies.values():
            if isinstance(reply, EngineError):
                raise reply
        return replies

    def _call_each(self, requests: dict[int, tuple[str, Any]], urgent: bool = False,
                   timeout: float | None = None) -> dict[int, Any]:
        """Send each worker its request (on its urgent pipe if `urgent`), then read the replies:
        each worker's reply, or the EngineError it failed with. A worker found dead, or silent
        for `timeout` (default `reply_timeout_s`), is restarted (EngineUnavailable). A reply left
        unread after an error is skipped by the next call on that pipe (its request id is stale)."""
        order = sorted(requests)
        locks = self._urgent_locks if urgent else self._locks
        for w in order:
            locks[w].acquire()
        try:
            conns = self._urgent_conns if urgent else self._conns
            if not conns:
                raise EngineError("ASR engine is not loaded")
            out: dict[int, Any] = {}
            rids: dict[int, int] = {}
            for w in order:
                if self._state[w] != _UP:
                    out[w] = self._unavailable(w)
                    continue
                rids[w] = next(self._ids)
                try:
                    conns[w].send((rids[w], *requests[w]))
                except OSError as exc:
                    out[w] = self._died(w, exc)
            for w, rid in rids.items():
                if w in out:
                    continue
                try:
                    out[w] = self._reply(w, conns[w], rid, timeout)
                except EngineError as exc:
                    out[w] = exc
                except (EOFError, OSError) as exc:  # a dead worker; TimeoutError is an OSError too
                    out[w] = self._died(w, exc, timeout)
            return out
        finally:
            for w in order:
                locks[w].release()

    def _reply(self, w: int, conn: Any, rid: int, timeout: float | None = None) -> Any:
        timeout = self.reply_timeout_s if timeout is None else timeout
        while True:
            if not conn.poll(timeout):
                raise TimeoutError(f"sent no reply within {timeout:g} s")
            got, ok, value, held = conn.recv()
            self._held[w] = held
            if got == rid or (got == 0 and not ok):  # request id 0: the worker failed to load
                if not ok:
                    raise EngineError(f"ASR worker {w}: {value}")
                return value

    # -- worker faults ----------------------------------------------------------------------

    def _unavailable(self, w: int, why: str = "") -> EngineUnavailable:
        if self._state[w] == _FAILED and w in self._faults:
            return EngineUnavailable(f"{self._faults[w][0]}; retry shortly")
        return EngineUnavailable(f"ASR worker {w} {why or 'stopped'} and is being restarted; the streams it "
                                 "held lost their state; retry shortly")

    def _died(self, w: int, exc: BaseException, timeout: float | None = None) -> EngineUnavailable:
        """Worker w died or stopped answering (found by a call holding one of its locks): its
        streams lose their state and it is restarted in the background. The error for the call."""
        with self._mu:
            first = self._state[w] == _UP and bool(self._procs) and not self._closed
            proc = self._procs[w] if first else None
            if first:
                self._state[w] = _RESTARTING
                self._lost.update(sid for sid, st in self._open.items() if st.worker == w)
        if isinstance(exc, TimeoutError):
            why = f"sent no reply within {self.reply_timeout_s if timeout is None else timeout:g} s"
        elif proc is not None and not proc.is_alive():
            why = f"stopped (exit code {proc.exitcode})"
        else:
            why = f"stopped ({type(exc).__name__})"
        if first:
            log.error("ASR worker %d %s; restarting it (its streams lost their state)", w, why)
            threading.Thread(target=self._restart, args=(w, proc), name=f"asr-restart-{w}", daemon=True).start()
        return self._unavailable(w, why)

    def _restart(self, w: int, old: Any) -> None:
        """Replace worker w by a fresh process (in a thread of its own); on failure mark it failed."""
        if old is not None:
            _reap(old, ask=False)  # a hung one is killed; a dead one is reaped
        error: BaseException | None = None
        for attempt in range(_RESTART_ATTEMPTS):
            if attempt:
                time.sleep(_RESTART_PAUSE_S)
            if self._closed:
                return
            try:
                proc, conn, urgent = self._spawn(w)
            except Exception as exc:
                error = exc
                continue
            try:
                for op, arg in (("ping", None), ("warmup", (1, self._decoders))):
                    rid = next(self._ids)
                    conn.send((rid, op, arg))
                    self._reply(w, conn, rid, _WARMUP_TIMEOUT_S)
            except Exception as exc:
                error = exc
                _reap(proc, ask=False)
                conn.close()
                urgent.close()
                continue
            with self._locks[w], self._urgent_locks[w], self._mu:
                swapped = not self._closed and bool(self._procs)
                if swapped:
                    old_conns = self._conns[w], self._urgent_conns[w]
                    self._procs[w], self._conns[w], self._urgent_conns[w] = proc, conn, urgent
                    self._state[w] = _UP
                    self._faults.pop(w, None)
                    self.restarts[w] += 1
            if not swapped:  # the engine closed meanwhile
                _reap(proc, ask=False)
                conn.close()
                urgent.close()
                return
            for old_conn in old_conns:
                old_conn.close()
            log.warning("ASR worker %d restarted", w)
            if self._on_restart is not None:
                self._on_restart(w)
            return
        why = f"ASR worker {w} could not be restarted: {type(error).__name__}: {error}"
        with self._mu:
            self._state[w] = _FAILED
            self._faults[w] = (why, time.monotonic())
        log.error("%s; trying again in %g s", why, self.restart_backoff_s)

    def fault(self) -> str | None:
        """Why a worker cannot serve (it could not be restarted), or None. A failed worker gets
        another restart once `restart_backoff_s` has passed since its last try."""
        with self._mu:
            if not self._faults:
                return None
            now = time.monotonic()
            due = [w for w, (_, at) in self._faults.items()
                   if self._state[w] == _FAILED and now - at >= self.restart_backoff_s and not self._closed]
            for w in due:
                self._state[w] = _RESTARTING
            why = "; ".join(text for text, _ in self._faults.values())
        for w in due:
            threading.Thread(target=self._restart, args=(w, None), name=f"asr-restart-{w}", daemon=True).start()
        return why

    def close(self) -> None:
        with self._mu:
            self._closed = True
            procs, conns, self._procs, self._conns = self._procs, self._conns, [], []
            urgent_conns, self._urgent_conns = self._urgent_conns, []
            self._open.clear()
            self._lost.clear()
            self._load = [0] * self._n
        for w, conn in enumerate(conns):
            locked = self._locks[w].acquire(timeout=5.0)  # let an in-flight step finish
            with contextlib.suppress(OSError):
                conn.send((0, "stop", None))
            if locked:
                self._locks[w].release()
        for proc, conn in zip(procs, conns, strict=True):
            _reap(proc)
            conn.close()
        for conn in urgent_conns:
            conn.close()
