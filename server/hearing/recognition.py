"""Turn recognition: the feed of turn audio to the recogniser and its results, per turn.

Both speech inputs that find turns with the VAD, the duplex sessions (server/session/session.py)
and Riva's recognitions (server/services/riva_asr.py), send each turn to one `segment=False`
recogniser stream and get its partials and finals back. `Recognizer` is that path, once:
it owns the ASR stream, the ordered queue of ("audio" | "cut" | "end" | "abort", turn, pcm)
entries, and the task that hands them to the ASR handle (server/lanes/access.py: an item
that only ends an utterance takes the lane that overtakes other streams' audio). The items of one
stream must arrive in order, so the task submits one at a time, coalescing the audio that
queued up while the lane was busy.

A turn may be cut into segments at its pauses ("cut": the recogniser finishes the audio so
far, so a server_vad turn's final is ready by speech_stopped); each segment's final is kept
and the turn's transcript joins them. Partials and the words a final adds become deltas
that concatenate into the text. What comes back is told to the user as typed events, one
way (`Heard`, `Delta`, `Transcribed`, `Fault`); each user keeps only how it reports them:
Converse events, or Riva results.

An engine fault (the ASR lane's step failed, ran past its deadline, or its worker process
was restarted) ends the feed for a user without `report_faults` (Riva: the call ends with a
status). With it (the sessions) it is told as a `Fault` and the feed goes on: the
recogniser stream is replaced by a fresh one, and the turn keeps what was recognised before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rtmedia.engines.asr.contract import SAMPLE_RATE, AsrEvent, AsrItem
from rtmedia.engines.base import EngineError
from rtmedia.server.lanes.scheduler import Priority
from rtmedia.v1 import common_pb2

if TYPE_CHECKING:
    from rtmedia.server.lanes.access import Asr

Kind = Literal["audio", "cut", "end", "abort"]


def _new_future() -> asyncio.Future[str]:
    return asyncio.get_running_loop().create_future()


@dataclass
class Turn:
    """A user turn: audio committed to the recogniser, and its transcript."""

    item_id: str = ""
    transcript: asyncio.Future[str] = field(default_factory=_new_future)
    stopped_at: float = 0.0  # perf_counter of speech_stopped / commit
    silence_ms: int = 0  # VAD turns: the silence waited before the turn ended
    audio_ms: int = 0
    partial: str = ""  # the transcription deltas sent so far, concatenated
    # Where the turn's audio starts in the user's input and in the recogniser's
    # stream (which joins every turn's audio): word timings are shifted by the difference.
    input_offset_ms: int | None = None
    asr_offset_ms: int = 0
    # The recogniser's finals of the turn's segments: one, unless the turn was cut at pauses;
    # and whether a segment has audio sent and no end yet.
    segments: list[AsrEvent] = field(default_factory=list)
    segment_open: bool = False
    cut_done: asyncio.Future[None] | None = None  # set when the latest "cut" has been recognised
    eager: bool = False  # voice over a reply being judged: its hypotheses come more often
    speech_end_at: float = 0.0  # perf_counter when its last voiced audio arrived (VAD turns)
    spoke_after_pause: bool = False  # speech resumed after its latest pause
    started_at: float = field(default_factory=time.perf_counter)  # speech_started (or its creation)
    end_reason: str = ""  # speech_stopped's reason (silence, semantic, max_wait); "": committed

    @property
    def said(self) -> str:
        """The text of the segments' finals so far."""
        return " ".join(event.text for event in self.segments if event.text)

    @property
    def sentence(self) -> str:
        """`said` read as one sentence: the recogniser closes each segment as if the speaker had
        finished ("What is the weather like in?"), so a segment that speech went on after loses
        its closing punctuation ("What is the weather like in Paris this weekend.")."""
        texts = [event.text.strip() for event in self.segments if event.text.strip()]
        return " ".join([*(text.rstrip(".?!,;:…") for text in texts[:-1]), *texts[-1:]])

    @property
    def shift_ms(self) -> int:
        """Recogniser stream time -> input time."""
        return (self.input_offset_ms or 0) - self.asr_offset_ms

    @property
    def words(self) -> list[tuple[str, int, int, float]]:
        """The segments' words as (word, start_ms, end_ms, confidence), in input time."""
        shift = self.shift_ms
        return [(w, s + shift, e + shift, c) for event in self.segments for w, s, e, c in event.words]

    @property
    def tokens(self) -> list[tuple[int, bytes, float]]:
        """The segments' text tokens with their log-probabilities (engines/asr/pocketsphinx.py's AsrEvent)."""
        return [token for event in self.segments for token in event.tokens]


MAX_PROMPT_CHARS = 1000  # a recognition's prompt: TranscribeConfig.prompt, Riva's speech contexts


def token_infos(tokens: list[tuple[int, bytes, float]]) -> list[common_pb2.TokenInfo]:
    """A recogniser's (id, bytes, log-probability) tokens as the protocol's TokenInfo."""
    return [common_pb2.TokenInfo(id=t, token=b.decode("utf-8", "replace"), logprob=p, bytes=b) for t, b, p in tokens]


@dataclass(frozen=True, slots=True)
class Heard:
    """An event of the recogniser for a turn not aborted (a partial hypothesis or a final)."""

    turn: Turn
    event: AsrEvent


@dataclass(frozen=True, slots=True)
class Delta:
    """The next piece of a turn's transcription text (deltas concatenate into it)."""

    turn: Turn
    text: str


@dataclass(frozen=True, slots=True)
class Transcribed:
    """A turn's "end" was recognised: `turn.said` is its transcript."""

    turn: Turn


@dataclass(frozen=True, slots=True)
class Fault:
    """An engine fault while transcribing a turn; the feed goes on with a fresh stream."""

    turn: Turn
    error: EngineError


Recognition = Heard | Delta | Transcribed | Fault


class Recognizer:
    """One recogniser stream fed turn by turn. `send()` queues an entry; the task from
    `start()` submits them in order and tells `notify` what it found, one way: `Heard` for each
    event of a turn not aborted, `Delta` for each delta of its transcription text,
    `Transcribed` when an "end" was recognised (then `turn.transcript` is set to `turn.said`),
    and, with `report_faults`, `Fault` for an engine fault (without, the fault ends the feed).
    `stop()` ends the task after what is queued.

    `fast_final`: the stream's finals come faster for a little accuracy (the sessions);
    `partials`: whether partial results are wanted (else the recogniser may skip them);
    `prompt`: text said before the stream's audio, the recogniser's context;
    `language`: what the turns are said in, a code the recogniser serves (checked by the caller:
    `Asr.language`), "" to detect each one's (English on an English-only recogniser); set it
    anew and the next segment goes to a fresh stream in that language (its results' offsets
    still count the audio of the streams before);
    `priority`: of the submissions on the ASR lanes."""

    def __init__(self, asr: Asr, *, fast_final: bool = False, partials: bool = True, prompt: str = "",
                 language: str = "", priority: Priority = Priority.REALTIME,
                 notify: Callable[[Recognition], None] = lambda _: None, report_faults: bool = False) -> None:
        self._asr = asr
        self.fast_final = fast_final
        self.partials = partials
        self.prompt = prompt
        self.language = language
        self.priority = priority
        self._notify = notify
        self._report_faults = report_faults
        self._queue: deque[tuple[str, Turn, bytes]] = deque()
        self._ready = asyncio.Event()
        self._stream: Any = None  # opened with the first submission
        self._stream_language = ""  # the language the stream was opened with
        self._sent = 0  # bytes of audio submitted, on every stream so far
        self._base_ms = 0  # where the stream's time starts in that audio
        self._task: asyncio.Task[None] | None = None

    def start(self, name: str) -> asyncio.Task[None]:
        """The task that feeds the recogniser; it ends on `stop()`, fails with the recogniser."""
        self._task = asyncio.create_task(self._feed(), name=name)
        return self._task

    def send(self, kind: Kind, turn: Turn, pcm: bytes = b"") -> None:
        """Queue ("audio", turn, pcm) (16 kHz PCM16), ("cut", turn) (a pause: end the segment),
        ("end", turn) (the turn's transcript follows) or ("abort", turn) (its transcript is dropped)."""
        self._queue.append((kind, turn, pcm))
        self._ready.set()

    def stop(self) -> None:
        """No more entries: the task ends once what is queued is done."""
        self._queue.append(("stop", Turn(), b""))
        self._ready.set()

    async def close(self) -> None:
        """Stop the task and free the recogniser's stream."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await self._asr.close(stream)

    async def _feed(self) -> None:
        """Sends turn audio to the recogniser in order, one utterance per segment of a turn."""
        queue = self._queue
        while True:
            while not queue:
                self._ready.clear()
                await self._ready.wait()
            kind, turn, pcm = queue.popleft()
            if kind == "stop":
                return
            while kind == "audio" and queue and queue[0][1] is turn:  # coalesce the turn's audio
                kind, _, more = queue.popleft()
                pcm += more
            if pcm or turn.segment_open:  # else nothing to send: a pause cut the segment already
                try:
                    if self._stream is not None and not turn.segment_open and self._stream_language != self.language:
                        stream, self._stream = self._stream, None  # a new language: a new stream
                        await self._asr.close(stream)
                    if self._stream is None:
                        self._stream = self._asr.open(segment=False, fast_final=self.fast_final,
                                                      partials=self.partials, prompt=self.prompt,
                                                      language=self.language)
                        self._stream_language, self._base_ms = self.language, self._sent * 1000 // (2 * SAMPLE_RATE)
                    item = AsrItem(self._stream, pcm, end=kind != "audio", eager=turn.eager)
                    turn.segment_open = kind == "audio"
                    self._sent += len(pcm)
                    events = await self._asr.recognize(item, self.priority)
                except EngineError as exc:
                    if not self._report_faults:
                        raise
                    await self._replace_stream(turn, exc)
                    events = []
                if kind == "abort":  # an aborted (cleared) turn's transcript is dropped
                    continue
                for event in events:
                    self._transcribed(turn, self._shifted(event))
            if kind == "cut" and turn.cut_done is not None and not turn.cut_done.done():
                turn.cut_done.set_result(None)
            if kind == "end":
                self._complete(turn)

    async def _replace_stream(self, turn: Turn, exc: EngineError) -> None:
        """An engine fault: report it, and give up the stream (whatever state it had is suspect);
        the next submission opens a fresh one."""
        self._notify(Fault(turn, exc))
        turn.segment_open = False
        stream, self._stream = self._stream, None
        if stream is not None:  # a close may wait on a stuck worker: it goes on without us after a moment
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._asr.close(stream), 1.0)

    def _shifted(self, event: AsrEvent) -> AsrEvent:
        """The event's offsets in the audio of every stream so far (a stream's own start at 0)."""
        if self._base_ms:
            base = self._base_ms
            event.start_ms, event.end_ms = event.start_ms + base, event.end_ms + base
            event.words = [(w, s + base, e + base, c) for w, s, e, c in event.words]
        return event

    def _transcribed(self, turn: Turn, event: AsrEvent) -> None:
        """A partial becomes a delta; a segment's final is kept for the turn's transcript, and
        the words it adds to the deltas sent so far go out as one more delta."""
        if event.is_final:
            turn.segments.append(event)
        self._notify(Heard(turn, event))
        if event.is_final:
            said = turn.said
            if not said.startswith(turn.partial) or said[len(turn.partial):][:1] not in ("", " "):
                return  # the final revised words already sent as deltas: the transcript decides
            added = said[len(turn.partial):].strip()
        else:
            added = event.delta
        if added:  # deltas concatenate into the text: words after the first get their space
            delta = f" {added}" if turn.partial else added
            turn.partial += delta
            self._notify(Delta(turn, delta))

    def _complete(self, turn: Turn) -> None:
        """The turn's transcript: its segments' finals joined."""
        self._notify(Transcribed(turn))
        if not turn.transcript.done():
            turn.transcript.set_result(turn.said)
