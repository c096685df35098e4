"""The PocketSphinx worker process: its decoders, endpointers and streams' state (engines/asr/pocketsphinx.py).

`_worker_main` runs in each process `AsrEngine` spawns: it loads the en-us model, then answers the
requests of two pipes (the step pipe and the urgent one, which it also answers between two pieces
of a step), each reply carrying the decoders it holds. engines/asr/pocketsphinx.py's docstring
describes the decoding: the modes, the decoder pools, partials and finals.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import random
import re
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rtmedia.engines.asr.contract import SAMPLE_RATE, AsrEvent
from rtmedia.engines.heap import trim_heap

PARTIAL_MS = 300
_PARTIAL_BYTES = SAMPLE_RATE * PARTIAL_MS // 1000 * 2
_ALTERNATE = re.compile(r"\(\d+\)$")
# pocketsphinx finds no hypothesis in fewer than ~7 frames (and logs an error when asked for one)
_MIN_FRAMES = 10
_CLOSED_REMEMBERED = 65536  # stream ids a worker remembers as closed (a few MB)

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
