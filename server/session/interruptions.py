"""Interruptions that are meant (docs/protocol.md#interruptions): is voice during a reply a
barge-in, or a backchannel ("mhm", "yeah okay sure") the reply should talk over?

`immediate` (the default) is the VAD's word: any speech during a reply cancels it.
`confirmed` pauses the reply's audio when the voice starts and judges the voice as it is
recognised (`Voice.verdict`):
- it interrupts once it holds `min_words` words that are not all backchannels, or once it has
  lasted `min_speech_ms` without words that are all backchannels (nothing recognised yet, or
  real words). While it goes on, the words of a partial hypothesis count once the next
  hypothesis agrees on them (the first, a quarter second into a word, often mishears it:
  "Sure" as "Cheers", "Got it" as "that is"), or at once when they hold a word that interrupts
  on its own (`INTERRUPTING`: "stop", "wait", "no", ...); words that may be a backchannel's
  beginning ("i" of "i see") are not yet counted;
- at its first pause (the recogniser's early final) or its end, a voice whose words are all
  backchannels, or that holds no words (a cough, a door), is not an interruption: the reply
  resumes. Later words of the same turn may still make it one.

`Interruptions` is the machine of one session: the voice being judged and what was held
back meanwhile; `Voice.verdict` decides, the session tells it what the VAD and the recogniser
found, and it answers through a narrow view of its session (`InterruptionHost`).

`is_backchannel` reads the words as the recogniser normalises them (lowercase, no
punctuation: Whisper's "Mm-hmm." is "mm hmm"), so a phrase of the list matches however it
was written, and a run of them ("yeah okay sure") is one backchannel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rtmedia.engines.asr.contract import normal_words

if TYPE_CHECKING:
    from rtmedia.server.hearing.recognition import Heard, Turn
    from rtmedia.server.lanes.clock import Clock
    from rtmedia.server.observe.metrics import Metrics
    from rtmedia.server.session.reply import ReplyPipeline
    from rtmedia.server.session.tool_calls import ToolCalls

log = logging.getLogger(__name__)

MODES = ("immediate", "confirmed")
BACKCHANNELS = (
    "mhm", "mm", "mmm", "mm hmm", "m hmm", "hmm", "uh huh", "aha", "ah ha", "uh", "um", "ah", "oh", "ooh", "yeah", "yes", "yep",
    "yup", "okay", "ok", "right", "sure", "i see", "got it", "alright", "all right", "cool", "nice", "great",
    "exactly", "true", "wow", "really", "indeed", "of course", "sounds good", "makes sense", "make sense",
)
# Words that are an interruption whatever follows: a hypothesis holding one counts at once.
INTERRUPTING = frozenset({"stop", "wait", "hold", "hang", "pause", "cancel", "no", "sorry", "excuse", "actually",
                          "but"})
MAX_BACKCHANNELS = 100  # phrases a session may list
MAX_BACKCHANNEL_CHARS = 64
BOUNDS = {"min_words": (1, 20), "min_speech_ms": (200, 10000), "false_interruption_timeout_ms": (100, 10000)}

Verdict = Literal["interrupt", "backchannel"] | None


@dataclass(frozen=True)
class Interruption:
    """A session's `turn_detection.interruption` settings."""

    mode: str = "immediate"
    min_words: int = 1
    min_speech_ms: int = 1500
    false_interruption_timeout_ms: int = 1000  # after the voice stops unconfirmed, the reply resumes by then
    backchannels: tuple[str, ...] = BACKCHANNELS

    @property
    def phrases(self) -> frozenset[tuple[str, ...]]:
        return frozenset(tuple(normal_words(p)) for p in self.backchannels if normal_words(p))


def is_backchannel(words: list[str], phrases: frozenset[tuple[str, ...]], open_end: bool = False) -> bool:
    """Whether `words` (normal words, at least one) are one or more phrases of `phrases` in a row;
    `open_end`: or such a run followed by the beginning of a phrase (words still being said:
    "i" may become "i see", "sur" "sure")."""
    if not words:
        return False
    longest = max((len(p) for p in phrases), default=0)
    reach = [True] + [False] * len(words)  # reach[i]: the first i words are whole phrases
    for i in range(len(words)):
        if reach[i]:
            for n in range(1, min(longest, len(words) - i) + 1):
                if tuple(words[i : i + n]) in phrases:
                    reach[i + n] = True
            rest = words[i:]
            if open_end and any(len(p) >= len(rest) and p[: len(rest) - 1] == tuple(rest[:-1])
                                and p[len(rest) - 1].startswith(rest[-1]) for p in phrases):
                return True
    return reach[-1]


@dataclass
class Voice:
    """Voice heard during a reply in `confirmed` mode, until it is judged: its turn's item, where
    it started in the input, the response it paused, and what was held back meanwhile (the
    turn's transcription deltas: its speech_started waits for the confirmation too)."""

    item_id: str
    start_ms: int
    response: Any  # server/session/reply.py's Response, paused
    started_at: float  # when the voice was heard (the VAD tick's perf_counter)
    settings: Interruption
    speech_ms: int = 0  # how long it has lasted so far
    heard: str = ""  # its words so far, agreed or not: the latest hypothesis
    previous: str = ""  # the hypothesis before it
    deltas: list[str] = field(default_factory=list)
    dismissed: bool = False  # judged not an interruption (the reply resumed); later words may still be one
    stop: Any = None  # the turn's end (server/hearing/audio_input.py's Stop), once the VAD found it
    timer: Any = None  # the task that resumes the reply if no verdict comes in time

    def hear(self, text: str) -> None:
        """A new partial hypothesis of the voice so far."""
        self.previous, self.heard = self.heard, text

    def verdict(self, text: str, speech_ms: int, final: bool) -> Verdict:
        """`text` recognised so far of `speech_ms` of voice (while it goes on, the latest
        hypothesis); `final`: at a pause or the end."""
        words = normal_words(text)
        counted = words
        if not final and not INTERRUPTING.intersection(words):
            before = normal_words(self.previous)
            agreed = 0
            while agreed < min(len(words), len(before)) and words[agreed] == before[agreed]:
                agreed += 1
            counted = words[:agreed]
        phrases = self.settings.phrases
        if counted and len(counted) >= self.settings.min_words \
                and not is_backchannel(counted, phrases, open_end=not final):
            return "interrupt"
        if speech_ms >= self.settings.min_speech_ms and not is_backchannel(words, phrases, open_end=not final):
            return "interrupt"
        return "backchannel" if final else None


class InterruptionHost(Protocol):
    """What the machine sees of its session: the turn being spoken, the outbox, the reply
    pipeline and tool wait, its clock and task owner, and the three steps of a turn that a
    verdict takes (the turn begun, the turn heard to its end, the session maybe drained)."""

    id: str
    turn: Turn | None
    replies: ReplyPipeline
    tools: ToolCalls
    metrics: Metrics
    clock: Clock

    def send(self, name: str, /, **fields: Any) -> None: ...
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...
    def turn_begun(self) -> None: ...
    def interruption_heard(self, turn: Turn, stop: Any) -> None: ...
    def close_if_drained(self) -> None: ...


class Interruptions:
    """The `confirmed` mode's state machine of one session: no voice, or one `Voice` being
    judged (its reply paused, its speech_started and deltas held) until it is an interruption
    (`_confirm`: what was held goes out, the reply is cancelled at the heard point) or not
    (`_dismiss`: input_audio_buffer.backchannel, the reply resumes). The session tells it what
    the VAD and the recogniser found; it answers through `InterruptionHost`."""

    def __init__(self, host: InterruptionHost) -> None:
        self.host = host
        self.voice: Voice | None = None
        self._unannounced: set[str] = set()  # judged voices' items whose transcript is no turn's

    def judging(self, turn: Turn | None) -> bool:
        """Whether `turn` is the voice being judged."""
        return self.voice is not None and turn is not None and turn.item_id == self.voice.item_id

    def next_voice(self) -> None:
        """Speech starts: a voice that ended with its transcript not in yet was no interruption."""
        if self.voice is not None:
            voice, self.voice = self.voice, None
            self._dismiss(voice, voice.heard)
            self._unannounced.add(voice.item_id)

    def judge(self, turn: Turn, start_ms: int, started_at: float, settings: Interruption) -> bool:
        """Voice over an audible reply in `confirmed` mode: the reply pauses and the voice is
        judged (input_audio_buffer.speech_tentative); False for a text-only reply, which is not
        paused (it is cancelled, as ever)."""
        paused = self.host.replies.pause()
        if paused is None:
            return False
        turn.eager = True  # its words are wanted early
        self.voice = Voice(turn.item_id, start_ms, paused, started_at, settings)
        self.host.send("input_audio_buffer.speech_tentative", item_id=turn.item_id, audio_start_ms=start_ms,
                       response_id=paused.response_id)
        return True

    def lasted(self, end_ms: int) -> None:
        """The judged voice's audio reached `end_ms` of the input."""
        if (voice := self.voice) is not None:
            voice.speech_ms = end_ms - voice.start_ms
            self._judge(voice.heard, final=False)

    def heard(self, heard: Heard) -> None:
        """The recogniser's event for a turn: a partial hypothesis of the judged voice judges it."""
        turn, event = heard.turn, heard.event
        if self.judging(turn) and not event.is_final:
            assert self.voice is not None
            self.voice.hear(f"{turn.said} {event.hypothesis or event.text}")
            self._judge(self.voice.heard, final=False)

    def hold(self, turn: Turn, delta: str) -> bool:
        """A transcription delta of the judged voice is held (its turn is not announced yet)."""
        if self.judging(turn):
            assert self.voice is not None
            self.voice.deltas.append(delta)
            return True
        return False

    def paused(self, turn: Turn) -> None:
        """The voice paused: its words so far (the early final) judge it; the reply resumes if
        they do not come within false_interruption_timeout_ms."""
        voice = self.voice
        assert voice is not None and turn.cut_done is not None
        cut = turn.cut_done

        async def judge() -> None:
            await self.host.clock.wait(asyncio.shield(cut), voice.settings.false_interruption_timeout_ms / 1000)
            if self.voice is voice:
                voice.heard = turn.said
                self._judge(turn.said, final=True)

        self.host.spawn(judge(), "voice-judge")

    def ended(self, turn: Turn, stop: Any) -> None:
        """The VAD ended the judged turn: its transcript decides (`completed`); the reply resumes
        by false_interruption_timeout_ms if the transcript has not confirmed it."""
        voice = self.voice
        assert voice is not None
        voice.stop = stop
        if not voice.dismissed:
            async def resume_later() -> None:
                await self.host.clock.sleep(voice.settings.false_interruption_timeout_ms / 1000)
                if self.voice is voice:
                    self._dismiss(voice, turn.said)

            voice.timer = self.host.spawn(resume_later(), "voice-timer")

    def completed(self, turn: Turn) -> bool:
        """A committed turn's transcript is in: whether the machine took it (a judged voice's,
        or one judged earlier whose turn was never announced)."""
        voice = self.voice
        if voice is not None and turn.item_id == voice.item_id and voice.stop is not None:
            self._heard(voice, turn)
            return True
        if turn.item_id in self._unannounced:
            self._unannounced.discard(turn.item_id)
            return True
        return False

    def _heard(self, voice: Voice, turn: Turn) -> None:
        """A judged turn's transcript is in: an interruption becomes the user's turn as any
        other (its speech_stopped, commit and transcript follow); else it was a backchannel."""
        if voice.timer is not None:
            voice.timer.cancel()
        if voice.verdict(turn.said, voice.speech_ms, final=True) != "interrupt":
            self._dismiss(voice, turn.said)
            self.voice = None
            self.host.close_if_drained()
            return
        self._confirm(voice)
        self.host.turn_begun()
        self.host.interruption_heard(turn, voice.stop)

    def _judge(self, text: str, final: bool) -> None:
        voice = self.voice
        if voice is None:
            return
        verdict = voice.verdict(text, voice.speech_ms, final)
        if verdict == "interrupt":
            self._confirm(voice)
        elif verdict == "backchannel":
            self._dismiss(voice, text)

    def _confirm(self, voice: Voice) -> None:
        """The voice interrupts: its held speech_started and deltas go out, and the reply is
        cancelled at the heard point, as an immediate barge-in would have."""
        host = self.host
        self.voice = None
        host.tools.stop()
        turn = host.turn if host.turn is not None and host.turn.item_id == voice.item_id else None
        if turn is not None:
            turn.eager = False
        host.send("input_audio_buffer.speech_started", item_id=voice.item_id, audio_start_ms=voice.start_ms)
        for delta in voice.deltas:
            host.send("conversation.item.input_audio_transcription.delta", item_id=voice.item_id, delta=delta)
        host.metrics.interruptions.labels("interrupted").inc()
        log.debug("interruption confirmed",
                  extra={"session_id": host.id, "heard": voice.heard.strip(), "speech_ms": voice.speech_ms})
        now = host.clock.now()
        if host.replies.response is voice.response and voice.response.audible(now):
            host.replies.cancel("turn_detected")
            host.metrics.barge_in.observe(now - voice.started_at)
        else:
            host.replies.resume(voice.response)
        if turn is not None:
            host.turn_begun()

    def _dismiss(self, voice: Voice, text: str) -> None:
        """The voice is no interruption (so far): the reply resumes, and the client hears what
        was said (input_audio_buffer.backchannel). Later words of the same turn may still
        interrupt."""
        if voice.dismissed:
            return
        voice.dismissed = True
        self.host.metrics.interruptions.labels("resumed").inc()
        self.host.send("input_audio_buffer.backchannel", item_id=voice.item_id, transcript=text.strip(),
                       audio_start_ms=voice.start_ms, response_id=voice.response.response_id)
        self.host.replies.resume(voice.response)
