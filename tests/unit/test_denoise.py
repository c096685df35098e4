"""Noise suppression (engines/audio/denoise.py) on a real Piper sentence in white noise: the noise goes,
the speech stays, the output does not depend on chunking, state is per stream, bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
from rtmedia.engines.audio.denoise import BACKENDS, DEFAULT_BACKENDS, KINDS, Denoiser, DenoiseStream

RATE = 16000
LEAD, TAIL = RATE * 3 // 2, RATE // 2  # noise alone before and after the sentence
SUPPRESSORS = [b for b in BACKENDS if b != "webrtc_agc"]  # the gain control raises quiet noise again


def db(x: np.ndarray) -> float:
    return 10 * float(np.log10(np.mean(np.square(x, dtype=np.float64)) + 1e-20))


@pytest.fixture(scope="module")
def sentence(speaker) -> np.ndarray:
    return speaker.float_audio("Please book a table for two at seven tonight.") * 0.8


@pytest.fixture(scope="module")
def noisy(sentence) -> np.ndarray:
    """The sentence with noise alone before and after it, in white noise at 5 dB SNR."""
    noise = np.random.default_rng(5).standard_normal(LEAD + sentence.size + TAIL)
    noise *= np.sqrt(np.mean(np.square(sentence)) / 10 ** 0.5)
    return (np.pad(sentence, (LEAD, TAIL)) + noise).astype(np.float32)


def run(denoiser: Denoiser, stream: DenoiseStream, audio: np.ndarray, chunk: int) -> np.ndarray:
    return np.concatenate([denoiser.process(stream, audio[i : i + chunk]) for i in range(0, audio.size, chunk)])


@pytest.mark.parametrize("backend", SUPPRESSORS)
def test_the_noise_goes_down_and_the_speech_stays(backend, sentence, noisy):
    denoiser = Denoiser({"near_field": backend})
    stream = denoiser.open_stream("near_field")
    out = run(denoiser, stream, noisy, 512)
    denoiser.close_stream(stream)
    assert out.dtype == np.float32 and out.shape == noisy.shape
    alone = slice(RATE // 2, LEAD)  # after the first half second, in which a suppressor adapts
    assert db(out[alone]) < db(noisy[alone]) - 6, (db(noisy[alone]), db(out[alone]))
    said = slice(LEAD, LEAD + sentence.size)  # the output's delay is a few windows, small beside the sentence
    assert abs(db(out[said]) - db(sentence)) < 4, (db(sentence), db(out[said]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_output_does_not_depend_on_chunking(kind, noisy):
    denoiser = Denoiser()
    audio = noisy[: RATE * 2]
    whole_stream = denoiser.open_stream(kind)
    whole = denoiser.process(whole_stream, audio)
    assert whole.shape == audio.shape
    assert not whole[: whole_stream.delay_samples].any()  # the fixed delay: zeros first
    for ms in (7, 20, 100):
        stream = denoiser.open_stream(kind)
        np.testing.assert_allclose(run(denoiser, stream, audio, RATE * ms // 1000), whole, rtol=0, atol=1e-6)
        denoiser.close_stream(stream)
    denoiser.close_stream(whole_stream)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_each_stream_keeps_its_own_state(backend, noisy):
    denoiser = Denoiser({"far_field": backend})
    a_in, b_in = noisy[: RATE], noisy[RATE : 2 * RATE] * 0.5
    alone = []
    for x in (a_in, b_in):
        stream = denoiser.open_stream("far_field")
        alone.append(run(denoiser, stream, x, 320))
        denoiser.close_stream(stream)
    a, b = denoiser.open_stream("far_field"), denoiser.open_stream("far_field")
    outs = [denoiser.process_many([(a, a_in[i : i + 320]), (b, b_in[i : i + 320])]) for i in range(0, RATE, 320)]
    np.testing.assert_allclose(np.concatenate([o[0] for o in outs]), alone[0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([o[1] for o in outs]), alone[1], rtol=0, atol=1e-6)
    denoiser.reset(a)  # as good as new
    np.testing.assert_allclose(run(denoiser, a, b_in, 320), alone[1], rtol=0, atol=1e-6)
    denoiser.close_stream(a)
    denoiser.close_stream(b)


def test_the_default_backends_and_odd_input():
    denoiser = Denoiser()
    assert denoiser.backends == DEFAULT_BACKENDS
    stream = denoiser.open_stream("near_field")
    assert denoiser.process(stream, np.zeros(0, np.float32)).shape == (0,)
    bad = np.full(800, np.nan, np.float32)
    bad[::2] = np.inf
    out = denoiser.process(stream, bad)  # cleaned before the backend: its state stays usable
    assert np.isfinite(out).all()
    assert np.isfinite(denoiser.process(stream, np.ones(1600, np.float64) * 0.1)).all()  # float64 is converted
    denoiser.close_stream(stream)
    denoiser.close_stream(stream)  # idempotent


def test_bad_input_is_refused_naming_the_problem():
    denoiser = Denoiser()
    stream = denoiser.open_stream("far_field")
    with pytest.raises(ValueError, match="float samples"):
        denoiser.process(stream, np.zeros(160, np.int16))
    with pytest.raises(ValueError, match="float samples"):
        denoiser.process(stream, [0.0] * 160)
    with pytest.raises(ValueError, match="mono"):
        denoiser.process(stream, np.zeros((2, 160), np.float32))
    with pytest.raises(ValueError, match="DenoiseStream"):
        denoiser.process_many([("stream", np.zeros(160, np.float32))])
    with pytest.raises(ValueError, match="unknown denoise kind 'studio'"):
        denoiser.open_stream("studio")
    with pytest.raises(ValueError, match="unknown denoise kind"):
        Denoiser({"studio": "rnnoise"})
    with pytest.raises(ValueError, match="unknown denoise backend 'sox'"):
        Denoiser({"near_field": "sox"})
    denoiser.close_stream(stream)
    with pytest.raises(ValueError, match="closed"):
        denoiser.process(stream, np.zeros(160, np.float32))
    with pytest.raises(ValueError, match="open denoise stream"):
        denoiser.reset(stream)
