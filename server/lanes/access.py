"""What sessions and servicers may ask of the engines: one typed handle per engine.

Every handle goes through the scheduler (server/lanes/scheduler.py): work is
submitted to the engine's lane with a priority, per-stream engine state is
opened and closed off the event loop where that costs more than building an
object, and replies run on a lane (an LM lane, or a stream lane for
responders that call out over HTTP). No session or servicer holds an engine;
which lane an item takes (`asr` or `asr_final`) is decided here, in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass

import numpy as np
import torch
from rtmedia.engines.asr.contract import AsrEvent, AsrItem, AsrStream, language_code
from rtmedia.engines.asr.pocketsphinx import AsrEngine
from rtmedia.engines.asr.whisper import WhisperEngine
from rtmedia.engines.audio.denoise import DenoiseStream
from rtmedia.engines.responders.contract import (
    CallDelta,
    Incomplete,
    ReplyRequest,
    Responder,
    Waiting,
    calls_tools,
)
from rtmedia.engines.tts.piper import TtsEngine, TtsItem, TtsStream, VoiceSpec
from rtmedia.engines.turn.scorers import TurnPrompt
from rtmedia.engines.vad.silero import VadEngine, VadStream
from rtmedia.engines.video.decoder import VaeInfo, VideoEngine, VideoOneShot, VideoStep, VideoStream
from rtmedia.engines.video.plan import FramePlan
from rtmedia.server.hearing.audio_input import AudioInput, VadTick
from rtmedia.server.lanes.lm_lane import LmLane
from rtmedia.server.lanes.responders import LmResponder
from rtmedia.server.lanes.scheduler import Priority, Scheduler, StreamLane
from rtmedia.server.observe.metrics import Metrics

# Lane names, chosen by the server when it registers the lanes (server/app.py).
TTS, ASR, ASR_FINAL, VAD, VIDEO, TURN_AUDIO = "tts", "asr", "asr_final", "vad", "video", "turn_audio"


class Tts:
    """Speech synthesis on the `tts` lane. A stream is a voice at an output rate with its
    resampler: opening one only builds that object, so it happens on the loop."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._engine: TtsEngine = scheduler.lane(TTS).engine  # type: ignore[assignment]

    @property
    def voices(self) -> dict[str, VoiceSpec]:
        return self._engine.voices

    @property
    def default_voice(self) -> str:
        return self._engine.default_voice

    @property
    def rates(self) -> dict[str, list[int]]:
        """Voice name -> supported output rates, the default voice first."""
        names = [self.default_voice, *(n for n in self.voices if n != self.default_voice)]
        return {n: self.voices[n].supported_rates for n in names}

    def voice(self, name: str) -> VoiceSpec:
        """The voice called `name` (the default for ""); KeyError names the known ones."""
        return self._engine.voice(name)

    def open(self, voice: str = "", output_rate: int = 0, window_frames: int = 0, speed: float = 1.0) -> TtsStream:
        return self._engine.open_stream(voice, output_rate, window_frames, speed)

    async def synthesize(self, item: TtsItem, priority: Priority | None = None, due: float | None = None) -> bytes:
        audio: bytes = await self._scheduler.submit(TTS, item, priority, due)
        return audio

    @property
    def waiting(self) -> int:
        """TTS items queued for the lane."""
        return self._scheduler.lane(TTS).waiting


class Asr:
    """Speech recognition. Items that only end an utterance go to the `asr_final` lane, which
    each recogniser worker answers between two pieces of the step it is decoding; anything
    with audio to the `asr` lane. Opening a stream only picks a worker and counts it (on the
    loop, so a caller cancelled meanwhile cannot leave one open); closing one tells its
    worker process, a pipe round trip, so it runs off the loop."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._engine: AsrEngine | WhisperEngine = scheduler.lane(ASR).engine  # type: ignore[assignment]

    @property
    def open_streams(self) -> int:
        return self._engine.open_streams

    @property
    def workers(self) -> int:
        return self._engine.workers

    @property
    def model(self) -> str:
        """The recogniser's name: whisper-tiny or pocketsphinx."""
        return self._engine.model

    @property
    def finds_utterances(self) -> bool:
        """Whether the recogniser cuts a `segment=True` stream into utterances itself; else
        the VAD must find them (server/hearing/vad_recognition.py)."""
        return self._engine.finds_utterances

    @property
    def takes_prompt(self) -> bool:
        """Whether the recogniser uses a stream's prompt (the text said before its audio)."""
        return self._engine.takes_prompt

    @property
    def languages(self) -> tuple[str, ...]:
        """The languages the recogniser transcribes (ISO 639-1): ("en",) for an English-only one."""
        return tuple(self._engine.languages)

    @property
    def multilingual(self) -> bool:
        return len(self.languages) > 1

    def language(self, code: str, field: str = "language") -> str:
        """The served language `code` names, as its ISO 639-1 code ("fr-FR", "fr" and "french" are
        "fr"; "" stays "": detected, or English); ValueError names the request's `field` and what
        is served."""
        return language_code(code, self.languages, field)

    @property
    def describe(self) -> dict[str, str | bool | tuple[str, ...]]:
        """The recogniser for the APIs: its name, languages, runtime and precision."""
        described = self._engine.describe
        return {"model": self.model, "languages": self.languages, "multilingual": self.multilingual,
                "runtime": str(described.get("runtime", "")), "compute_type": str(described.get("compute_type", ""))}

    def open(self, segment: bool = True, fast_final: bool = False, partials: bool = True,
             prompt: str = "", language: str = "") -> AsrStream:
        """A stream; `language`: what it is said in (a code `language()` accepts), "" to detect
        each utterance's (English on an English-only recogniser)."""
        return self._engine.open_stream(segment, fast_final, partials, prompt, language)

    async def close(self, stream: AsrStream) -> None:
        await asyncio.to_thread(self._engine.close_stream, stream)

    async def recognize(self, item: AsrItem, priority: Priority | None = None) -> list[AsrEvent]:
        events: list[AsrEvent] = await self._scheduler.submit(ASR_FINAL if item.only_ends else ASR, item, priority)
        return events


class Vad:
    """The VAD tick: every 32 ms one batched step over the audio of every attached input.
    A VAD stream is a row of recurrent state in its handle (nothing to open in the engine)."""

    def __init__(self, engine: VadEngine, tick: VadTick) -> None:
        self._engine = engine
        self._tick = tick

    def open(self) -> VadStream:
        return self._engine.open_stream()

    async def denoise(self, kind: str) -> DenoiseStream:
        """A noise suppressor's stream for an input (opening a `far_field` one loads a model:
        off the loop)."""
        return await asyncio.to_thread(self._tick.denoiser.open_stream, kind)

    async def close_denoise(self, stream: DenoiseStream) -> None:
        """A suppressor stream no input was given."""
        await asyncio.to_thread(self._tick.denoiser.close_stream, stream)

    @property
    def attached(self) -> int:
        return len(self._tick.inputs)

    def wake(self) -> None:
        """The tick steps now (a session ended a turn: its stop need not wait for the next tick)."""
        self._tick.wake()

    def attach(self, audio_input: AudioInput) -> None:
        self._tick.inputs.add(audio_input)

    def detach(self, audio_input: AudioInput) -> None:
        """After this, no result of a tick still running reaches the input; its suppressor
        stream is closed by the next tick."""
        self._tick.inputs.discard(audio_input)
        for stream in (audio_input.denoiser, *(audio_input.pending_denoiser or ()), *audio_input.orphans):
            if stream is not None:
                self._tick.retired.append(stream)


class Video:
    """Chunked video decode on the BULK `video` lane, one latent step per item. Opening a
    stream checks and copies the latent and allocates the feature cache: off the loop;
    closing one only marks it (a step running then frees the cache), so it never waits."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._engine: VideoEngine = scheduler.lane(VIDEO).engine  # type: ignore[assignment]

    @property
    def info(self) -> VaeInfo | None:
        """The loaded VAE's shapes and scaling (None before it is loaded)."""
        return self._engine.info

    async def open(self, latent: torch.Tensor, plan: FramePlan, height: int, width: int,
                   normalized: bool = False) -> VideoStream:
        return await asyncio.to_thread(self._engine.open_stream, latent, plan, height, width, normalized)

    def close(self, stream: VideoStream) -> None:
        self._engine.close_stream(stream)

    async def step(self, stream: VideoStream) -> np.ndarray:
        """The frames this step commits (T x H x W x 3 uint8)."""
        frames: np.ndarray = await self._scheduler.submit(VIDEO, VideoStep(stream))
        return frames

    async def one_shot(self, stream: VideoStream) -> list[np.ndarray]:
        outputs: list[np.ndarray] = await self._scheduler.submit(VIDEO, VideoOneShot(stream))
        return outputs


class Replies:
    """The responders, each on a lane: LM responders on their model's LM lane (continuous
    batching, kept slots), the others (echo, an OpenAI-compatible server) on a stream lane
    of their own that owns each call as a task. `pause(name, conversation)` asks the LM lane
    to hold the conversation's decoding back (its first clause is being synthesised)."""

    def __init__(self, scheduler: Scheduler, responders: dict[str, Responder]) -> None:
        self._scheduler = scheduler
        self._responders = responders

    @property
    def names(self) -> list[str]:
        return sorted(self._responders)

    def __contains__(self, name: object) -> bool:
        return name in self._responders

    @property
    def tool_callers(self) -> list[str]:
        """The responders that can call functions (a session's tools are refused on the others)."""
        return sorted(name for name, responder in self._responders.items() if calls_tools(responder))

    def _lm_lane(self, name: str) -> LmLane | None:
        responder = self._responders.get(name)
        return responder.lane if isinstance(responder, LmResponder) else None

    def reply(self, name: str, request: ReplyRequest, priority: Priority | None = None
              ) -> AsyncIterator[str | Waiting | Incomplete | CallDelta]:
        responder = self._responders[name]
        if isinstance(responder, LmResponder):
            return responder.reply(request)  # its compute is the LM lane's already
        lane = self._scheduler.lanes[f"reply-{name}"]
        assert isinstance(lane, StreamLane)
        return lane.stream(lambda: responder.reply(request), priority)

    def behind(self, name: str) -> bool:
        """Replies wait for `name`'s lane (every LM slot taken, or its stream lane's calls)."""
        if name not in self._responders:
            return False
        lane = self._lm_lane(name) or self._scheduler.lanes.get(f"reply-{name}")
        return lane is not None and lane.waiting > 0

    async def prepare(self, name: str, request: ReplyRequest) -> None:
        """Get ready for a reply to `request` plus a user turn not yet transcribed (an LM
        prefills the prompt's known prefix into the conversation's kept slot)."""
        responder = self._responders.get(name)
        if isinstance(responder, LmResponder):
            await responder.prepare(request)

    def pause(self, name: str, conversation: Hashable) -> None:
        if (lane := self._lm_lane(name)) is not None:
            lane.pause(conversation)

    def resume(self, name: str, conversation: Hashable) -> None:
        if (lane := self._lm_lane(name)) is not None:
            lane.resume(conversation)

    def forget(self, conversation: Hashable) -> None:
        """The conversation ended: every LM lane gives up what it kept for it."""
        for responder in self._responders.values():
            if isinstance(responder, LmResponder):
                responder.lane.forget(conversation)


class Turns:
    """semantic_vad's end-of-turn scorers (engines/turn/scorers.py): the text scorer as prefill-only items
    on an LM lane (the session's own LM responder's model, else the embedded one's), batched
    across sessions; the acoustic one, when the server loads it, on the `turn_audio` lane."""

    def __init__(self, scheduler: Scheduler, lanes: dict[str, LmLane]) -> None:
        self._scheduler = scheduler
        self._lanes = lanes
        self._prompts: dict[str, TurnPrompt] = {}

    @property
    def available(self) -> bool:
        return bool(self._lanes)

    @property
    def hears(self) -> bool:
        """The acoustic scorer is loaded."""
        return TURN_AUDIO in self._scheduler.lanes

    def _lane(self, responder: str) -> tuple[LmLane, TurnPrompt]:
        name = responder if responder in self._lanes else "llm" if "llm" in self._lanes else next(iter(self._lanes))
        lane = self._lanes[name]
        if name not in self._prompts:
            self._prompts[name] = TurnPrompt.of(lane.engine.tokenizer)
        return lane, self._prompts[name]

    async def score(self, responder: str, key: Hashable, assistant: str, words: str) -> float | None:
        """log10 P(the user has finished) after `words`; None when the LM had no slot for it. The
        prompt is built here, on the loop: a short template and a few words take about 0.2 ms."""
        lane, prompt = self._lane(responder)
        return await lane.score(key, prompt.ids(assistant, words), prompt.score)

    def forget(self, key: Hashable) -> None:
        for lane in self._lanes.values():
            lane.forget(key)

    async def hear(self, audio: np.ndarray) -> float:
        """P(complete) from the acoustic scorer, of a turn whose 16 kHz audio ends with `audio`."""
        return await self._scheduler.submit(TURN_AUDIO, audio, Priority.REALTIME)


@dataclass(frozen=True)
class EngineAccess:
    """Everything a session or servicer may use: the handles and the metrics."""

    tts: Tts
    asr: Asr
    vad: Vad
    video: Video
    replies: Replies
    metrics: Metrics
    turns: Turns

    @classmethod
    def of(cls, scheduler: Scheduler, vad: VadEngine, tick: VadTick, responders: dict[str, Responder]
           ) -> EngineAccess:
        lanes = {name: r.lane for name, r in responders.items() if isinstance(r, LmResponder)}
        return cls(Tts(scheduler), Asr(scheduler), Vad(vad, tick), Video(scheduler),
                   Replies(scheduler, responders), scheduler.metrics, Turns(scheduler, lanes))
