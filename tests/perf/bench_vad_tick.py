"""The VAD tick lane's cost per session, offline: what `listen` capacity is made of.

    .venv/bin/python tests/perf/bench_vad_tick.py [--sessions 500] [--seconds 4]

N sessions stream the loadtest's Piper sentences (16 kHz, 1-2.5 s silences
between them) in 100 ms chunks at staggered phases; the tick runs every 32 ms of
simulated time over every session's inbox (`VadTick.collect/process/deliver`,
exactly as the server's lane does, without gRPC or the event loop). Reported per
setting of the engine's `parallel_runs`: the tick's wall time and the process's
CPU time per second of audio (the fraction of one thread / of the cores a
realtime server spends on it), microseconds per window, and the same windows
through `VadEngine.step_blocks` alone (the Silero model plus the engine's batching) as
the floor the tick is compared with. Also the Silero network itself: the wheel's
`silero_vad.onnx` against the batch-wide graph the engine builds from it
(`engines/vad/silero_graph.py`), microseconds per row on one thread at 1, 32 and 500
rows, alternating. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.clients.audio_file import read_audio  # noqa: E402
from rtmedia.clients.loadtest.speech import synthesized  # noqa: E402
from rtmedia.engines.vad.silero import WINDOW, VadEngine  # noqa: E402
from rtmedia.server.hearing.audio_input import AudioInput, VadTick  # noqa: E402
from rtmedia.server.session.config import SessionSettings  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402

RATE = 16000
CHUNK_MS = 100
TICK_MS = 32


def streams(sessions: int, seconds: float) -> list[bytes]:
    """Each session's input: sentences and 1-2.5 s silences from a random point, PCM16."""
    clips = [read_audio(p).samples for p in synthesized()]
    rng = random.Random(1)
    out = []
    for _ in range(sessions):
        parts: list[np.ndarray] = []
        while sum(map(len, parts)) < RATE * (seconds + 3):
            parts += [np.zeros(int(RATE * rng.uniform(1.0, 2.5)), np.int16), rng.choice(clips)]
        out.append(np.concatenate(parts)[int(rng.uniform(0, 2) * RATE):].tobytes())
    return out


def tick_run(engine: VadEngine, audio: list[bytes], seconds: float) -> dict:
    tick = VadTick(engine)
    settings = SessionSettings(input_rate=RATE, transcription=False)
    events = [0]

    def deliver(actions: list) -> None:
        events[0] += sum(kind in ("started", "stopped") for kind, _ in actions)

    inputs = [AudioInput(settings, 2000, deliver, engine.open_stream()) for _ in audio]
    tick.inputs.update(inputs)
    chunk = RATE * CHUNK_MS // 1000 * 2
    phase = [random.Random(n).randrange(CHUNK_MS) for n in range(len(audio))]
    sent = [0] * len(audio)
    wall = cpu = 0.0
    now_ms = 0
    while now_ms < seconds * 1000:
        now_ms += TICK_MS
        for n, inp in enumerate(inputs):
            while phase[n] + sent[n] * CHUNK_MS <= now_ms:
                inp.append(audio[n][sent[n] * chunk:(sent[n] + 1) * chunk])
                sent[n] += 1
        w0, c0 = time.perf_counter(), time.process_time()
        work = tick.collect()
        tick.deliver(tick.process(work))
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
    windows = sum(n * chunk // 2 // WINDOW for n in sent)  # (to within a window per session)
    return {"tick_wall_per_audio_s": round(wall / seconds, 3), "cpu_per_audio_s": round(cpu / seconds, 3),
            "us_per_window_wall": round(wall / windows * 1e6, 1), "us_per_window_cpu": round(cpu / windows * 1e6, 1),
            "windows": windows, "turn_events": events[0]}


def engine_alone(engine: VadEngine, audio: list[bytes], seconds: float) -> dict:
    """The same windows through VadEngine.step_blocks, one call per 32 ms of audio."""
    per_tick = TICK_MS * RATE // 1000 // WINDOW or 1
    floats = [np.frombuffer(a, "<i2").astype(np.float32) / 32768 for a in audio]
    vads = [engine.open_stream() for _ in audio]
    steps = int(seconds * 1000 / TICK_MS)
    wall = cpu = 0.0
    for k in range(steps):
        blocks = [(s, f[k * per_tick * WINDOW:(k + 1) * per_tick * WINDOW]) for s, f in zip(vads, floats, strict=True)]
        w0, c0 = time.perf_counter(), time.process_time()
        engine.step_blocks(blocks)
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
    windows = steps * per_tick * len(audio)
    return {"us_per_window_wall": round(wall / windows * 1e6, 1), "us_per_window_cpu": round(cpu / windows * 1e6, 1)}


def graphs(rounds: int = 3) -> dict:
    """The wheel's model and the batch-wide graph, us per row on one thread, alternating."""
    import onnxruntime
    from rtmedia.engines.vad.silero import model_path
    from rtmedia.engines.vad.silero_graph import batched_model

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    wheel = onnxruntime.InferenceSession(model_path(), options, providers=["CPUExecutionProvider"])
    batched = onnxruntime.InferenceSession(batched_model(model_path()), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    out: dict = {}
    for rows in (1, 32, 500):
        x = rng.normal(0, 0.1, (rows, 576)).astype(np.float32)
        state = np.zeros((2, rows, 128), np.float32)
        feeds = {"wheel": (wheel, {"input": x, "state": state, "sr": np.array(RATE, np.int64)}),
                 "batched": (batched, {"input": x, "state": state})}
        times: dict[str, list[float]] = {name: [] for name in feeds}
        for _ in range(rounds):
            for name, (session, feed) in feeds.items():
                calls = max(5, 2000 // rows)
                session.run(None, feed)
                start = time.perf_counter()
                for _ in range(calls):
                    session.run(None, feed)
                times[name].append((time.perf_counter() - start) / calls / rows * 1e6)
        out[f"rows_{rows}"] = {"wheel_us_per_row": [round(t, 1) for t in times["wheel"]],
                               "batched_us_per_row": [round(t, 1) for t in times["batched"]],
                               "wheel_over_batched": round(min(times["wheel"]) / min(times["batched"]), 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of audio per session")
    args = parser.parse_args()
    audio = streams(args.sessions, args.seconds)
    result: dict = {"benchmark": "vad_tick", "machine": machine(), "sessions": args.sessions,
                    "chunk_ms": CHUNK_MS, "audio_s": args.seconds}
    result["silero_graph"] = graphs()
    for runs in (1, 2):
        engine = VadEngine(parallel_runs=runs)
        engine.load()
        engine.warmup()
        tick = tick_run(engine, audio, args.seconds)
        alone = engine_alone(engine, audio, args.seconds)
        tick["cpu_over_engine_alone"] = round(tick["us_per_window_cpu"] / alone["us_per_window_cpu"], 3)
        result[f"parallel_runs_{runs}"] = {"tick": tick, "engine_alone": alone}
        engine.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
