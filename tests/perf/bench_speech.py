"""Speech benchmark: TTS time to first audio and real-time factor, ASR real-time
factor, the gRPC overhead of Synthesize against the engine in-process, and
Piper's real-time factor on one thread with the voice's own graph against the
engine's split graph with its 2-D decoder (engines/tts/piper_graph.py), whole and
decoded in windows.

    .venv/bin/python tests/perf/bench_speech.py [--runs 20]

Prints one JSON object. The gRPC and in-process runs alternate (ABAB) in one
run so that machine noise hits both sides alike; figures are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.engines.asr.contract import AsrItem  # noqa: E402
from rtmedia.engines.asr.pocketsphinx import AsrEngine  # noqa: E402
from rtmedia.engines.tts.piper import TtsEngine, TtsItem, split_text  # noqa: E402
from rtmedia.server.session.session import TTS_WINDOW_FRAMES  # noqa: E402
from rtmedia.v1 import speech_pb2, speech_pb2_grpc  # noqa: E402

from tests.support.serve import RTMEDIA, free_port, wait_serving  # noqa: E402
from tests.support.speech import Speaker  # noqa: E402

TEN_WORDS = "The quick brown fox jumps over the lazy sleeping dog."
PARAGRAPH = (
    "Streaming speech should start quickly, and it should keep going without gaps. "
    "This paragraph has several clauses; each one is spoken as soon as it is ready. "
    "The listener hears the first words long before the last ones are synthesised."
)


def machine() -> dict:
    model = ""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.system()}


def report(result: dict, out: Path | None = None) -> None:
    """Print a benchmark's JSON result, and write it to `out` too when given."""
    text = json.dumps(result)
    if out:
        out.write_text(text)
    print(text)


def in_process(tts: TtsEngine, text: str) -> tuple[float, float, float]:
    """(first audio s, total s, audio s) calling the engine chunk by chunk, as the service does."""
    started = time.perf_counter()
    stream = tts.open_stream()
    chunks = split_text(text)
    first = None
    samples = 0
    for n, chunk in enumerate(chunks):
        pcm = tts.step([TtsItem(stream, chunk, final=n == len(chunks) - 1)])[0]
        first = first or time.perf_counter() - started
        samples += len(pcm) // 2
    return first or 0.0, time.perf_counter() - started, samples / stream.output_rate


def over_grpc(stub, text: str) -> tuple[float, float, float]:
    started = time.perf_counter()
    first = None
    samples = 0
    rate = 1
    for reply in stub.Synthesize(speech_pb2.SynthesizeRequest(text=text)):
        first = first or time.perf_counter() - started
        samples += len(reply.audio) // 2
        rate = reply.sample_rate
    return first or 0.0, time.perf_counter() - started, samples / rate


def piper_one_thread_rtf(runs: int) -> dict:
    """The paragraph's sentences on one thread: the voice's own graph, and the engine's latent
    graph + 2-D decoder (whole sentences, and in a session's windows), alternating."""
    import onnxruntime
    from piper.config import PiperConfig, SynthesisConfig
    from piper.voice import PiperVoice

    engine = TtsEngine(intra_op_threads=1)
    engine.load()
    spec = engine.voice("")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    own = PiperVoice(config=PiperConfig.from_dict(spec.config), session=onnxruntime.InferenceSession(
        str(spec.model_path), options, providers=["CPUExecutionProvider"]))
    sentences = [own.phonemes_to_ids(p) for p in own.phonemize(PARAGRAPH) if p]

    def voice_graph() -> int:
        return sum(len(own.phoneme_ids_to_audio(ids, SynthesisConfig(normalize_audio=False))) for ids in sentences)

    def split_graph(window_frames: int) -> int:
        stream = engine.open_stream(window_frames=window_frames)
        pcm = engine.step([TtsItem(stream, PARAGRAPH)])
        while stream.pending:
            pcm += engine.step([TtsItem(stream, "")])
        return len(b"".join(pcm)) // 2

    runs_by_name = {"voice_graph": voice_graph, "split_2d": lambda: split_graph(0),
                    "split_2d_windows": lambda: split_graph(TTS_WINDOW_FRAMES)}
    rtf: dict[str, list[float]] = {name: [] for name in runs_by_name}
    for run in range(runs):
        for name in runs_by_name if run % 2 == 0 else list(runs_by_name)[::-1]:
            start = time.perf_counter()
            samples = runs_by_name[name]()
            rtf[name].append((time.perf_counter() - start) / (samples / spec.native_rate))
    med = {name: statistics.median(values) for name, values in rtf.items()}
    return {f"rtf_{name}": round(value, 4) for name, value in med.items()} | {
        "split_2d_over_voice_graph": round(med["split_2d"] / med["voice_graph"], 3),
        "windows_over_whole": round(med["split_2d_windows"] / med["split_2d"], 3)}


def asr_rtf(runs: int) -> dict:
    speaker = Speaker()
    audio = np.concatenate([speaker.silence(0.5), speaker.say(PARAGRAPH), speaker.silence(1.0)])
    pcm, seconds = audio.tobytes(), len(audio) / 16000
    engine = AsrEngine(workers=1)
    engine.load()
    engine.warmup()
    times = []
    try:
        for _ in range(runs):
            stream = engine.open_stream()
            started = time.perf_counter()
            step = 3200  # 100 ms
            for i in range(0, len(pcm), step):
                engine.step([AsrItem(stream, pcm[i:i + step], end=i + step >= len(pcm))])
            times.append(time.perf_counter() - started)
            engine.close_stream(stream)
    finally:
        engine.close()
    return {"audio_s": round(seconds, 2), "rtf_median": round(statistics.median(times) / seconds, 4),
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    tts = TtsEngine()
    tts.load()
    tts.warmup()
    port = free_port()
    server = subprocess.Popen(
        [RTMEDIA, "serve", "--port", str(port), "--metrics-port", "0",
         "--log-level", "WARNING", "--no-llm", "--responder", "echo"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        target = f"127.0.0.1:{port}"
        wait_serving(target, server)
        with grpc.insecure_channel(target) as channel:
            stub = speech_pb2_grpc.SpeechServiceStub(channel)
            for _ in range(3):  # warm both paths
                over_grpc(stub, TEN_WORDS)
                in_process(tts, TEN_WORDS)
            results: dict[str, list[tuple[float, float, float]]] = {
                "grpc_short": [], "local_short": [], "grpc_long": [], "local_long": []}
            for run in range(args.runs):  # ABBA: neither side always runs second
                pairs = [("grpc", lambda t: over_grpc(stub, t)), ("local", lambda t: in_process(tts, t))]
                for name, call in pairs if run % 2 == 0 else pairs[::-1]:
                    results[f"{name}_short"].append(call(TEN_WORDS))
                    results[f"{name}_long"].append(call(PARAGRAPH))
    finally:
        server.terminate()
        server.wait(timeout=30)

    def med(key: str, index: int) -> float:
        return statistics.median(r[index] for r in results[key])

    report = {
        "benchmark": "speech",
        "machine": machine(),
        "runs": args.runs,
        "tts": {
            "ten_word_first_audio_ms_grpc": round(med("grpc_short", 0) * 1000, 1),
            "ten_word_first_audio_ms_in_process": round(med("local_short", 0) * 1000, 1),
            "paragraph_first_audio_ms_grpc": round(med("grpc_long", 0) * 1000, 1),
            "rtf_in_process": round(med("local_long", 1) / med("local_long", 2), 4),
            "rtf_grpc": round(med("grpc_long", 1) / med("grpc_long", 2), 4),
            "paragraph_audio_s": round(med("local_long", 2), 2),
        },
        "grpc_overhead": {
            "synthesize_total_ratio_paragraph": round(med("grpc_long", 1) / med("local_long", 1), 4),
            "synthesize_total_ratio_ten_words": round(med("grpc_short", 1) / med("local_short", 1), 4),
            "first_audio_ratio_ten_words": round(med("grpc_short", 0) / med("local_short", 0), 4),
        },
        "asr": asr_rtf(max(3, args.runs // 4)),
        "piper_one_thread": piper_one_thread_rtf(max(4, args.runs // 2)),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
