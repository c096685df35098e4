"""Streaming ASR engine (PocketSphinx in worker processes), driven with speech synthesised by Piper."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Iterator

import jiwer
import numpy as np
import pytest
from rtmedia.engines.asr.contract import AsrEvent, AsrItem, AsrStream, language_code
from rtmedia.engines.asr.pocketsphinx import AsrEngine
from rtmedia.engines.asr.pocketsphinx_worker import _FAST_SEARCH, _Worker, _worker_main
from rtmedia.engines.base import EngineError

from tests.support.speech import Speaker, normalise, wer

RATE = 16000
CHUNK = RATE // 10  # 100 ms of samples
FOX = "The quick brown fox jumps over the lazy dog."
CALL = "Please call me back tomorrow afternoon at the office."


@pytest.fixture(scope="module")
def speech(speaker) -> dict[str, np.ndarray]:
    """PCM16 at 16 kHz for each sentence, synthesised locally by Piper."""
    return {text: (np.clip(speaker.float_audio(text), -1.0, 1.0) * 32767).astype(np.int16) for text in (FOX, CALL)}


@pytest.fixture(scope="module")
def engine() -> Iterator[AsrEngine]:
    eng = AsrEngine(workers=2)
    eng.load()
    eng.warmup()
    yield eng
    eng.close()
    assert multiprocessing.active_children() == []


def _chunks(pcm: np.ndarray) -> list[bytes]:
    return [pcm[i : i + CHUNK].tobytes() for i in range(0, len(pcm), CHUNK)]


def _run(engine: AsrEngine, stream: AsrStream, pcm: np.ndarray) -> list[tuple[int, AsrEvent]]:
    """Stream `pcm` in 100 ms chunks (the last with end=True); events with the stream time they arrived at."""
    chunks = _chunks(pcm)
    got = []
    for i, chunk in enumerate(chunks):
        [events] = engine.step([AsrItem(stream, chunk, end=i == len(chunks) - 1)])
        got += [(min((i + 1) * CHUNK, len(pcm)) * 1000 // RATE, ev) for ev in events]
    return got


def _two_sentences(
    speech: dict[str, np.ndarray], lead: float = 1.0
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """lead s silence, FOX, 1.5 s silence, CALL, 0.5 s silence; returns the audio and where the speech is (ms)."""
    parts = [Speaker.silence(lead), speech[FOX], Speaker.silence(1.5), speech[CALL], Speaker.silence(0.5)]
    bounds, at = [], 0
    for i, part in enumerate(parts):
        if i in (1, 3):
            bounds.append((at * 1000 // RATE, (at + len(part)) * 1000 // RATE))
        at += len(part)
    return np.concatenate(parts), bounds


def _finals(events: list[AsrEvent]) -> list[AsrEvent]:
    return [ev for ev in events if ev.is_final]


def test_two_sentences_give_two_accurate_finals(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    audio, bounds = _two_sentences(speech)
    stream = engine.open_stream()
    try:
        finals = _finals([ev for _, ev in _run(engine, stream, audio)])
    finally:
        engine.close_stream(stream)
    assert [f.utterance_index for f in finals] == [0, 1]
    for final, text, (start, end) in zip(finals, (FOX, CALL), bounds, strict=True):
        assert wer(text, final.text) < 0.35, (text, final.text)
        assert abs(final.start_ms - start) <= 300, (final, start)
        assert abs(final.end_ms - end) <= 300, (final, end)
        assert final.delta == ""
        assert " ".join(w for w, *_ in final.words) == final.text
        for word, w_start, w_end, conf in final.words:
            assert re.fullmatch(r"[a-z']+", word), word
            assert final.start_ms <= w_start < w_end <= final.end_ms
            assert 0.0 <= conf <= 1.0
        assert [w[1] for w in final.words] == sorted(w[1] for w in final.words)


def test_partials_are_regular_and_append_only(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    audio, _ = _two_sentences(speech)
    stream = engine.open_stream()
    try:
        timed = _run(engine, stream, audio)
    finally:
        engine.close_stream(stream)
    by_utt: dict[int, list[tuple[int, AsrEvent]]] = {}
    for arrived, ev in timed:
        by_utt.setdefault(ev.utterance_index, []).append((arrived, ev))
    assert sorted(by_utt) == [0, 1]
    for seq in by_utt.values():
        events = [ev for _, ev in seq]
        assert [ev.is_final for ev in events] == [False] * (len(events) - 1) + [True]
        assert len(events) >= 8  # ~2.8 s of speech: a partial every 300 ms
        assert len({ev.start_ms for ev in events}) == 1
        # Every 300 ms of the utterance's audio has an event ...
        ends = [events[0].start_ms] + [ev.end_ms for ev in events]
        assert all(0 < b - a <= 300 for a, b in itertools.pairwise(ends)), ends
        # ... and they arrive at that pace as the audio streams in (100 ms chunks).
        arrivals = [t for t, _ in seq]
        assert all(b - a <= 300 for a, b in itertools.pairwise(arrivals)), arrivals
        text = ""
        for ev in events[:-1]:
            assert ev.text.startswith(text), (text, ev.text)
            assert ev.text == " ".join(p for p in (text, ev.delta) if p), (text, ev.delta, ev.text)
            assert ev.words == []
            text = ev.text
        assert text, "no words were committed before the final"
        assert wer(events[-1].text, text) < 0.5  # partials mostly agree with the final


def test_end_flushes_an_open_utterance(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    first = np.concatenate([Speaker.silence(0.5), speech[CALL]])  # no trailing silence: only end=True ends it
    second = np.concatenate([Speaker.silence(0.5), speech[FOX]])
    stream = engine.open_stream()
    try:
        timed = _run(engine, stream, first)
        more = [ev for _, ev in _run(engine, stream, second)]  # the stream goes on after a flush
    finally:
        engine.close_stream(stream)
    arrived, final = timed[-1]
    assert _finals([ev for _, ev in timed]) == [final]
    assert arrived == len(first) * 1000 // RATE  # produced by the flush, on the last chunk
    assert wer(CALL, final.text) < 0.35
    [again] = _finals(more)
    assert again.utterance_index == 1
    assert wer(FOX, again.text) < 0.35
    assert abs(again.start_ms - (len(first) + RATE // 2) * 1000 // RATE) <= 300  # offsets keep counting


def _check_streams(results: dict[AsrStream, list[AsrEvent]], texts: dict[AsrStream, tuple[str, ...]]) -> None:
    for stream, events in results.items():
        finals = _finals(events)
        assert len(finals) == len(texts[stream])
        for final, text in zip(finals, texts[stream], strict=True):
            assert wer(text, final.text) < 0.35, (stream, text, final.text)


def test_interleaved_streams_do_not_mix(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    streams = [engine.open_stream() for _ in range(3)]
    a, b, c = streams
    assert a.worker == c.worker != b.worker  # least-loaded placement; a and c share one worker's decoders
    audio = {
        a: np.concatenate([Speaker.silence(0.5), speech[FOX], Speaker.silence(1.0)]),
        b: np.concatenate([Speaker.silence(0.8), speech[CALL], Speaker.silence(1.0)]),
        c: np.concatenate([Speaker.silence(1.1), speech[CALL], Speaker.silence(1.0)]),
    }
    texts = {a: (FOX,), b: (CALL,), c: (CALL,)}
    chunks = {s: _chunks(pcm) for s, pcm in audio.items()}
    results: dict[AsrStream, list[AsrEvent]] = {s: [] for s in streams}
    try:
        for i in range(max(map(len, chunks.values()))):
            batch = [AsrItem(s, ch[i], end=i == len(ch) - 1) for s, ch in chunks.items() if i < len(ch)]
            for item, events in zip(batch, engine.step(batch), strict=True):
                results[item.stream] += events
    finally:
        for s in streams:
            engine.close_stream(s)
    _check_streams(results, texts)


def test_concurrent_step_calls_from_threads(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    streams = [engine.open_stream() for _ in range(4)]
    texts = {s: (FOX, CALL) if i % 2 else (CALL, FOX) for i, s in enumerate(streams)}
    results: dict[AsrStream, list[AsrEvent]] = {}
    errors: list[BaseException] = []

    def drive(stream: AsrStream) -> None:
        first, second = (speech[t] for t in texts[stream])
        pcm = np.concatenate([Speaker.silence(0.3), first, Speaker.silence(1.5), second, Speaker.silence(0.6)])
        try:
            results[stream] = [ev for _, ev in _run(engine, stream, pcm)]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for s in streams:
        engine.close_stream(s)
    assert not errors, errors
    _check_streams(results, texts)


def test_close_stream_and_close_leave_no_processes(speech: dict[str, np.ndarray]) -> None:
    before = set(multiprocessing.active_children())
    eng = AsrEngine(workers=1)
    eng.load()
    mine = set(multiprocessing.active_children()) - before
    assert len(mine) == 1
    try:
        # close a stream in the middle of an utterance: its decoder goes back to the worker's pool
        s1 = eng.open_stream()
        half = np.concatenate([Speaker.silence(0.5), speech[FOX][: len(speech[FOX]) // 2]])
        for chunk in _chunks(half):
            eng.step([AsrItem(s1, chunk)])
        eng.close_stream(s1)
        eng.close_stream(s1)  # idempotent
        [closed] = eng.step([AsrItem(s1, b"\0\0")])  # fails alone: the lane logs no batch failure
        assert isinstance(closed, EngineError) and "not open" in str(closed)
        s2 = eng.open_stream()
        events = [ev for _, ev in _run(eng, s2, np.concatenate([Speaker.silence(0.5), speech[CALL]]))]
        [final] = _finals(events)
        assert final.utterance_index == 0
        assert wer(CALL, final.text) < 0.35
        eng.close_stream(s2)
    finally:
        eng.close()
    eng.close()  # idempotent
    assert all(not p.is_alive() for p in mine)
    assert set(multiprocessing.active_children()) <= before
    eng.close_stream(s2)  # a no-op once closed


# ----------------------------------------------------------------------------- segment=False: the caller's turns


def _turns(engine: AsrEngine, stream: AsrStream, turns: list[np.ndarray]) -> list[list[list[AsrEvent]]]:
    """Stream each turn in 100 ms chunks, the last with end=True; the events of each step, per turn."""
    out = []
    for pcm in turns:
        chunks = _chunks(pcm) or [b""]
        out.append(
            [engine.step([AsrItem(stream, ch, end=i == len(chunks) - 1)])[0] for i, ch in enumerate(chunks)]
        )
    return out


def _check_turn(steps: list[list[AsrEvent]], index: int, start_ms: int, pcm: np.ndarray) -> AsrEvent:
    """One final, on the end=True step, after partials every <= 300 ms of the turn's audio (append-only)."""
    assert all(not ev.is_final for events in steps[:-1] for ev in events)
    *partials, final = [ev for events in steps for ev in events]
    assert final.is_final and [ev.is_final for ev in steps[-1]][-1]
    assert {ev.utterance_index for ev in (*partials, final)} == {index}
    assert {ev.start_ms for ev in (*partials, final)} == {start_ms}
    assert final.end_ms == start_ms + len(pcm) * 1000 // RATE
    ends = [start_ms] + [ev.end_ms for ev in (*partials, final)]
    assert all(0 < b - a <= 300 for a, b in itertools.pairwise(ends)) or ends == [start_ms] * 2, ends
    text = ""
    for ev in partials:
        assert ev.text == " ".join(p for p in (text, ev.delta) if p), (text, ev.delta, ev.text)
        text = ev.text
    assert final.delta == "" and final.language == "en"
    assert " ".join(w for w, *_ in final.words) == final.text
    for _, w_start, w_end, conf in final.words:
        assert final.start_ms <= w_start < w_end <= final.end_ms
        assert 0.0 <= conf <= 1.0
    return final


@pytest.mark.parametrize(("asked", "served", "code"), [
    ("", ("en",), ""), ("en", ("en",), "en"), ("en-US", ("en",), "en"), ("EN_us", ("en",), "en"),
    ("english", ("en",), "en"), (" English ", ("en",), "en"), ("fr-FR", ("en", "fr"), "fr"),
    ("french", ("en", "fr"), "fr"), ("mandarin", ("en", "zh"), "zh"), ("yue", ("en", "yue"), "yue"),
])
def test_a_language_is_named_by_code_tag_or_name(asked: str, served: tuple[str, ...], code: str) -> None:
    assert language_code(asked, served) == code


def test_a_language_not_served_names_what_is() -> None:
    with pytest.raises(ValueError, match=r"^language 'fr-FR' is not served by this recogniser; it serves en "
                                         r"\(an English-only model\)$"):
        language_code("fr-FR", ("en",))
    many = tuple(f"{a}{b}" for a in "abc" for b in "xyz")
    with pytest.raises(ValueError, match=r"^language_code 'klingon' is not served by this recogniser; it serves 9 "
                                         r"languages \(ax, ay, az, bx, by, bz, cx, cy, \.\.\.\)$"):
        language_code("klingon", many, "language_code")
    with pytest.raises(ValueError, match=r"^language 'x{32}'\.\.\. \(300 characters\) is not served"):
        language_code("x" * 300, ("en",))


def test_pocketsphinx_serves_english_only() -> None:
    engine = AsrEngine(workers=1)  # not loaded: the language is checked first
    assert engine.languages == ("en",) and engine.describe["runtime"] == "pocketsphinx"
    for other in ("fr", "de-DE", "german"):
        with pytest.raises(ValueError, match="it serves en"):
            engine.open_stream(segment=False, language=other)
    for english in ("", "en", "en-US", "english"):
        with pytest.raises(EngineError, match="not loaded"):
            engine.open_stream(segment=False, language=english)


def test_default_stream_mode(engine: AsrEngine) -> None:
    stream = engine.open_stream()
    try:
        assert (stream.segment, stream.fast_final) == (True, False)
    finally:
        engine.close_stream(stream)


@pytest.mark.parametrize("fast_final", [False, True])
def test_unsegmented_turns_end_only_on_end(
    engine: AsrEngine, speech: dict[str, np.ndarray], fast_final: bool
) -> None:
    turns = [
        np.concatenate([Speaker.silence(0.3), speech[FOX], Speaker.silence(1.2)]),  # trailing silence does not end it
        # right after the previous turn, with the short lead-in a VAD turn's prefix padding gives (a word
        # at a turn's very first sample is sometimes misheard: "Please" as "lace")
        np.concatenate([Speaker.silence(0.1), speech[CALL]]),
        np.concatenate([Speaker.silence(0.2), speech[CALL], Speaker.silence(0.4)]),
    ]
    stream = engine.open_stream(segment=False, fast_final=fast_final)
    try:
        steps = _turns(engine, stream, turns)
    finally:
        engine.close_stream(stream)
    at = 0  # samples; offsets count from the stream's start
    for index, (turn_steps, pcm, text) in enumerate(zip(steps, turns, (FOX, CALL, CALL), strict=True)):
        final = _check_turn(turn_steps, index, at * 1000 // RATE, pcm)
        assert wer(text, final.text) < 0.35, (text, final.text)
        at += len(pcm)


def test_unsegmented_turn_is_not_split_by_silences(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    turn = np.concatenate([Speaker.silence(0.5), speech[FOX], Speaker.silence(3.0), speech[CALL], Speaker.silence(2.0)])
    stream = engine.open_stream(segment=False)
    try:
        [steps] = _turns(engine, stream, [turn])
    finally:
        engine.close_stream(stream)
    final = _check_turn(steps, 0, 0, turn)
    assert wer(f"{FOX} {CALL}", final.text) < 0.35, final.text


def test_unsegmented_turns_without_words_give_one_empty_final(
    engine: AsrEngine, speech: dict[str, np.ndarray]
) -> None:
    rng = np.random.default_rng(0)
    hiss = rng.normal(0.0, 30.0, RATE).astype(np.int16)
    turns = [Speaker.silence(1.0), Speaker.silence(0.0), Speaker.silence(0.02), hiss, speech[CALL], Speaker.silence(0.0)]
    stream = engine.open_stream(segment=False)
    try:
        steps = _turns(engine, stream, turns)
    finally:
        engine.close_stream(stream)
    at = 0  # samples
    for index, (turn_steps, pcm) in enumerate(zip(steps, turns, strict=True)):
        final = _check_turn(turn_steps, index, at * 1000 // RATE, pcm)
        at += len(pcm)
        if index == 4:
            assert wer(CALL, final.text) < 0.35, final.text
        else:
            assert (final.text, final.words) == ("", []), (index, final)


def test_results_do_not_depend_on_decoder_history(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    """Decoders are lent per utterance; what one decoded before must not change the next result."""
    rng = np.random.default_rng(1)
    loud = np.concatenate([rng.normal(0.0, 3000.0, RATE).astype(np.int16), speech[FOX]])
    pcm = np.concatenate([Speaker.silence(0.2), speech[CALL], Speaker.silence(0.2)])
    finals = []
    for turns in ([pcm], [loud], [pcm]):
        stream = engine.open_stream(segment=False)  # every stream here starts on the same (idle) worker
        try:
            steps = _turns(engine, stream, turns)
        finally:
            engine.close_stream(stream)
        finals.append(steps[-1][-1][-1])
    assert finals[0] == finals[2]


def test_fast_final_is_faster(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    """fast_final skips the decoder's second pass over the utterance in the final (see the module doc)."""
    pcm = np.concatenate([Speaker.silence(0.2), speech[FOX], Speaker.silence(0.3)])
    *head, tail = _chunks(pcm)
    latency = {}
    for fast_final in (False, True):
        stream = engine.open_stream(segment=False, fast_final=fast_final)
        times = []
        try:
            for _ in range(3):
                for chunk in head:
                    engine.step([AsrItem(stream, chunk)])
                started = time.perf_counter()
                [events] = engine.step([AsrItem(stream, tail, end=True)])
                times.append(time.perf_counter() - started)
                assert wer(FOX, events[-1].text) < 0.35
        finally:
            engine.close_stream(stream)
        latency[fast_final] = min(times)
    assert latency[True] < 0.8 * latency[False], latency


def test_fast_decoders_get_the_fast_search_settings() -> None:
    """The fast pool is built with `_FAST_SEARCH` (a model's feat.params silently overrides some keys);
    the default pool keeps PocketSphinx's defaults."""
    import pocketsphinx

    worker = _Worker()  # in this process: the code a worker process runs
    fast, default = worker._new_decoder(fast=True), worker._new_decoder(fast=False)
    defaults = pocketsphinx.Config()
    assert {"fwdflat", "maxhmmpf", "topn"} <= _FAST_SEARCH.keys()
    for key, value in _FAST_SEARCH.items():
        assert fast.config[key] == pytest.approx(value, rel=1e-6), key
        assert default.config[key] == pytest.approx(defaults[key], rel=1e-6), key
    assert fast.config["bestpath"]  # the lattice pass gives the words' confidences


def test_fast_final_transcribes_within_bounds(engine: AsrEngine, speech: dict[str, np.ndarray]) -> None:
    """The fast pool's narrower search (see `_FAST_SEARCH`) keeps the WER bounds used above, and
    stays usable in mild noise (WER over both sentences; at 30 dB SNR some of 70 Piper draws came
    within a word of the bound, at 35 dB all of 30 had one error in 18 words)."""
    rng = np.random.default_rng(2)

    def noisy(pcm: np.ndarray) -> np.ndarray:
        x = pcm.astype(np.float64)
        x += rng.normal(0.0, np.sqrt(np.mean(x**2) / 10**3.5), len(x))  # 35 dB SNR
        return np.clip(x, -32768, 32767).astype(np.int16)

    clean = [np.concatenate([Speaker.silence(0.3), speech[t], Speaker.silence(0.4)]) for t in (FOX, CALL)]
    turns = [*clean, *(noisy(pcm) for pcm in clean)]
    stream = engine.open_stream(segment=False, fast_final=True)
    try:
        steps = _turns(engine, stream, turns)
    finally:
        engine.close_stream(stream)
    at, finals = 0, []
    for index, (turn_steps, pcm) in enumerate(zip(steps, turns, strict=True)):
        finals.append(_check_turn(turn_steps, index, at * 1000 // RATE, pcm).text)
        at += len(pcm)
    for text, final in zip((FOX, CALL), finals[:2], strict=True):
        assert wer(text, final) < 0.35, (text, final)
    assert jiwer.wer([normalise(FOX), normalise(CALL)], [normalise(f) or "<empty>" for f in finals[2:]]) < 0.35, finals


def test_odd_byte_count_is_rejected(engine: AsrEngine) -> None:
    stream = engine.open_stream()
    try:
        with pytest.raises(ValueError, match="3201"):
            engine.step([AsrItem(stream, b"\0" * 3200), AsrItem(stream, b"\0" * 3201)])
        assert engine.step([]) == []
        assert engine.step([AsrItem(stream, b"")]) == [[]]
    finally:
        engine.close_stream(stream)


def test_urgent_final_does_not_wait_for_a_running_step(speech: dict[str, np.ndarray]) -> None:
    """A turn's end on the urgent pipe is answered between two pieces of another stream's long
    step (one worker holds both streams), with the same words as through the step pipe."""
    eng = AsrEngine(workers=1, decoders=2)
    eng.load()
    try:
        talker, ender = (eng.open_stream(segment=False, fast_final=True) for _ in range(2))
        turn = np.concatenate([Speaker.silence(0.2), speech[FOX], Speaker.silence(0.2)])
        for chunk in _chunks(turn):
            eng.step([AsrItem(ender, chunk)])
        [[expected]] = eng.step([AsrItem(ender, b"", end=True)])  # the same turn through the step pipe
        for chunk in _chunks(turn):
            eng.step([AsrItem(ender, chunk)])
        long = np.tile(np.concatenate([speech[CALL], Speaker.silence(0.3)]), 8)  # ~30 s: seconds of decoding
        done: dict[str, float] = {}

        def talk() -> None:
            eng.step([AsrItem(talker, long.tobytes())])
            done["talker"] = time.perf_counter()

        thread = threading.Thread(target=talk)
        thread.start()
        time.sleep(0.3)  # the long step is being decoded
        started = time.perf_counter()
        [[final]] = eng.step([AsrItem(ender, b"", end=True)], urgent=True)
        done["ender"] = time.perf_counter()
        thread.join(timeout=120)
        assert "talker" in done and done["ender"] < done["talker"] - 0.5, (started, done)
        assert final.is_final and final.text == expected.text and wer(FOX, final.text) < 0.35
        assert [w for w, *_ in final.words] == [w for w, *_ in expected.words]
        # the worker still answers both pipes (the urgent request it took mid-step is not waited for again)
        assert eng.step([AsrItem(ender, speech[FOX].tobytes())]) != [[]]
        [[last]] = eng.step([AsrItem(talker, b"", end=True)], urgent=True)
        assert last.is_final and wer(" ".join([CALL] * 8), last.text) < 0.35
        assert [AsrItem(ender, b"", end=True).only_ends, AsrItem(ender, b"\0\0", end=True).only_ends] == \
            [True, False]
        with pytest.raises(ValueError, match="urgent ASR item only ends an utterance"):
            eng.step([AsrItem(ender, b"\0\0", end=True)], urgent=True)
        with pytest.raises(ValueError, match="urgent ASR item only ends an utterance"):
            eng.step([AsrItem(ender, b"")], urgent=True)
    finally:
        eng.close()


def test_worker_loop_reads_only_pipes_that_still_hold_a_request(speech: dict[str, np.ndarray]) -> None:
    """Both pipes ready at once: the step answers the urgent request itself, and the loop then
    serves the next request instead of waiting on the emptied urgent pipe (the worker's loop
    runs in a thread of this process here)."""
    conn, child = multiprocessing.Pipe()
    urgent, urgent_child = multiprocessing.Pipe()
    sid = (1, False, True)  # stream 1: segment=False, fast_final=True
    conn.send((1, "step", [(sid[0], speech[FOX].tobytes(), False, *sid[1:])]))
    urgent.send((2, "step", [(7, b"", True, False, True)]))  # another stream's (empty) turn ends
    worker = threading.Thread(target=_worker_main, args=(child, urgent_child), daemon=True)
    worker.start()
    try:
        assert urgent.poll(60) and urgent.recv()[:2] == (2, True)
        assert conn.poll(60) and conn.recv()[:2] == (1, True)
        conn.send((3, "ping", None))
        assert conn.poll(10), "the worker stopped answering its step pipe"
        assert conn.recv()[:3] == (3, True, None)
    finally:
        conn.send((0, "stop", None))
        worker.join(timeout=10)
    assert not worker.is_alive()


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_decoder_pool_shrinks_back_when_streams_close(speech: dict[str, np.ndarray]) -> None:
    """Four streams speaking at once on a worker configured for two decoders: it builds two more,
    and closing the streams frees the extra ones, keeping the configured two."""
    worker = _Worker()  # in this process: the code a worker process runs
    worker.handle("warmup", (1, 2))
    audio = speech[FOX][: 16000 // 2].tobytes()  # half a second: each turn is still going
    worker.handle("step", [(sid, audio, False, False, True) for sid in range(1, 5)])
    assert worker.decoders(fast=True) == 4
    speaking = _rss_mib()
    for sid, left in zip(range(1, 5), (3, 2, 2, 2), strict=True):
        worker.handle("close", [sid])
        assert worker.decoders(fast=True) == left, sid
    # the freed decoders' memory (~95 MiB each) goes back to the system, also when a batch of
    # closes frees many at once
    assert _rss_mib() < speaking - 100, (speaking, _rss_mib())
    worker.handle("step", [(sid, audio, False, False, True) for sid in range(10, 22)])
    speaking = _rss_mib()
    worker.handle("close", list(range(10, 22)))
    assert worker.decoders(fast=True) == 2
    assert _rss_mib() < speaking - 600, (speaking, _rss_mib())
    assert worker.decoders(fast=False) == 1
    # an item that raced its stream's close is dropped, not decoded into a stream never closed again
    assert worker.handle("step", [(1, audio, False, False, True)]) == [[]]
    assert worker.decoders(fast=True) == 2 and not worker._streams


@pytest.mark.serial
def test_a_close_does_not_wait_for_a_running_step(speech: dict[str, np.ndarray]) -> None:
    """While a worker decodes a long step, closing another stream returns at once; closing the
    stream being decoded ends that step's work on it too (the rest of its audio is skipped)."""
    eng = AsrEngine(workers=1)
    eng.load()
    try:
        busy, other = eng.open_stream(fast_final=True), eng.open_stream()
        eng.step([AsrItem(other, speech[FOX][:8000].tobytes(), False)])
        audio = np.tile(speech[FOX], 40).tobytes()  # many seconds of decoding
        stepping = threading.Thread(target=eng.step, args=([AsrItem(busy, audio, True)],))
        stepping.start()
        time.sleep(0.3)
        started = time.perf_counter()
        eng.close_stream(other)
        # Answered between two 300 ms pieces of the busy step, which goes on decoding.
        assert time.perf_counter() - started < 1.0 and stepping.is_alive()
        started = time.perf_counter()
        eng.close_stream(busy)
        stepping.join(timeout=30)
        assert time.perf_counter() - started < 1.0
        assert eng.open_streams == 0
    finally:
        eng.close()
