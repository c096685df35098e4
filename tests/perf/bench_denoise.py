"""Noise suppression (engines/audio/denoise.py) against room noise: false turn starts, word error rate, CPU, delay.

    .venv/bin/python tests/perf/bench_denoise.py [--limit N] [--backends NAME,...]

Noise (a minute of each, 16 kHz, at the room levels of `NOISE_DBFS`, set against Piper's voice
at the level `bench_asr.py` uses): `white` (a fan), `hum` (mains at 50 Hz, then 60 Hz, with
harmonics), `music` (chords of harmonic tones changing every half second over a bass line),
`keyboard` (typing: key-down and key-up clicks of decaying filtered noise at a typist's pace)
and `babble` (ten talkers, each a different set of Piper sentences sped up or slowed down so
that the voices differ, with pauses, summed). For "off" and each backend: turns the server
would start on noise alone (`false_starts_per_min`: `speech_started` events of Silero VAD,
`VadEngine.step_blocks` over 512-sample windows, through `TurnDetector` with the server_vad
defaults; the denoiser fed 32 ms chunks, as the VAD tick does), the share of the time a turn
stood open (`in_turn_pct`), and how much quieter the noise came out (`noise_reduction_db`).

Word error rate: the sentences of `asr_sentences.txt`, said by Piper, each with a second of
noise before it (the suppressor adapts, as in a session) and half a second after, mixed with
white noise or babble (made of other sentences than the one said) at 10 and 5 dB SNR (speech
power over noise power, as `bench_asr.noisy`). The recogniser (`WhisperEngine`) gets the turn
as the server would commit it, from 300 ms before the speech to the end, as one final per
utterance (finals batched across utterances; a final decodes the whole utterance afresh, the
partials only shape the interim text). Routings: `off`
(the raw audio), and each backend's denoised audio to the recogniser. Routing the denoised
audio to the VAD only gives the recogniser the raw audio, so its WER is the `off` column.
WER as `bench_asr.wer` (lowercased, punctuation removed, numbers spelled out). The same
mixtures through the VAD and turn detector, whole (`vad_on_sentences`): the share of the
sentence's windows with a turn open, and of the second of noise before it.

Cost (`cpu`): process CPU seconds per second of audio for one stream on one thread (noisy speech
in 32 ms chunks) and the time to open a stream. Delay
(`delay_ms`): the fixed buffering of `DenoiseStream.delay_samples` and the backend's own delay,
the lag that best aligns the denoised clean speech with the input; `clean_gain_db`: the level of
clean speech after the backend over before. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.perf.bench_asr import pcm16, wer
from tests.perf.bench_speech import machine
from tests.support.speech import Speaker

HERE = Path(__file__).resolve().parent
RATE = 16000
CHUNK = 512  # the VAD tick's 32 ms
NOISE_S = 60
SPEECH_GAIN = 0.8  # Piper's voice at bench_asr's level (about -20 dBFS while speaking)
# Room noise (RMS dBFS) against that voice, taken as conversational speech at the microphone:
# a fan or air conditioning, mains hum from a cheap interface, music in the background, typing
# next to the microphone, a busy cafe.
NOISE_DBFS = {"white": -45.0, "hum": -45.0, "music": -32.0, "keyboard": -38.0, "babble": -30.0}
PRE_S, POST_S, PREFIX_S = 1.0, 0.5, 0.3  # noise before and after each sentence; the turn's prefix padding
ALL_BACKENDS = "rnnoise,deepfilternet,deepfilternet_limited,webrtc,webrtc_agc"


def level(x: np.ndarray, dbfs: float) -> np.ndarray:
    return (x * (10 ** (dbfs / 20) / np.sqrt(np.mean(np.square(x, dtype=np.float64))))).astype(np.float32)


def db(x: np.ndarray) -> float:
    return 10 * float(np.log10(np.mean(np.square(x, dtype=np.float64)) + 1e-20))


# -- noise ------------------------------------------------------------------------------------


def white(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(n).astype(np.float32)


def hum(n: int, rng: np.random.Generator) -> np.ndarray:
    """Mains hum: 50 Hz for the first half, 60 Hz for the second, odd harmonics strongest."""
    t = np.arange(n) / RATE
    out = np.zeros(n)
    for half, mains in ((slice(0, n // 2), 50), (slice(n // 2, n), 60)):
        for k in range(1, 16):
            amp = (1.0 if k % 2 else 0.4) / k
            out[half] += amp * np.sin(2 * np.pi * mains * k * t[half] + rng.uniform(0, 2 * np.pi))
    return out.astype(np.float32)


def music(n: int, rng: np.random.Generator) -> np.ndarray:
    """Chords of three harmonic tones and a bass note, a new chord every half second."""
    roots = [57, 62, 64, 60, 55, 65]  # MIDI notes of the chord roots
    step = RATE // 2
    out = np.zeros(n + step)
    t = np.arange(step) / RATE
    env = np.minimum(1, t / 0.02) * np.exp(-t / 0.6)
    for start in range(0, n, step):
        root = roots[rng.integers(len(roots))]
        notes = [root, root + (3 if rng.random() < 0.4 else 4), root + 7, root - 12]
        for note in notes:
            f = 440 * 2 ** ((note - 69) / 12)
            tone = sum(np.sin(2 * np.pi * f * h * t) / h**1.5 for h in range(1, 6) if f * h < RATE / 2)
            out[start : start + step] += env * tone
    return out[:n].astype(np.float32)


def keyboard(n: int, rng: np.random.Generator) -> np.ndarray:
    """Typing: keys about 6 a second in bursts, each a key-down and a softer key-up click."""
    from scipy.signal import butter, sosfilt

    out = np.zeros(n + RATE)
    sos = butter(2, [1500, 6000], btype="band", fs=RATE, output="sos")
    pos = 0
    while pos < n:
        for _ in range(rng.integers(3, 15)):  # a word or two, then a pause
            if pos >= n:
                break
            for gain, offset in ((1.0, 0), (0.5, int(rng.uniform(0.06, 0.12) * RATE))):
                length = int(rng.uniform(0.004, 0.012) * RATE)
                click = sosfilt(sos, rng.standard_normal(length * 3)) * np.exp(-np.arange(length * 3) / length)
                at = pos + offset
                out[at : at + click.size] += gain * rng.uniform(0.5, 1.0) * click
            pos += int(rng.uniform(0.1, 0.25) * RATE)
        pos += int(rng.uniform(0.3, 1.5) * RATE)
    return out[:n].astype(np.float32)


class Babble:
    """Talkers made of Piper sentences, each talker's voice sped up or slowed down (pitch and pace)."""

    SPEEDS = (0.8, 1.08, 0.86, 1.14, 0.91, 1.2, 0.83, 1.11, 0.88, 1.17)  # none is the voice said

    def __init__(self, voices: list[np.ndarray]) -> None:
        self.voices = voices
        self._cache: dict[tuple[int, float], np.ndarray] = {}

    def said(self, sentence: int, speed: float) -> np.ndarray:
        from scipy.signal import resample_poly

        key = (sentence, speed)
        if key not in self._cache:
            x = self.voices[sentence]
            self._cache[key] = x if speed == 1.0 else resample_poly(x, 100, round(100 * speed)).astype(np.float32)
        return self._cache[key]

    def talker(self, sentences: list[int], speed: float, n: int, rng: np.random.Generator) -> np.ndarray:
        """The sentences in turn, with pauses, from a random point, looped to n samples."""
        parts, size = [], 0
        while size < n + 10 * RATE:
            for s in sentences:
                parts += [self.said(s, speed), np.zeros(int(rng.uniform(0.1, 0.6) * RATE), np.float32)]
                size += parts[-2].size + parts[-1].size
        track = np.concatenate(parts)
        start = rng.integers(0, track.size - n)
        return level(track[start : start + n], -20.0)

    def mix(self, talkers: list[list[int]], n: int, rng: np.random.Generator) -> np.ndarray:
        return np.sum([self.talker(s, self.SPEEDS[k % len(self.SPEEDS)], n, rng)
                       for k, s in enumerate(talkers)], axis=0)


def noises(babble: Babble) -> dict[str, np.ndarray]:
    n, rng = NOISE_S * RATE, np.random.default_rng(7)
    count = len(babble.voices)
    made = {"white": white(n, rng), "hum": hum(n, rng), "music": music(n, rng), "keyboard": keyboard(n, rng),
            "babble": babble.mix([list(range(k, count, 10)) for k in range(10)], n, rng)}
    return {name: level(x, NOISE_DBFS[name]) for name, x in made.items()}


# -- measurements -----------------------------------------------------------------------------


def denoised(denoiser, kind: str, audio: np.ndarray) -> np.ndarray:
    """The audio through a fresh stream in the VAD tick's 32 ms chunks."""
    stream = denoiser.open_stream(kind)
    try:
        return np.concatenate([denoiser.process(stream, audio[i : i + CHUNK]) for i in range(0, audio.size, CHUNK)])
    finally:
        denoiser.close_stream(stream)


def turns(vad, signals: list[np.ndarray]) -> list[tuple[int, np.ndarray]]:
    """For each signal, through its own VAD stream and turn detector with the server_vad defaults:
    the `speech_started` events and, per 512-sample window, whether a turn was open."""
    from rtmedia.server.hearing.turns import TurnDetector

    blocks = [(vad.open_stream(), x[: x.size // CHUNK * CHUNK]) for x in signals]
    out = []
    for probs in vad.step_blocks(blocks):
        detector = TurnDetector(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)
        starts, open_ = 0, np.zeros(probs.size, bool)
        for i, p in enumerate(probs.tolist()):
            event = detector.push(p)
            starts += event is not None and event.kind == "speech_started"
            open_[i] = detector.in_speech
        out.append((starts, open_))
    return out


def false_starts(vad, signals: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per noise: speech_started events per minute, and the share of the time a turn was open."""
    out = {}
    for name, (starts, open_) in zip(signals, turns(vad, list(signals.values())), strict=True):
        out[name] = {"starts_per_min": round(starts / (open_.size * CHUNK / RATE / 60), 2),
                     "in_turn_pct": round(100 * float(open_.mean()), 1)}
    return out


def turn_cover(vad, audios: list[np.ndarray], speech_sizes: list[int]) -> dict[str, float]:
    """Share of the speech's windows with a turn open (the sentence heard), and of the second of
    noise before it (a turn opened on noise)."""
    pre = int(PRE_S * RATE) // CHUNK
    speech, noise = [], []
    for (_, open_), size in zip(turns(vad, audios), speech_sizes, strict=True):
        speech.append(open_[pre : pre + size // CHUNK].mean())
        noise.append(open_[:pre].mean())
    return {"speech_in_turn_pct": round(100 * float(np.mean(speech)), 1),
            "noise_in_turn_pct": round(100 * float(np.mean(noise)), 1)}


def finals(engine, audios: list[np.ndarray]) -> list[str]:
    """Each audio as one utterance's final, 16 utterances to a step."""
    from rtmedia.engines.asr.contract import AsrItem

    texts = []
    for i in range(0, len(audios), 16):
        streams = [engine.open_stream(segment=False, fast_final=True) for _ in audios[i : i + 16]]
        try:
            results = engine.step([AsrItem(s, pcm16(a), end=True) for s, a in zip(streams, audios[i : i + 16],
                                                                                  strict=True)])
            texts += [" ".join(r.text for r in events if r.is_final) for events in results]
        finally:
            for s in streams:
                engine.close_stream(s)
    return texts


def mixtures(voices: list[np.ndarray], count: int, babble: Babble) -> dict[str, list[np.ndarray]]:
    """For each noise and SNR, each sentence with noise: PRE_S before, POST_S after."""
    pre, post = int(PRE_S * RATE), int(POST_S * RATE)
    sets: dict[str, list[np.ndarray]] = {}
    for noise in ("white", "babble"):
        for snr in (10, 5):
            rng = np.random.default_rng(snr)
            mixed = []
            for i, speech in enumerate(voices[:count]):
                n = pre + speech.size + post
                if noise == "white":
                    bed = white(n, rng)
                else:  # eight talkers, none saying sentence i
                    bed = babble.mix([[(i + 1 + 5 * k) % len(voices)] for k in range(8)], n, rng)
                power = np.mean(np.square(speech, dtype=np.float64))
                bed = bed * np.sqrt(power / 10 ** (snr / 10) / np.mean(np.square(bed, dtype=np.float64)))
                mixed.append((np.pad(speech, (pre, post)) + bed).astype(np.float32))
            sets[f"{noise}/{snr}db"] = mixed
    return sets


def cost(backend: str, audio: np.ndarray) -> dict:
    from rtmedia.engines.audio.denoise import Denoiser

    denoiser = Denoiser({"near_field": backend})
    denoised(denoiser, "near_field", audio[: RATE])  # libraries loaded, caches warm
    cpu = time.process_time()
    denoised(denoiser, "near_field", audio)
    cpu = time.process_time() - cpu
    started = time.perf_counter()
    streams = [denoiser.open_stream("near_field") for _ in range(4)]
    opened = (time.perf_counter() - started) / len(streams)
    for s in streams:
        denoiser.close_stream(s)
    return {"cpu_per_stream_s": round(cpu / (audio.size / RATE), 4), "open_ms": round(opened * 1000, 2)}


def delay(backend: str, clean: np.ndarray) -> dict:
    """Fixed buffering and the backend's own delay (the best-aligning lag of denoised clean speech)."""
    from rtmedia.engines.audio.denoise import Denoiser

    denoiser = Denoiser({"near_field": backend})
    stream = denoiser.open_stream("near_field")
    buffered = stream.delay_samples
    denoiser.close_stream(stream)
    out = denoised(denoiser, "near_field", np.pad(clean, (0, RATE)))
    size = 1 << int(np.ceil(np.log2(out.size * 2)))
    xcorr = np.fft.irfft(np.fft.rfft(out, size) * np.conj(np.fft.rfft(clean, size)), size)
    lag = int(np.argmax(xcorr[: RATE // 5]))
    return {"buffer": round(buffered / RATE * 1000, 2), "algorithmic": round((lag - buffered) / RATE * 1000, 2),
            "total": round(lag / RATE * 1000, 2),
            "clean_gain_db": round(db(out[lag : lag + clean.size]) - db(clean), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=0, help="the first N sentences only (WER)")
    parser.add_argument("--backends", default=ALL_BACKENDS)
    args = parser.parse_args()
    started = time.perf_counter()
    from rtmedia.engines.asr.whisper import WhisperEngine
    from rtmedia.engines.audio.denoise import Denoiser
    from rtmedia.engines.vad.silero import VadEngine

    backends = args.backends.split(",")
    sentences = [s for s in (HERE / "asr_sentences.txt").read_text().split("\n") if s]
    count = min(args.limit or len(sentences), len(sentences))
    speaker = Speaker()
    voices = [speaker.float_audio(s) * SPEECH_GAIN for s in sentences]  # all of them: babble's talkers
    babble = Babble(voices)
    rooms = noises(babble)
    sets = mixtures(voices, count, babble)
    prefix = int((PRE_S - PREFIX_S) * RATE)
    vad = VadEngine()
    vad.load()
    asr = WhisperEngine()
    asr.load()
    asr.warmup()
    result: dict = {"benchmark": "denoise", "machine": machine(), "sentences": count, "noise_dbfs": NOISE_DBFS,
                    "false_starts_per_min": {"off": false_starts(vad, rooms)},
                    "noise_reduction_db": {}, "wer": {}, "vad_on_sentences": {}, "cpu": {}, "delay_ms": {}}
    references = sentences[:count]
    sizes = [v.size for v in voices[:count]]
    for name, audios in sets.items():
        result["wer"][name] = {"off": wer(list(zip(references, finals(asr, [a[prefix:] for a in audios]),
                                                   strict=True)))}
        result["vad_on_sentences"][name] = {"off": turn_cover(vad, audios, sizes)}
    speech = np.concatenate(voices[:8])
    noisy_speech = sets["white/10db"][0]
    for backend in backends:
        denoiser = Denoiser({"near_field": backend})
        outs = {name: denoised(denoiser, "near_field", x) for name, x in rooms.items()}
        result["false_starts_per_min"][backend] = false_starts(vad, outs)
        result["noise_reduction_db"][backend] = {name: round(db(rooms[name][RATE:]) - db(outs[name][RATE:]), 1)
                                                 for name in rooms}
        for name, audios in sets.items():
            cleaned = [denoised(denoiser, "near_field", a) for a in audios]
            result["wer"][name][backend] = wer(list(zip(references, finals(asr, [c[prefix:] for c in cleaned]),
                                                        strict=True)))
            result["vad_on_sentences"][name][backend] = turn_cover(vad, cleaned, sizes)
        result["cpu"][backend] = cost(backend, np.tile(noisy_speech, -(-30 * RATE // noisy_speech.size)))
        result["delay_ms"][backend] = delay(backend, speech)
        print(json.dumps({backend: round(time.perf_counter() - started, 1)}), file=sys.stderr)
    result["routing"] = {"off": "the raw audio to the VAD and the recogniser",
                         "vad_only": "denoised audio to the VAD only: the recogniser's WER is the off column",
                         "denoised": "denoised audio to the VAD and the recogniser: each backend's column"}
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    asr.close()
    vad.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
