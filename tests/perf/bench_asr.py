"""The recognisers side by side, at the engine: word error rate, final latency, CPU, batching.

    .venv/bin/python tests/perf/bench_asr.py [--engines whisper,pocketsphinx] [--limit N] [--model DIR]
    .venv/bin/python tests/perf/bench_asr.py --engines whisper,whisper-ct2-float32,whisper-torch,whisper-torch-int8
    .venv/bin/python tests/perf/bench_asr.py --capacity talk:12 [--rounds 4] [--duration 30]

Utterances: the sentences of `asr_sentences.txt` (46), said by Piper (`en_US-joe-medium`) and,
where Debian's `espeak-ng` is installed, by espeak-ng. Conditions, each brought to 16 kHz the way
the server does (its G.711 tables and resampler; PyAV for mp3): `clean` (16 kHz), `ulaw8k`
(8 kHz μ-law), `mp3_16k` (16 kbps mp3 at 16 kHz), `noise10db` (white noise at 10 dB SNR).
Each engine gets every utterance as a duplex session's turn: a `segment=False` stream, the
audio in 100 ms items (partials as they come), then the item that ends it alone (the final).
WER is over all words of a set, lowercased, punctuation removed and numbers spelled out.

Figures: WER per voice and condition; the final's latency (the end item's step, one stream,
p50/p95); CPU seconds per second of speech, finals and partials apart (this process's CPU for
Whisper, which runs in it; the worker processes' for PocketSphinx); and for 8 streams ending at
once, one batched step against eight steps one after another; and whether Whisper holds the GIL
while it computes (`gil`: a pure-Python loop's rate while another thread decodes batches of
finals, over its rate alone; with one core per decode on these two, near 1 when the GIL is
released). Prints one JSON object.

`--capacity PROFILE:SESSIONS` measures the servers instead: `rtmedia loadtest --profile PROFILE
--sessions SESSIONS --chunk-ms 20` fixed runs against `rtmedia serve --no-llm --responder echo`
with each `--engines` recogniser, alternating engine by engine and round by round (a fresh
server for each run): SLO held, response and final transcript p95, server CPU per
session-second.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.perf.bench_speech import machine
from tests.support.speech import Speaker

HERE = Path(__file__).resolve().parent
RATE = 16000
ITEM = RATE // 10  # 100 ms
ONES = "zero one two three four five six seven eight nine ten eleven twelve".split()


def spelled(text: str) -> str:
    from tests.support.speech import normalise

    return " ".join(ONES[int(w)] if w.isdigit() and int(w) < len(ONES) else w for w in normalise(text).split())


def wer(pairs: list[tuple[str, str]]) -> float:
    import jiwer

    return round(jiwer.wer([spelled(r) for r, _ in pairs], [spelled(h) or "<empty>" for _, h in pairs]), 4)


def espeak(text: str, voice: str = "") -> np.ndarray | None:
    """espeak-ng's `voice` (its default when "") at 16 kHz (float32), or None where it is not installed."""
    if not shutil.which("espeak-ng"):
        return None
    wav = subprocess.run(["espeak-ng", *(["-v", voice] if voice else []), "--stdout", text], capture_output=True,
                         check=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    from rtmedia.engines.audio.resample import make_resampler

    resampler = make_resampler(rate, RATE)
    return np.concatenate([resampler.process(pcm.astype(np.float32) / 32768), resampler.flush()])


def ulaw8k(audio16k: np.ndarray) -> np.ndarray:
    from rtmedia.engines.audio.resample import float_to_ulaw, make_resampler, ulaw_to_float

    down = make_resampler(RATE, 8000)
    coded = float_to_ulaw(np.concatenate([down.process(audio16k), down.flush()]))
    up = make_resampler(8000, RATE)
    return np.concatenate([up.process(ulaw_to_float(coded)), up.flush()]).astype(np.float32)


def mp3(audio16k: np.ndarray, bitrate: int = 16000) -> np.ndarray:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp3") as out:
        stream = out.add_stream("libmp3lame", rate=RATE, layout="mono")
        stream.bit_rate = bitrate
        frame = av.AudioFrame.from_ndarray((np.clip(audio16k, -1, 1) * 32767).astype("<i2")[None], format="s16",
                                           layout="mono")
        frame.sample_rate = RATE
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    buffer.seek(0)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
    pieces = []
    with av.open(buffer) as source:
        for frame in source.decode(audio=0):
            pieces += [f.to_ndarray()[0] for f in resampler.resample(frame)]
    return np.concatenate(pieces).astype(np.float32) / 32768


def noisy(audio16k: np.ndarray, snr_db: float = 10.0, seed: int = 0) -> np.ndarray:
    power = float(np.mean(np.square(audio16k)))
    noise = np.random.default_rng(seed).standard_normal(audio16k.size) * np.sqrt(power / 10 ** (snr_db / 10))
    return (audio16k + noise).astype(np.float32)


CONDITIONS = {"clean": lambda a: a, "ulaw8k": ulaw8k, "mp3_16k": mp3, "noise10db": noisy}


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


class Cpu:
    """CPU seconds of this process (threads included) plus the given child processes."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def __call__(self) -> float:
        own = time.process_time()
        children = 0.0
        for pid in self.pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            children += (int(fields[11]) + int(fields[12])) / self.tick
        return own + children


def engine_of(name: str, model: str | None = None):
    """`whisper` (CTranslate2, int8), `whisper-RUNTIME[-PRECISION]` (e.g. whisper-torch,
    whisper-ct2-float32; `model`: a Whisper directory instead of the embedded tiny.en), or
    `pocketsphinx`."""
    if name.startswith("whisper"):
        from rtmedia.engines.asr.whisper import WhisperEngine

        _, runtime, compute_type = [*name.split("-", 2), "", ""][:3]
        engine = WhisperEngine(Path(model) if model else None, runtime=runtime or "ct2", compute_type=compute_type)
        engine.load()
        engine.warmup()
        return engine, Cpu([])
    from rtmedia.engines.asr.pocketsphinx import AsrEngine

    engine = AsrEngine(workers=2, decoders=10)
    engine.load()
    engine.warmup()
    return engine, Cpu([p.pid for p in engine._procs])


def turn(engine, cpu: Cpu, pcm: bytes) -> tuple[str, float, float, float]:
    """One utterance as a session's turn: (final text, final step s, partials CPU s, final CPU s)."""
    from rtmedia.engines.asr.contract import AsrItem

    stream = engine.open_stream(segment=False, fast_final=True)
    try:
        before = cpu()
        for i in range(0, len(pcm), 2 * ITEM):
            engine.step([AsrItem(stream, pcm[i : i + 2 * ITEM])])
        middle = cpu()
        started = time.perf_counter()
        [[final]] = engine.step([AsrItem(stream, b"", end=True)], urgent=True)
        took = time.perf_counter() - started
        return final.text, took, middle - before, cpu() - middle
    finally:
        engine.close_stream(stream)


def batching(engine, pcms: list[bytes]) -> dict:
    from rtmedia.engines.asr.contract import AsrItem

    def once(together: bool) -> float:
        streams = [engine.open_stream(segment=False, fast_final=True) for _ in pcms]
        engine.step([AsrItem(s, p) for s, p in zip(streams, pcms, strict=True)])
        started = time.perf_counter()
        if together:
            engine.step([AsrItem(s, b"", end=True) for s in streams])
        else:
            for s in streams:
                engine.step([AsrItem(s, b"", end=True)])
        took = time.perf_counter() - started
        for s in streams:
            engine.close_stream(s)
        return took

    one_by_one, batched = min(once(False) for _ in range(3)), min(once(True) for _ in range(3))
    return {"streams": len(pcms), "one_by_one_s": round(one_by_one, 3), "batched_s": round(batched, 3),
            "speedup": round(one_by_one / batched, 2)}


def gil(engine, pcms: list[bytes], seconds: float = 3.0) -> dict:
    from rtmedia.engines.asr.contract import AsrItem

    def spin() -> float:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count / seconds

    stop, steps = threading.Event(), [0]

    def decode() -> None:
        while not stop.is_set():
            streams = [engine.open_stream(segment=False, fast_final=True) for _ in pcms]
            engine.step([AsrItem(s, p) for s, p in zip(streams, pcms, strict=True)])
            engine.step([AsrItem(s, b"", end=True) for s in streams])
            for s in streams:
                engine.close_stream(s)
            steps[0] += 1

    alone = spin()
    worker = threading.Thread(target=decode)
    worker.start()
    try:
        beside = spin()
    finally:
        stop.set()
        worker.join()
    return {"loop_rate_ratio": round(beside / alone, 3), "decode_rounds": steps[0]}


def capacity(engines: list[str], profile: str, sessions: int, rounds: int, duration: float) -> dict:
    from tests.perf.bench_loadtest import tree_cpu_s
    from tests.perf.bench_realtime_ws import loadtest
    from tests.support.serve import running_server

    runs = []
    for round_ in range(rounds):
        for engine in engines if round_ % 2 == 0 else engines[::-1]:
            with running_server("--asr", engine, "--no-llm", "--responder", "echo", "--max-sessions", "3000",
                                "--log-level", "WARNING") as (target, server):
                cpu0, t0 = tree_cpu_s(server.pid), time.perf_counter()
                report = loadtest(["--target", target, "--profile", profile, "--sessions", str(sessions),
                                   "--chunk-ms", "20", "--duration", str(duration), "--ramp-per-s", "50"])
                cpu, wall = tree_cpu_s(server.pid) - cpu0, time.perf_counter() - t0
            runs.append({"round": round_, "engine": engine, "held": report["slo"]["held"],
                         "verdict": report["slo"]["verdict"],
                         "response_p95_ms": report["response_latency_ms"]["p95"],
                         "transcript_final_p95_ms": report["transcript_final_ms"]["p95"],
                         "server_cpu_ms_per_session_s": round(cpu / wall / sessions * 1000, 2)})
            print(json.dumps(runs[-1]), file=sys.stderr)
    summary = {e: {"held": f"{sum(r['held'] for r in runs if r['engine'] == e)} of {rounds}",
                   "response_p95_ms": sorted(r["response_p95_ms"] or 0 for r in runs if r["engine"] == e),
                   "transcript_final_p95_ms": sorted(r["transcript_final_p95_ms"] or 0 for r in runs
                                                     if r["engine"] == e)} for e in engines}
    return {"profile": profile, "sessions": sessions, "duration_s": duration, "runs": runs, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="whisper,pocketsphinx",
                        help="whisper, whisper-RUNTIME[-PRECISION] (whisper-torch, whisper-torch-int8, whisper-ct2-float32), pocketsphinx")
    parser.add_argument("--model", default=None, metavar="DIR", help="the Whisper engines' model directory")
    parser.add_argument("--limit", type=int, default=0, help="the first N sentences only")
    parser.add_argument("--capacity", default=None, metavar="PROFILE:SESSIONS", help="server capacity runs instead")
    parser.add_argument("--rounds", type=int, default=4, help="--capacity: runs per engine (4)")
    parser.add_argument("--duration", type=float, default=30.0, help="--capacity: seconds per run (30)")
    args = parser.parse_args()
    if args.capacity:
        profile, _, sessions = args.capacity.partition(":")
        print(json.dumps({"benchmark": "asr-capacity", "machine": machine(),
                          **capacity(args.engines.split(","), profile, int(sessions), args.rounds, args.duration)}))
        return
    sentences = (HERE / "asr_sentences.txt").read_text().split("\n")
    sentences = [s for s in sentences if s][: args.limit or None]
    speaker = Speaker()
    voices = {"piper": [speaker.float_audio(s) * 0.8 for s in sentences]}
    if shutil.which("espeak-ng"):
        voices["espeak"] = [espeak(s) for s in sentences]
    sets = {(v, c): [pcm16(make(a)) for a in audios] for v, audios in voices.items() for c, make in CONDITIONS.items()}
    result: dict = {"benchmark": "asr", "machine": machine(), "utterances": len(sentences),
                    "voices": sorted(voices), "engines": {}}
    for name in args.engines.split(","):
        engine, cpu = engine_of(name, args.model)
        figures: dict = {"wer": {}}
        latencies, partial_cpu, final_cpu, speech_s = [], 0.0, 0.0, 0.0
        for (voice, condition), pcms in sets.items():
            pairs = []
            for text, pcm in zip(sentences, pcms, strict=True):
                heard, took, partials, final = turn(engine, cpu, pcm)
                pairs.append((text, heard))
                if condition == "clean":
                    latencies.append(took)
                    partial_cpu, final_cpu, speech_s = partial_cpu + partials, final_cpu + final, speech_s + len(pcm) / 2 / RATE
            figures["wer"][f"{voice}/{condition}"] = wer(pairs)
        figures["final_ms"] = {"p50": round(float(np.percentile(latencies, 50)) * 1000, 1),
                               "p95": round(float(np.percentile(latencies, 95)) * 1000, 1)}
        figures["cpu_per_speech_s"] = {"partials": round(partial_cpu / speech_s, 4),
                                       "finals": round(final_cpu / speech_s, 4),
                                       "all": round((partial_cpu + final_cpu) / speech_s, 4)}
        figures["batch_of_8"] = batching(engine, sets["piper", "clean"][:8])
        if name.startswith("whisper"):
            figures["gil"] = gil(engine, sets["piper", "clean"][:4])
        engine.close()
        result["engines"][name] = figures
    print(json.dumps(result))


if __name__ == "__main__":
    main()
