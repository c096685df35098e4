"""The Whisper recogniser (engines/asr/whisper.py): its pure parts, and the real tiny.en model on
Piper speech and on sounds that hold no words."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from rtmedia.engines.asr.contract import AsrItem, normal_words
from rtmedia.engines.asr.whisper import _WINDOW_S, WhisperEngine
from rtmedia.engines.asr.whisper_model import window_frames
from rtmedia.engines.asr.whisper_text import LocalAgreement, without_restart
from rtmedia.engines.base import EngineError

from tests.support.speech import normalise, wer

RATE = 16000
FOX = "The quick brown fox jumps over the lazy dog."
EGG = "How many minutes does it take to boil an egg?"
SPIDER = "How many legs does a spider have?"


class Recording:
    """A backend wrapper that records each encoder batch's shape."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.shapes: list[tuple[int, ...]] = []
        self.lock = threading.Lock()

    def encode(self, features):
        with self.lock:
            self.shapes.append(features.shape)
        return self.backend.encode(features)

    def generate(self, *args):
        return self.backend.generate(*args)

    def align(self, *args):
        return self.backend.align(*args)


@pytest.fixture(scope="module")
def engine() -> Iterator[WhisperEngine]:
    eng = WhisperEngine()
    eng.load()
    eng.warmup()
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def idle(engine):
    """Each test starts at the base partial cadence, whatever load the tests before it made."""
    engine.stretch, engine._judged = 1, time.monotonic()
    engine._steps.clear()


@pytest.fixture(scope="module")
def speech(speaker) -> dict[str, bytes]:
    return {text: speaker.say(text).tobytes() for text in (FOX, EGG, SPIDER)}


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def utterance(engine: WhisperEngine, pcm: bytes, piece: int = RATE // 5 * 2) -> tuple[list, object]:
    """Send `pcm` in 200 ms items, then end it: (the partials, the final)."""
    stream = engine.open_stream()
    partials = []
    try:
        for i in range(0, len(pcm), piece):
            [events] = engine.step([AsrItem(stream, pcm[i : i + piece])])
            partials.extend(events)
        [[final]] = engine.step([AsrItem(stream, b"", end=True)], urgent=True)
    finally:
        engine.close_stream(stream)
    return partials, final


# -- pure parts ----------------------------------------------------------------------------


def test_local_agreement_commits_what_two_hypotheses_agree_on():
    agree = LocalAgreement()
    assert agree.update(["How", "many"]) == []  # nothing to agree with yet
    assert agree.update(["How", "many", "minutes"]) == ["How", "many"]  # "minutes" waits
    assert agree.update(["How", "many", "minutes", "does"]) == ["minutes"]
    # A hypothesis that changes a committed word retracts nothing and commits nothing ...
    assert agree.update(["Hey", "Manny", "minutes", "does", "it"]) == []
    assert agree.committed == ["How", "many", "minutes"]
    # ... until the hypotheses agree on the committed words again; case and punctuation aside.
    assert agree.update(["how", "many", "minutes,", "does", "it", "take"]) == []
    assert agree.update(["How", "many", "minutes", "does", "it", "take", "to"]) == ["does", "it", "take"]
    assert agree.committed == ["How", "many", "minutes", "does", "it", "take"]


def test_a_restart_after_a_sentence_is_cut_and_real_repeats_are_kept():
    def keep(text: str) -> str:
        words = text.split()
        return " ".join(words[: without_restart(words)])

    assert keep("What is the capital of France? What is the capital") == "What is the capital of France?"
    assert keep("Set a timer. Set a timer. Set a") == "Set a timer."
    assert keep("Yes. Yes.") == "Yes."
    assert keep("No, no, no, not that one.") == "No, no, no, not that one."
    assert keep("I think I think so.") == "I think I think so."
    assert keep("Stop. Stop the music.") == "Stop. Stop the music."  # goes on past the beginning
    assert keep("It rained. Then it stopped.") == "It rained. Then it stopped."
    # Without a sentence's end: three words or more again from the beginning, to the end.
    assert keep("I need a taxi to the I need a taxi") == "I need a taxi to the"
    assert keep("how much does that, how much does that") == "how much does that,"
    assert keep("I want to, I want to go home") == "I want to, I want to go home"
    assert keep("or more Kubernetes nodes, or more Kubernet") == "or more Kubernetes nodes,"  # cut by the cap
    assert keep("turn it off turn it") == "turn it off turn it"  # two words: a speaker may


def test_windows_are_whole_seconds_with_a_tail_and_at_most_thirty():
    assert window_frames(0) == 100
    assert window_frames(RATE * 2) == 300  # 200 frames + the tail
    assert window_frames(RATE * 3) == 400
    assert window_frames(RATE * 29) == 3000
    assert window_frames(RATE * 40) == 3000


def test_normal_words():
    assert normal_words("Hello, World! It's 5 o'clock.") == ["hello", "world", "it's", "5", "o'clock"]


# -- the model ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [FOX, EGG, SPIDER])
def test_a_sentence_is_heard_with_words_timed_inside_it(engine, speech, text):
    partials, final = utterance(engine, speech[text])
    assert final.is_final and wer(text, final.text) == 0, final.text
    assert [normalise(w) for w, *_ in final.words] == normalise(text).split()
    duration_ms = len(speech[text]) // 2 * 1000 // RATE
    assert (final.start_ms, final.end_ms) == (0, duration_ms)
    starts = [s for _, s, _, _ in final.words]
    assert starts == sorted(starts) and all(0 <= s <= e <= duration_ms + 100 for _, s, e, _ in final.words)
    assert all(0 < c <= 1 for *_, c in final.words)
    # The final's tokens spell its text; their log-probabilities are the model's, and it heard speech.
    assert b"".join(b for _, b, _ in final.tokens).decode().strip() == final.text
    assert all(p <= 0 for *_, p in final.tokens) and sum(p for *_, p in final.tokens) / len(final.tokens) > -0.5
    assert 0 <= final.no_speech_prob < 0.2
    assert all(p.tokens == [] for p in partials)
    # Partials are append-only and agree with the final.
    texts = [p.text for p in partials]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert "".join(f" {p.delta}" for p in partials if p.delta).strip() == texts[-1]
    assert len(normalise(texts[-1]).split()) >= 2
    assert normalise(final.text).startswith(normalise(texts[-1]))


@pytest.mark.parametrize("sound", ["silence", "white noise", "hum", "tone", "clicks", "quiet noise"])
def test_sounds_without_words_give_empty_text(engine, sound):
    rng = np.random.default_rng(7)
    t = np.arange(RATE * 3) / RATE
    samples = {
        "silence": np.zeros(t.size),
        "white noise": rng.standard_normal(t.size) * 0.1,
        "hum": 0.2 * np.sin(2 * np.pi * 60 * t) + 0.05 * np.sin(2 * np.pi * 120 * t),
        "tone": 0.2 * np.sin(2 * np.pi * 440 * t),
        "clicks": np.where(np.arange(t.size) % (RATE // 4) < 40, 0.6, 0.0),
        "quiet noise": rng.standard_normal(t.size) * 0.003,
    }[sound]
    partials, final = utterance(engine, pcm16(samples))
    assert final.text == "" and final.words == []
    assert all(p.text == "" for p in partials)


def test_streams_in_one_step_share_encoder_batches_by_window_length(engine, speech):
    recording = Recording(engine._backend)
    engine._backend = recording
    try:
        streams = [engine.open_stream() for _ in range(5)]
        texts = [FOX, EGG, SPIDER, FOX, EGG]
        engine.step([AsrItem(s, speech[t]) for s, t in zip(streams, texts, strict=True)])
        recording.shapes.clear()
        results = engine.step([AsrItem(s, b"", end=True) for s in streams])
    finally:
        engine._backend = recording.backend
        for s in streams:
            engine.close_stream(s)
    assert [wer(t, r[0].text) for t, r in zip(texts, results, strict=True)] == [0] * 5
    # One encoder batch per window length, every stream of that length in it.
    lengths = {window_frames(len(speech[t]) // 2) for t in texts}
    assert sorted(shape[2] for shape in recording.shapes) == sorted(lengths)
    assert sum(shape[0] for shape in recording.shapes) == 5


def test_an_utterance_longer_than_a_window_comes_out_whole_and_in_order(engine, speaker):
    sentences = [FOX, EGG, SPIDER, "Please call me back tomorrow afternoon at the office.",
                 "The weather will be sunny with a light breeze.", "I would like to hear a joke about cats."]
    parts = []
    while sum(p.size for p in parts) < RATE * (_WINDOW_S + 12):
        for s in sentences:
            parts += [speaker.say(s), speaker.silence(0.4)]
    said = " ".join(sentences * (len(parts) // 2 // len(sentences)))
    pcm = np.concatenate(parts).tobytes()
    _, final = utterance(engine, pcm, piece=RATE * 2)
    assert wer(said, final.text) < 0.05, final.text
    assert final.end_ms == len(pcm) // 2 * 1000 // RATE
    starts = [s for _, s, _, _ in final.words]
    assert starts == sorted(starts) and starts[-1] > _WINDOW_S * 1000
    assert b"".join(b for _, b, _ in final.tokens).decode().strip() == final.text  # every window's tokens


def test_the_contract_of_a_stream(engine, speech):
    with pytest.raises(EngineError, match="segment=False"):
        engine.open_stream(segment=True)
    stream = engine.open_stream()
    [[empty]] = engine.step([AsrItem(stream, b"", end=True)])  # a turn without audio: one empty final
    assert (empty.is_final, empty.text, empty.utterance_index) == (True, "", 0)
    with pytest.raises(ValueError, match="odd byte count"):
        engine.step([AsrItem(stream, b"\0\0\0")])
    with pytest.raises(ValueError, match="urgent"):
        engine.step([AsrItem(stream, b"\0\0")], urgent=True)
    engine.step([AsrItem(stream, speech[EGG])])
    [[final]] = engine.step([AsrItem(stream, b"", end=True)])
    assert final.utterance_index == 1 and final.start_ms == 0 and wer(EGG, final.text) == 0
    closed = engine.open_stream()
    engine.close_stream(closed)
    results = engine.step([AsrItem(closed, speech[FOX]), AsrItem(stream, speech[FOX], end=True)])
    assert isinstance(results[0], EngineError) and "not open" in str(results[0])
    assert wer(FOX, results[1][-1].text) == 0 and results[1][-1].start_ms == final.end_ms
    engine.close_stream(stream)
    assert engine.open_streams == 0


def test_the_partial_cadence_stretches_while_the_engine_is_busy_and_comes_back(engine, speech):
    assert engine.stretch == 1
    try:
        engine._judged -= 3  # a whole window has passed
        engine._account(time.monotonic() - 3.5)  # a step that kept the engine busy 3.5 s of 2 s of 2 runs
        assert engine.stretch == 2
        engine._account(time.monotonic() - 3.5)  # judged again only after a window of its own
        assert engine.stretch == 2
        engine._judged -= 3
        engine._account(time.monotonic() - 3.5)
        assert engine.stretch == 4
        stream = engine.open_stream()
        [events] = engine.step([AsrItem(stream, speech[FOX][: RATE * 2 * 3 // 2])])  # 1.5 s < 4 times 500 ms
        assert events == []
        engine._steps.clear()  # an idle window: back by half
        engine._judged -= 3
        engine._account(time.monotonic())
        assert engine.stretch == 2
        engine.close_stream(stream)
    finally:
        engine.stretch = 1


def test_an_eager_item_has_its_partial_at_a_quarter_of_the_cadence(engine, speech):
    stream = engine.open_stream()
    quarter = RATE * 2 // 4  # 250 ms of PCM16
    assert engine.step([AsrItem(stream, speech[FOX][:quarter])]) == [[]]
    [events] = engine.step([AsrItem(stream, speech[FOX][quarter : 2 * quarter], eager=True)])
    assert [e.is_final for e in events] == [False]  # 500 ms of new audio: due either way
    ms = RATE * 2 // 1000  # 1 ms of PCM16
    [events] = engine.step([AsrItem(stream, speech[FOX][2 * quarter : 2 * quarter + 100 * ms])])
    assert events == []  # 100 ms since: not due ...
    [events] = engine.step([AsrItem(stream, speech[FOX][2 * quarter + 100 * ms : 2 * quarter + 130 * ms], eager=True)])
    assert [e.is_final for e in events] == [False]  # ... but 130 ms is due for an eager item
    assert engine._streams[stream.id].utt.unprompted  # and decoded without the text before
    engine.close_stream(stream)


def test_a_prompt_is_the_first_utterances_context_and_the_next_follows_the_one_before(engine, speech):
    stream = engine.open_stream(prompt="We talked about cooking. " * 100)
    try:
        st = engine._streams[stream.id]
        assert 0 < len(st.previous) <= 120 and engine._vocab.decode(st.previous).endswith("cooking.")
        [[final]] = engine.step([AsrItem(stream, speech[EGG], end=True)])
        assert wer(EGG, final.text) == 0, final.text
        assert engine._vocab.decode(st.previous) == final.text  # the next utterance's context
    finally:
        engine.close_stream(stream)
    assert engine._streams.get(stream.id) is None
    blank = engine.open_stream(prompt="   ")
    assert engine._streams[blank.id].previous == []
    engine.close_stream(blank)


def test_a_short_utterance_after_a_long_one_is_decoded_whole(engine, speaker):
    # The prompt (the utterance before, up to 120 tokens) does not eat the decode's token budget.
    stream = engine.open_stream(prompt="The weather today is sunny with a light breeze from the west. " * 10)
    try:
        [[final]] = engine.step([AsrItem(stream, speaker.say("Okay, got it.").tobytes(), end=True)])
        assert normalise(final.text).split() in (["okay", "got", "it"], ["ok", "got", "it"]), final.text
    finally:
        engine.close_stream(stream)


def test_streams_with_contexts_of_any_length_decode_in_one_step(engine, speech):
    # CTranslate2 batches only prompts of one length: contexts batch with those at least half as long.
    prompts = ["", "Cooking.", "We talked about cooking and the weather " * 3, "We talked about cooking. " * 50]
    streams = [engine.open_stream(prompt=p) for p in prompts]
    try:
        results = engine.step([AsrItem(s, speech[EGG], end=True) for s in streams])
    finally:
        for s in streams:
            engine.close_stream(s)
    assert [wer(EGG, r[0].text) for r in results] == [0] * len(prompts), [r[0].text for r in results]
