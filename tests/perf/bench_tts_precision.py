"""Piper's decoder in bfloat16 (OpenVINO) against float32 (onnxruntime): speed and closeness.

Speed: the talk profile's replies ("You said:" and a loadtest sentence, decoded in a session's
windows at 24 kHz) synthesised on one thread by two engines in alternating rounds; audio
seconds per CPU second of the whole synthesis (latent pass, decoder, resampling).

Closeness, per sentence with the durations fixed (noise_w 0): the float32 decode of one draw
of the latent frames is the reference; "bf16" is the bfloat16 decode of the same frames, and
"another draw" the float32 decode of a second draw (Piper samples noise in its latent pass,
so two syntheses of the same text differ this much). Mean log-mel L1 distance (80 bands,
1024-point frames) and SNR.

    .venv/bin/python tests/perf/bench_tts_precision.py [--rounds 4]

Prints one JSON object. Needs a CPU with native bfloat16.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rtmedia.clients.loadtest.speech import SENTENCES
from rtmedia.engines.tts.piper import TtsEngine, TtsItem
from rtmedia.engines.tts.piper_bf16 import bf16_unavailable

WINDOW_FRAMES = 48  # as a session decodes


def replies() -> list[str]:
    return [text for sentence in SENTENCES for text in ("You said:", sentence)]


def synthesise(engine: TtsEngine, texts: list[str]) -> float:
    """Seconds of 24 kHz audio."""
    samples = 0
    for text in texts:
        stream = engine.open_stream(output_rate=24000, window_frames=WINDOW_FRAMES)
        out = engine.step([TtsItem(stream, text)])
        while stream.pending:
            out += engine.step([TtsItem(stream, "")])
        out += engine.step([TtsItem(stream, "", final=True)])
        samples += sum(len(b) for b in out) // 2
    return samples / 24000


def log_mel(audio: np.ndarray, rate: int, bands: int = 80, n_fft: int = 1024, hop: int = 256) -> np.ndarray:
    def mel(f: np.ndarray) -> np.ndarray:
        return 2595 * np.log10(1 + f / 700)

    edges = 700 * (10 ** (np.linspace(0, mel(np.array(rate / 2)), bands + 2) / 2595) - 1)
    bins = np.fft.rfftfreq(n_fft, 1 / rate)
    bank = np.stack([np.clip(np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), 0, None)
                     for lo, mid, hi in zip(edges, edges[1:], edges[2:], strict=False)])
    padded = np.pad(audio, n_fft // 2)
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop] * np.hanning(n_fft)
    return np.log(bank @ (np.abs(np.fft.rfft(frames, axis=1)) ** 2).T + 1e-5)


def snr_db(want: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10((want ** 2).sum() / ((want - got) ** 2).sum()))


def closeness(fp32: TtsEngine, bf16: TtsEngine) -> dict:
    ref_voice, bf16_voice = fp32._loaded(fp32.default_voice, True), bf16._loaded(bf16.default_voice, True)
    rate = fp32.voice("").native_rate
    piper = ref_voice.piper
    c = piper.config
    rows: dict[str, list[tuple[float, float]]] = {"bf16": [], "another draw": []}
    for sentence in SENTENCES:
        ids = np.array([piper.phonemes_to_ids(next(p for p in piper.phonemize(sentence) if p))], np.int64)
        feeds = {"input": ids, "input_lengths": np.array([ids.shape[1]], np.int64),
                 "scales": np.array([c.noise_scale, c.length_scale, 0.0], np.float32)}
        first, second = (ref_voice.latent.run(None, feeds)[0] for _ in range(2))
        frames = first.shape[2]
        want = fp32._decode(ref_voice, first, 0, frames)
        for name, got in (("bf16", bf16._decode(bf16_voice, first, 0, frames)),
                          ("another draw", fp32._decode(ref_voice, second, 0, frames))):
            rows[name].append((float(np.abs(log_mel(want, rate) - log_mel(got, rate)).mean()), snr_db(want, got)))
    return {name: {"log_mel_l1": round(float(np.mean([d for d, _ in r])), 3),
                   "snr_db": round(float(np.mean([s for _, s in r])), 1)} for name, r in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if bf16_unavailable():
        raise SystemExit(f"bench_tts_precision: {bf16_unavailable()}")
    engines = {name: TtsEngine(intra_op_threads=1, precision=name) for name in ("fp32", "bf16")}
    for engine in engines.values():
        engine.load()
        engine.warmup()
    texts = replies()
    audio = dict.fromkeys(engines, 0.0)
    cpu = dict.fromkeys(engines, 0.0)
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            start = time.thread_time()
            audio[name] += synthesise(engines[name], texts)
            cpu[name] += time.thread_time() - start
    speed = {name: round(audio[name] / cpu[name], 1) for name in engines}
    print(json.dumps({
        "audio_s_per_cpu_s": speed, "bf16_over_fp32": round(speed["bf16"] / speed["fp32"], 2),
        "closeness_to_fp32": closeness(engines["fp32"], engines["bf16"]),
    }))


if __name__ == "__main__":
    main()
