"""Streaming resamplers and PCM / G.711 helpers (docs/protocol.md#output-sample-rate); scipy is the independent reference."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from rtmedia.engines.audio.resample import (
    ALAW_TABLE,
    ULAW_TABLE,
    FirDownsampler,
    PassThroughResampler,
    PolyphaseResampler,
    StreamResampler,
    alaw_to_float,
    float_to_alaw,
    float_to_pcm16,
    float_to_ulaw,
    make_resampler,
    pcm16_to_float,
    ulaw_to_float,
)
from scipy import signal

EDGE = 100  # output samples skipped at each end when comparing with references


def tone(freq: float, rate: int, seconds: float = 1.0, amp: float = 0.5) -> np.ndarray:
    return amp * np.sin(2 * np.pi * freq * np.arange(round(rate * seconds)) / rate)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def run(r, x: np.ndarray, splits=()) -> np.ndarray:
    """Feed x split at the given indices, then flush; return everything emitted."""
    parts = [r.process(p) for p in np.split(x, list(splits))]
    out = np.concatenate([*parts, r.flush()])
    assert out.dtype == np.float32
    return out


def noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, n)


# --- FirDownsampler (integer ratio) ------------------------------------------------------------


@pytest.mark.parametrize("src,dst", [(24000, 8000), (48000, 16000), (16000, 16000), (44100, 22050)])
def test_fir_taps_are_the_spec_filter(src, dst):
    r = FirDownsampler(src, dst)
    ratio = src // dst
    ref = signal.firwin(20 * ratio + 1, 0.95 / ratio, window=("kaiser", 5.0))  # scale=True: sum 1
    assert r.taps.size == 20 * ratio + 1
    assert r.taps.sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(r.taps, ref, atol=1e-12)


def test_fir_chunk_boundaries_do_not_change_output():
    x = tone(1000, 24000)
    whole = run(FirDownsampler(24000, 8000), x)
    split = run(FirDownsampler(24000, 8000), x, [137, 2048, 9001, 17003])
    assert whole.size == split.size == 8000
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-6)


def test_fir_one_sample_at_a_time_matches_one_call():
    x = noise(2400)
    r = FirDownsampler(24000, 8000)
    np.testing.assert_allclose(run(r, x, range(1, x.size)), run(r, x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 29, 30, 31, 61, 1000, 1001, 1002])
@pytest.mark.parametrize("src,dst", [(24000, 8000), (48000, 8000)])
def test_fir_output_length_is_ceil_n_over_r(n, src, dst):
    r = FirDownsampler(src, dst)
    x = noise(n)
    assert run(r, x, [n // 3]).size == math.ceil(n / (src // dst))


@pytest.mark.parametrize("src,dst", [(24000, 8000), (48000, 16000), (48000, 8000)])
def test_fir_matches_scipy_resample_poly(src, dst):
    x = tone(440, src) + tone(2500, src, amp=0.3) + noise(src, seed=1) * 0.2
    r = FirDownsampler(src, dst)
    ours = run(r, x, [5000, 5001, 12345])
    ref = signal.resample_poly(x, 1, src // dst, window=r.taps)
    assert ours.size == ref.size
    np.testing.assert_allclose(ours[EDGE:-EDGE], ref[EDGE:-EDGE], rtol=0, atol=2e-3)


def test_fir_passband_tone_keeps_rms():
    x = tone(3000, 24000)
    y = run(FirDownsampler(24000, 8000), x)
    assert rms(y[EDGE:-EDGE]) == pytest.approx(rms(x), rel=0.02)


@pytest.mark.parametrize("freq", [6000, 10000])
def test_fir_stopband_tones_are_removed(freq):
    x = tone(freq, 24000)
    y = run(FirDownsampler(24000, 8000), x)
    assert rms(y[EDGE:-EDGE]) < 0.01 * rms(x)


def test_fir_rejects_non_integer_ratio():
    with pytest.raises(ValueError, match=r"integer ratio; 22050 -> 16000 is not \(use PolyphaseResampler\)"):
        FirDownsampler(22050, 16000)
    with pytest.raises(ValueError, match="integer ratio; 8000 -> 16000"):
        FirDownsampler(8000, 16000)


@pytest.mark.parametrize("cls", [FirDownsampler, PolyphaseResampler])
def test_multichannel_input_is_rejected(cls):
    r = cls(48000, 16000) if cls is FirDownsampler else cls(22050, 16000)
    with pytest.raises(ValueError, match=r"mono \(1-D\).*got shape \(480, 2\)"):
        r.process(np.zeros((480, 2), dtype=np.float32))
    with pytest.raises(ValueError, match=r"mono \(1-D\).*got shape \(\)"):
        r.process(np.float32(0.5))


def test_integer_pcm_arrays_are_rejected():
    with pytest.raises(TypeError, match="float samples"):
        FirDownsampler(24000, 8000).process(np.zeros(10, dtype=np.int16))


# --- PolyphaseResampler ------------------------------------------------------------------------

PAIRS = [
    (22050, 16000),
    (24000, 16000),
    (48000, 22050),
    (22050, 48000),
    (22050, 8000),
    (22050, 24000),
    (22050, 44100),
    (8000, 16000),
    (44100, 48000),
    (16000, 22050),
]


@pytest.mark.parametrize("src,dst", PAIRS)
def test_polyphase_filter_design(src, dst):
    r = PolyphaseResampler(src, dst)
    m = max(r.up, r.down)
    ref = signal.firwin(20 * m + 1, 0.95 / m, window=("kaiser", 5.0))  # 0.95 * min(1/L, 1/M)
    np.testing.assert_allclose(r.taps, ref * r.up, rtol=0, atol=1e-12)  # gain L
    assert r.taps.sum() == pytest.approx(r.up)


@pytest.mark.parametrize("src,dst", PAIRS)
def test_polyphase_chunk_boundaries_do_not_change_output(src, dst):
    x = tone(700, src) + noise(src, seed=2) * 0.1
    whole = run(PolyphaseResampler(src, dst), x)
    awkward = [1, 2, 137, 146, 147, 148, 441, 2048, 2049, 7001, src - 160, src - 1]
    random = np.sort(np.random.default_rng(3).choice(np.arange(1, src), 150, replace=False))
    for splits in (awkward, random):
        np.testing.assert_allclose(run(PolyphaseResampler(src, dst), x, splits), whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 146, 147, 148, 320, 321, 441, 442, 4999])
@pytest.mark.parametrize("src,dst", [(22050, 16000), (48000, 22050), (22050, 48000), (8000, 16000)])
def test_polyphase_output_length_is_ceil_n_l_over_m(n, src, dst):
    r = PolyphaseResampler(src, dst)
    assert run(r, noise(n), [n // 2, n // 2 + 1]).size == math.ceil(n * r.up / r.down)
    assert (r.up, r.down) == (dst // math.gcd(src, dst), src // math.gcd(src, dst))


@pytest.mark.parametrize("src,dst", PAIRS)
def test_polyphase_matches_scipy_resample_poly(src, dst):
    x = tone(440, src) + tone(1800, src, amp=0.3) + noise(src, seed=4) * 0.2
    r = PolyphaseResampler(src, dst)
    ours = run(r, x, [3000, 3001, 10007])
    ref = signal.resample_poly(x, r.up, r.down, window=r.taps / r.up)  # resample_poly applies gain L
    assert ours.size == ref.size == math.ceil(src * r.up / r.down)
    np.testing.assert_allclose(ours[EDGE:-EDGE], ref[EDGE:-EDGE], rtol=0, atol=2e-3)


@pytest.mark.parametrize("src,dst", PAIRS)
def test_polyphase_1khz_tone_keeps_rms_and_shape(src, dst):
    y = run(PolyphaseResampler(src, dst), tone(1000, src))
    assert rms(y[EDGE:-EDGE]) == pytest.approx(rms(tone(1000, dst)), rel=0.02)
    np.testing.assert_allclose(y[EDGE:-EDGE], tone(1000, dst)[EDGE:-EDGE], rtol=0, atol=0.01)


@pytest.mark.parametrize(
    "src,dst,freq",
    [(22050, 16000, 10500), (24000, 16000, 11000), (48000, 22050, 18000), (22050, 8000, 7000),
     (44100, 16000, 15000), (32000, 22050, 15000)],
)  # fmt: skip
def test_polyphase_tone_above_destination_nyquist_is_removed(src, dst, freq):
    assert dst / 2 < freq < src / 2
    x = tone(freq, src)
    y = run(PolyphaseResampler(src, dst), x)
    assert rms(y[EDGE:-EDGE]) < 0.01 * rms(x)


@pytest.mark.parametrize("src,dst,freq", [(22050, 48000, 8000), (8000, 16000, 3000), (16000, 22050, 6000)])
def test_polyphase_upsampling_suppresses_images(src, dst, freq):
    y = run(PolyphaseResampler(src, dst), tone(freq, src))[EDGE:-EDGE]
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size))) ** 2
    image_band = np.fft.rfftfreq(y.size, 1 / dst) > src / 2
    assert math.sqrt(spectrum[image_band].sum() / spectrum.sum()) < 0.01


def test_polyphase_for_integer_downsampling_is_the_fir_filter():
    np.testing.assert_array_equal(PolyphaseResampler(48000, 16000).taps, FirDownsampler(48000, 16000).taps)


def test_polyphase_odd_rate_pair_takes_the_gather_path():
    r = PolyphaseResampler(16001, 16000)  # block matrix would be 16000 x 16022: windows are gathered
    assert r._block is None
    x = tone(440, 16001) + noise(16001, seed=5) * 0.2
    ours = run(r, x)
    np.testing.assert_allclose(run(r, x, [1, 999, 1000, 8000, 16000]), ours, rtol=0, atol=1e-6)
    ref = signal.resample_poly(x, r.up, r.down, window=r.taps / r.up)
    np.testing.assert_allclose(ours[EDGE:-EDGE], ref[EDGE:-EDGE], rtol=0, atol=2e-3)


def test_flush_resets_for_a_new_stream():
    r = PolyphaseResampler(22050, 16000)
    x = tone(440, 22050)
    first = run(r, x, [1000])
    np.testing.assert_array_equal(run(r, x, [1000]), first)
    assert r.flush().size == 0


# --- make_resampler and StreamResampler ---------------------------------------------------------


@pytest.mark.parametrize(
    "src,dst,cls",
    [(24000, 8000, FirDownsampler), (48000, 16000, FirDownsampler), (22050, 16000, PolyphaseResampler),
     (8000, 16000, PolyphaseResampler), (16000, 48000, PolyphaseResampler), (16000, 16000, PassThroughResampler)],
)  # fmt: skip
def test_make_resampler_picks_the_implementation(src, dst, cls):
    assert type(make_resampler(src, dst)) is cls


def test_pass_through_returns_float32_input():
    r = make_resampler(16000, 16000)
    x = noise(100)
    y = r.process(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x.astype(np.float32))
    assert r.flush().size == 0


@pytest.mark.parametrize("src,dst", [(0, 16000), (16000, 0), (-8000, 16000), (16000, -1)])
def test_non_positive_rates_are_rejected(src, dst):
    with pytest.raises(ValueError, match="must be > 0"):
        make_resampler(src, dst)


def test_stream_resampler_locks_rate_on_first_non_empty_chunk():
    s = StreamResampler(16000)
    assert s.src_rate is None
    assert s.push(np.zeros(0, dtype=np.float32), 44100).size == 0  # empty chunks fix nothing
    assert s.push(np.zeros(0), 8000).size == 0
    assert s.src_rate is None
    x = tone(440, 22050)
    out = [s.push(x[:5000], 22050)]
    assert s.src_rate == 22050
    out.append(s.push(np.zeros(0, dtype=np.float32), 22050))
    with pytest.raises(ValueError, match="source rate changed from 22050 to 16000 mid-stream"):
        s.push(x[5000:6000], 16000)
    out += [s.push(x[5000:], 22050), s.flush()]
    np.testing.assert_allclose(np.concatenate(out), run(PolyphaseResampler(22050, 16000), x), atol=1e-6)


def test_stream_resampler_flush_without_input_is_empty():
    s = StreamResampler(24000)
    tail = s.flush()
    assert tail.size == 0 and tail.dtype == np.float32
    s.push(np.zeros(0), 8000)
    assert s.flush().size == 0


def test_stream_resampler_same_rate_and_multichannel():
    s = StreamResampler(16000)
    x = noise(320)
    np.testing.assert_array_equal(s.push(x, 16000), x.astype(np.float32))
    with pytest.raises(ValueError, match=r"mono \(1-D\)"):
        s.push(np.zeros((2, 320)), 16000)


# --- PCM16 and G.711 ----------------------------------------------------------------------------


def test_pcm16_round_trip_is_exact():
    pcm = np.arange(-32768, 32768, dtype="<i2").tobytes()
    x = pcm16_to_float(pcm)
    assert x.dtype == np.float32 and x.min() == -1.0 and x.max() == 32767 / 32768
    assert float_to_pcm16(x) == pcm


def test_pcm16_is_little_endian_and_rounds_and_clips():
    np.testing.assert_array_equal(pcm16_to_float(b"\x01\x00\x00\x80"), [1 / 32768, -1.0])
    samples = np.array([0.4 / 32768, 0.6 / 32768, -0.6 / 32768, 1.0, 1.5, -1.0, -3.0, np.nan])
    expected = [0, 1, -1, 32767, 32767, -32768, -32768, 0]
    assert np.frombuffer(float_to_pcm16(samples), "<i2").tolist() == expected


def test_pcm16_odd_byte_count_is_rejected():
    with pytest.raises(ValueError, match="even number of bytes; got 3"):
        pcm16_to_float(b"\x00\x01\x02")


def test_g711_known_codes():
    # ITU-T G.711: mu-law 0xFF / 0x7F = +0 / -0, 0x80 / 0x00 = +-8031 (14-bit) = +-32124;
    # A-law 0xD5 / 0x55 = +-1 (13-bit) = +-8, 0xAA / 0x2A = +-4032 (13-bit) = +-32256.
    assert ULAW_TABLE[[0xFF, 0x7F, 0x80, 0x00, 0xF0, 0x70]].tolist() == [0, 0, 32124, -32124, 120, -120]
    assert ALAW_TABLE[[0xD5, 0x55, 0xAA, 0x2A, 0xD4, 0xC5]].tolist() == [8, -8, 32256, -32256, 24, 264]
    np.testing.assert_array_equal(ulaw_to_float(b"\xff\x80\x00"), [0, 32124 / 32768, -32124 / 32768])
    np.testing.assert_array_equal(alaw_to_float(b"\xd5\xaa\x2a"), [8 / 32768, 32256 / 32768, -32256 / 32768])
    assert float_to_ulaw([0.0, 1.0, -1.0]) == b"\xff\x80\x00"
    assert float_to_alaw([0.0, 1.0, -1.0]) == b"\xd5\xaa\x2a"


@pytest.mark.parametrize(
    "table,encode,decode",
    [(ULAW_TABLE, float_to_ulaw, ulaw_to_float), (ALAW_TABLE, float_to_alaw, alaw_to_float)],
)
def test_g711_round_trip_within_quantisation_error(table, encode, decode):
    levels = np.unique(table) / 32768
    assert levels.size == (255 if table is ULAW_TABLE else 256)  # mu-law has two zeros
    # every level is a fixed point of encode/decode
    np.testing.assert_array_equal(decode(encode(levels)), levels.astype(np.float32))
    x = np.linspace(levels[0], levels[-1], 200001)
    y = decode(encode(x)).astype(np.float64)
    i = np.searchsorted(levels, x)  # x lies between levels[i-1] and levels[i]
    below, above = levels[np.maximum(i - 1, 0)], levels[i]
    assert np.all((np.isclose(y, below, rtol=0, atol=1e-9)) | (np.isclose(y, above, rtol=0, atol=1e-9)))
    s = tone(440, 8000, amp=0.5)
    snr = 10 * np.log10(np.sum(s**2) / np.sum((decode(encode(s)) - s) ** 2))
    assert snr > 35  # G.711 gives about 38 dB over most of its range


def test_g711_matches_cpython_audioop_bit_for_bit():
    with warnings.catch_warnings():  # deprecated in 3.11/3.12, gone in 3.13
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    codes = bytes(range(256))
    np.testing.assert_array_equal(np.frombuffer(audioop.ulaw2lin(codes, 2), "<i2"), ULAW_TABLE)
    np.testing.assert_array_equal(np.frombuffer(audioop.alaw2lin(codes, 2), "<i2"), ALAW_TABLE)
    pcm = np.arange(-32768, 32768, dtype="<i2")
    assert float_to_ulaw(pcm / 32768) == audioop.lin2ulaw(pcm.tobytes(), 2)
    assert float_to_alaw(pcm / 32768) == audioop.lin2alaw(pcm.tobytes(), 2)
