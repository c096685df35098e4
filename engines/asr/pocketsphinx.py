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

import contextlib
import functools
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rtmedia.engines.asr.contract import (
    ENGLISH,
    SAMPLE_RATE,
    AsrEvent,
    AsrItem,
    AsrStream,
    LaneGauge,
    LanePlan,
    by_worker,
    language_code,
)
from rtmedia.engines.asr.pocketsphinx_worker import PARTIAL_MS, _worker_main
from rtmedia.engines.base import EngineError, EngineUnavailable

__all__ = ["ENGLISH", "PARTIAL_MS", "SAMPLE_RATE", "AsrEngine", "AsrEvent", "AsrItem", "AsrStream", "language_code"]

log = logging.getLogger(__name__)

_REPLY_TIMEOUT_S = 60.0  # a worker silent this long is killed and restarted (AsrEngine(reply_timeout_s))
_WARMUP_TIMEOUT_S = 600.0  # the same for a warm-up, which builds every decoder of the pools



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
    def graph_stats(self) -> None:
        """No CUDA graphs: PocketSphinx decodes on the CPU."""
        return None

    @property
    def lane_plan(self) -> LanePlan:
        """One runner per worker on each lane, each stepping only its own streams' items (a
        stream's state lives in its worker); the `asr_final` lane's items each worker answers
        mid-step (its urgent pipe). Per worker, the streams and decoders it holds are gauges."""
        gauges = tuple(LaneGauge(metric, str(w), functools.partial(read, w)) for w in range(self._n)
                       for metric, read in (("asr_streams", self.streams_on), ("asr_decoders", self.decoders_on)))
        return LanePlan(max_batch=64, runners=self._n, shard=by_worker, final_runners=self._n,
                        final_shard=by_worker, gauges=gauges)

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
