"""Silero VAD engine: batched across streams equals per-stream sequential, matches the silero_vad
package's own OnnxWrapper, separates silence from Piper speech; a batch of sessions costs less per
window than one call per window."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from rtmedia.engines.base import EngineError
from rtmedia.engines.vad.silero import SAMPLE_RATE, WINDOW, VadEngine, VadItem, VadStream, model_path
from rtmedia.engines.vad.silero_graph import read_weights

from tests.support.speech import Speaker
from tests.support.throughput import best_of, cpu_seconds, vad_windows

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back tomorrow afternoon at the office.",
)
N_WINDOWS = 60  # ~1.9 s per stream


@pytest.fixture(scope="module")
def engine() -> Iterator[VadEngine]:
    eng = VadEngine()
    eng.load()
    eng.warmup()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def speech(speaker: Speaker) -> list[np.ndarray]:
    """Float32 16 kHz speech, one array per sentence."""
    return [speaker.say(s).astype(np.float32) / 32768 for s in SENTENCES]


def _windows(audio: np.ndarray, n: int) -> list[np.ndarray]:
    audio = np.pad(audio, (0, max(0, n * WINDOW - len(audio))))
    return [audio[i * WINDOW : (i + 1) * WINDOW] for i in range(n)]


def _stream_audio(speech: list[np.ndarray], n_streams: int) -> list[list[np.ndarray]]:
    """Different audio per stream: sentence, start offset, gain and background noise all vary."""
    rng = np.random.default_rng(7)
    out = []
    for k in range(n_streams):
        lead = np.zeros(k * 1500, np.float32)
        audio = np.concatenate([lead, speech[k % 2] * (0.4 + 0.1 * k)])
        audio = audio + rng.normal(0, 0.002 * k, len(audio)).astype(np.float32)
        out.append(_windows(audio, N_WINDOWS))
    return out


def _sequential(engine: VadEngine, windows: list[np.ndarray]) -> list[float]:
    stream = engine.open_stream()
    return [engine.step_unbatched([VadItem(stream, w)])[0] for w in windows]


def test_batched_equals_sequential(engine: VadEngine, speech: list[np.ndarray]) -> None:
    audio = _stream_audio(speech, 8)
    expected = np.array([_sequential(engine, w) for w in audio])  # [stream, window]
    streams = [engine.open_stream() for _ in audio]
    got = np.array(
        [
            engine.step([VadItem(s, a[i]) for s, a in zip(streams, audio, strict=True)])
            for i in range(N_WINDOWS)
        ]
    ).T
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert got.max() > 0.9  # the comparison covers speech, not only silence


def test_repeated_streams_in_one_batch_run_in_order(engine: VadEngine, speech: list[np.ndarray]) -> None:
    audio = _stream_audio(speech, 8)
    expected = [_sequential(engine, w) for w in audio]
    streams = [engine.open_stream() for _ in audio]
    cursor = [0] * len(audio)
    got: list[list[float]] = [[] for _ in audio]
    rng = np.random.default_rng(3)
    while min(cursor) < N_WINDOWS:
        # A batch holds 0..4 consecutive windows of each stream, shuffled across streams.
        order = []
        for k in range(len(audio)):
            take = min(int(rng.integers(0, 5)), N_WINDOWS - cursor[k])
            order += [k] * take
        rng.shuffle(order)
        items = []
        for k in order:
            items.append(VadItem(streams[k], audio[k][cursor[k]]))
            cursor[k] += 1
        for k, p in zip(order, engine.step(items), strict=True):
            got[k].append(p)
    for k in range(len(audio)):
        np.testing.assert_allclose(got[k], expected[k], atol=1e-5, rtol=0)


def test_blocks_equal_windows_in_order(engine: VadEngine, speech: list[np.ndarray]) -> None:
    """step_blocks over blocks of 1-4 windows per stream (different per stream and per step)
    gives the same probabilities as each stream's windows one at a time."""
    audio = _stream_audio(speech, 8)
    expected = [_sequential(engine, w) for w in audio]
    streams = [engine.open_stream() for _ in audio]
    got: list[list[float]] = [[] for _ in audio]
    rng = np.random.default_rng(5)
    while min(map(len, got)) < N_WINDOWS:
        blocks, owners = [], []
        for k, stream in enumerate(streams):
            take = min(int(rng.integers(0, 5)), N_WINDOWS - len(got[k]))
            if take:
                blocks.append((stream, np.concatenate(audio[k][len(got[k]):len(got[k]) + take])))
                owners.append(k)
        for k, probs in zip(owners, engine.step_blocks(blocks), strict=True):
            got[k] += probs.tolist()
    for k in range(len(audio)):
        np.testing.assert_allclose(got[k], expected[k], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="only one block per step"):
        engine.step_blocks([(streams[0], audio[0][0]), (streams[0], audio[0][1])])
    with pytest.raises(ValueError, match=r"whole number of 512-sample windows.*shape \(700,\)"):
        engine.step_blocks([(streams[1], np.zeros(700, np.float32))])
    with pytest.raises(ValueError, match=r"blocks must be \(VadStream, samples\), got str"):
        engine.step_blocks([("stream", audio[0][0])])  # type: ignore[list-item]
    assert engine.step_blocks([]) == []


def test_matches_silero_onnx_wrapper(engine: VadEngine, speech: list[np.ndarray]) -> None:
    import torch
    from silero_vad.utils_vad import OnnxWrapper

    audio = _stream_audio(speech, 8)
    wrapper = OnnxWrapper(model_path(), force_onnx_cpu=True)
    streams = [engine.open_stream() for _ in audio]
    for i in range(N_WINDOWS):
        batch = np.stack([a[i] for a in audio])
        want = wrapper(torch.from_numpy(batch), SAMPLE_RATE).numpy()[:, 0]
        got = engine.step([VadItem(s, a[i]) for s, a in zip(streams, audio, strict=True)])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_batched_graph_equals_wheel_model(engine: VadEngine, speech: list[np.ndarray]) -> None:
    """The batch-wide graph gives the wheel's own model's probabilities and states, window after
    window over ~13 s streams of speech, pauses, noise and clipping-level gain."""
    import onnxruntime

    stock = onnxruntime.InferenceSession(model_path(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    pause = np.zeros(8000, np.float32)
    audio = []
    for k in range(6):
        parts = [speech[(k + j) % 2] * (0.3 + 0.25 * k) for j in range(4)]
        a = np.concatenate([p for part in parts for p in (part, pause)])
        audio.append(np.clip(a + rng.normal(0, 0.001 * k, len(a)).astype(np.float32), -1, 1))
    n = min(len(a) for a in audio) // WINDOW
    streams = [engine.open_stream() for _ in audio]
    state = np.zeros((2, len(audio), 128), np.float32)
    context = np.zeros((len(audio), 64), np.float32)
    worst = 0.0
    for i in range(n):
        x = np.stack([a[i * WINDOW : (i + 1) * WINDOW] for a in audio])
        inp = np.concatenate([context, x], axis=1)
        want, state = stock.run(None, {"input": inp, "state": state, "sr": np.array(SAMPLE_RATE, np.int64)})
        context = inp[:, -64:]
        got = engine.step([VadItem(s, w) for s, w in zip(streams, x, strict=True)])
        worst = max(worst, float(np.abs(np.array(got) - want[:, 0]).max()))
    assert n > 400 and worst < 1e-5, worst
    for row, s in enumerate(streams):
        np.testing.assert_allclose(s.state, state[:, row], atol=1e-4, rtol=1e-5)


def test_other_model_layout_refused() -> None:
    other = model_path().replace("silero_vad.onnx", "silero_vad_16k_op15.onnx")  # same wheel, other export
    with pytest.raises(ValueError, match=r"not the Silero VAD v6 layout.*no stft\.forward_basis_buffer"):
        read_weights(other)


def test_silence_low_speech_high(engine: VadEngine, speech: list[np.ndarray]) -> None:
    stream = engine.open_stream()
    silence = engine.step([VadItem(stream, np.zeros(WINDOW, np.float32)) for _ in range(30)])
    assert max(silence) < 0.2
    stream.reset()  # (a jump from digital zero to noise reads ~0.25 for one window)
    quiet = np.random.default_rng(0).normal(0, 3e-3, 30 * WINDOW).astype(np.float32)
    assert max(engine.step([VadItem(stream, w) for w in _windows(quiet, 30)])) < 0.2
    for audio in speech:
        stream.reset()
        probs = np.array(engine.step([VadItem(stream, w) for w in _windows(audio, len(audio) // WINDOW)]))
        middle = probs[len(probs) // 5 : -len(probs) // 5]
        assert np.mean(middle > 0.7) > 0.8, probs.round(2)


def test_reset_forgets_history(engine: VadEngine, speech: list[np.ndarray]) -> None:
    windows = _windows(speech[0], 20)
    stream = engine.open_stream()
    first = engine.step([VadItem(stream, w) for w in windows])
    assert np.any(stream.state != 0) and np.any(stream.context != 0)
    stream.reset()
    assert not np.any(stream.state) and not np.any(stream.context)
    assert engine.step([VadItem(stream, w) for w in windows]) == pytest.approx(first, abs=1e-6)


@pytest.mark.parametrize(
    ("window", "shape"),
    [
        (np.zeros(511, np.float32), "(511,)"),
        (np.zeros((1, 512), np.float32), "(1, 512)"),
        (np.zeros(1024, np.float32), "(1024,)"),
        (np.zeros(512, np.int16), "int16"),
        ([0.0] * 512, "None"),
    ],
)
def test_bad_windows_raise(engine: VadEngine, window: object, shape: str) -> None:
    stream = engine.open_stream()
    good = VadItem(stream, np.zeros(WINDOW, np.float32))
    with pytest.raises(ValueError, match=f"512 float samples.*{shape}"):
        engine.step([good, VadItem(stream, window)])  # type: ignore[arg-type]
    assert not np.any(stream.state)  # nothing ran: the batch is checked first
    with pytest.raises(ValueError, match=shape):
        engine.step_unbatched([VadItem(stream, window)])  # type: ignore[arg-type]


def test_float64_window_accepted_and_empty_batch(engine: VadEngine) -> None:
    a, b = VadStream(), VadStream()
    w = np.random.default_rng(1).normal(0, 0.1, WINDOW)
    assert engine.step([VadItem(a, w)]) == pytest.approx(engine.step([VadItem(b, w.astype(np.float32))]))
    assert engine.step([]) == []


def test_not_loaded_raises() -> None:
    with pytest.raises(EngineError, match="not loaded"):
        VadEngine().step([VadItem(VadStream(), np.zeros(WINDOW, np.float32))])


def test_a_batch_of_64_sessions_costs_less_per_window_than_one_call_each(engine: VadEngine) -> None:
    """What batching across sessions is for: one step over 64 sessions' windows takes at most
    half the CPU time per window of one model call per window (about a quarter, measured on one
    intra-op thread). Windows per second by batch size: tests/perf/bench_batching.py."""
    items = vad_windows(64)
    best = best_of(
        5,
        batched=lambda: cpu_seconds(lambda: engine.step(items), 8) / len(items),
        one_by_one=lambda: cpu_seconds(lambda: engine.step_unbatched(items), 8) / len(items),
    )
    assert best["batched"] < 0.5 * best["one_by_one"], {k: f"{v * 1e6:.1f} us/window" for k, v in best.items()}


def test_parallel_runs_equal_one_run(engine: VadEngine, speech: list[np.ndarray]) -> None:
    """A round split over two concurrent runs gives the same probabilities and the same
    next state as one run over all its rows."""
    split = VadEngine(parallel_runs=2)
    split.load()
    try:
        audio = _stream_audio(speech, 8) * 10  # 80 rows: split 40 + 40
        one, two = ([engine.open_stream() for _ in audio] for _ in range(2))
        for i in range(0, N_WINDOWS, 3):
            want = engine.step([VadItem(s, a[i]) for s, a in zip(one, audio, strict=True)])
            got = split.step([VadItem(s, a[i]) for s, a in zip(two, audio, strict=True)])
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        for a, b in zip(one, two, strict=True):
            np.testing.assert_allclose(b.state, a.state, atol=1e-6, rtol=0)
        assert max(want) > 0.9
    finally:
        split.close()
    with pytest.raises(ValueError, match="parallel_runs must be >= 1"):
        VadEngine(parallel_runs=0)
