"""OpenAI's audio HTTP APIs on the web front, against the gRPC calls beneath them, in one run.

    .venv/bin/python tests/perf/bench_openai.py [--rounds 20] [--transcribe-seconds 60]

One `rtmedia serve --no-llm --responder echo --web` process. For each round and each format (pcm, mp3, opus), in
alternating order, the same sentence is asked of `SpeechService.Synthesize` over gRPC (the time
to its first chunk, which carries audio) and of `POST /v1/audio/speech` with the official SDK's
streaming response (the time to the first audio-carrying byte: the end of the shortest prefix
of the body that PyAV decodes to at least one sample, so a container header sent early does
not count). Prints one JSON object: per format the p50/p95 of both and the p50 difference
(targets: pcm within 10 ms, mp3 and opus within 40 ms). Then a `--transcribe-seconds` file of
speech and pauses (mp3) is posted to `/v1/audio/transcriptions`, `--transcribe-runs` times:
its wall time, real-time factor and how many times faster than real time (target: 5).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import av  # noqa: E402
import grpc  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
from rtmedia.v1 import speech_pb2, speech_pb2_grpc  # noqa: E402

from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402
from tests.support.speech import Speaker, wer  # noqa: E402
from tests.support.webrtc import wait_http  # noqa: E402

SENTENCE = "The quarterly report shows steady growth in every region we serve."
FORMATS = ("pcm", "mp3", "opus")
TARGET_MS = {"pcm": 10.0, "mp3": 40.0, "opus": 40.0}
RATE = 24000  # the OpenAI door's default output rate
STORY = [
    "The weather today is sunny with a light breeze from the west.",
    "Please remember to buy milk, bread and eggs on your way home.",
    "Our meeting starts at nine o'clock in the large conference room.",
    "The library opens at ten on Sunday morning and closes at six.",
    "Trains to the airport leave every twenty minutes from platform four.",
]


def decodes_audio(data: bytes, fmt: str) -> bool:
    """Whether `data` (a prefix of a response body) holds at least one decodable sample."""
    if fmt == "pcm":
        return len(data) >= 2
    try:
        with av.open(io.BytesIO(data), "r") as container:
            for frame in container.decode(audio=0):
                if frame.samples:
                    return True
    except (av.error.FFmpegError, ValueError, IndexError, StopIteration):
        return False
    return False


def first_audio_s(started: float, chunks: list[tuple[float, bytes]], fmt: str) -> float | None:
    """Seconds from `started` to the chunk that completed the first decodable audio."""
    data = b""
    for at, chunk in chunks:
        data += chunk
        if decodes_audio(data, fmt):
            return at - started
    return None


async def grpc_first_chunk(stub: Any) -> float:
    started = time.perf_counter()
    call = stub.Synthesize(speech_pb2.SynthesizeRequest(text=SENTENCE, sample_rate=RATE))
    first = None
    async for response in call:
        if first is None and response.audio:
            first = time.perf_counter() - started
    assert first is not None, "Synthesize sent no audio"
    return first


async def http_first_audio(client: openai.AsyncOpenAI, fmt: str) -> float:
    started = time.perf_counter()
    chunks: list[tuple[float, bytes]] = []
    async with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=SENTENCE,
                                                                    response_format=fmt) as response:
        async for chunk in response.iter_bytes():
            chunks.append((time.perf_counter(), chunk))
    first = first_audio_s(started, chunks, fmt)
    assert first is not None, f"/v1/audio/speech ({fmt}) sent no decodable audio"
    return first


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


async def speech_side_by_side(address: str, web_url: str, rounds: int) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {f: {"grpc": [], "http": []} for f in FORMATS}
    async with grpc.aio.insecure_channel(address) as channel, \
            openai.AsyncOpenAI(base_url=f"{web_url}/v1", api_key="bench", max_retries=0) as client:
        stub = speech_pb2_grpc.SpeechServiceStub(channel)
        for fmt in FORMATS:  # warm both paths and the encoders
            await grpc_first_chunk(stub)
            await http_first_audio(client, fmt)
        for n in range(rounds):
            for fmt in FORMATS:
                pair = [("grpc", grpc_first_chunk(stub)), ("http", http_first_audio(client, fmt))]
                for side, run in pair if n % 2 else pair[::-1]:
                    times[fmt][side].append(await run)
    out = {}
    for fmt, sides in times.items():
        grpc_p50, http_p50 = statistics.median(sides["grpc"]), statistics.median(sides["http"])
        out[fmt] = {"grpc_first_chunk_ms": {"p50": _ms(sides["grpc"], 0.5), "p95": _ms(sides["grpc"], 0.95)},
                    "http_first_audio_ms": {"p50": _ms(sides["http"], 0.5), "p95": _ms(sides["http"], 0.95)},
                    "p50_difference_ms": round(1000 * (http_p50 - grpc_p50), 2), "target_ms": TARGET_MS[fmt]}
    return out


def speech_file(seconds: float) -> tuple[bytes, str, float]:
    """An mp3 of the STORY's sentences with pauses, about `seconds` long: (bytes, text, duration)."""
    speaker, rate = Speaker(), 24000
    parts, said, total = [], [], 0.0
    while total < seconds:
        for text in STORY:
            speech = speaker.say(text, rate)
            pause = np.zeros(int(rate * 1.2), np.int16)
            parts += [speech, pause]
            said.append(text)
            total += (len(speech) + len(pause)) / rate
            if total >= seconds:
                break
    pcm = np.concatenate(parts)
    out = io.BytesIO()
    with av.open(out, "w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=rate, layout="mono")
        for start in range(0, len(pcm), 4608):
            frame = av.AudioFrame.from_ndarray(pcm[start:start + 4608].reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue(), " ".join(said), len(pcm) / rate


async def transcription(web_url: str, seconds: float, runs: int) -> dict[str, Any]:
    data, text, duration = speech_file(seconds)
    walls, hypothesis = [], ""
    async with openai.AsyncOpenAI(base_url=f"{web_url}/v1", api_key="bench", max_retries=0,
                                  timeout=600) as client:
        for _ in range(runs):
            started = time.perf_counter()
            result = await client.audio.transcriptions.create(model="whisper-1", file=("story.mp3", data))
            walls.append(time.perf_counter() - started)
            hypothesis = result.text
    wall = statistics.median(walls)
    return {"audio_s": round(duration, 2), "file_bytes": len(data), "runs": runs,
            "wall_s": [round(w, 2) for w in walls], "rtf": round(wall / duration, 4),
            "times_real_time": round(duration / wall, 2), "target_times_real_time": 5.0,
            "wer": round(wer(text, hypothesis), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description="OpenAI audio APIs against the gRPC calls beneath them; one "
                                                 "JSON object.")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of each format (default 20)")
    parser.add_argument("--transcribe-seconds", type=float, default=60.0, help="length of the file (default 60)")
    parser.add_argument("--transcribe-runs", type=int, default=3, help="transcriptions of it (default 3)")
    args = parser.parse_args()
    if args.rounds < 1 or args.transcribe_runs < 1 or args.transcribe_seconds <= 0:
        parser.error("--rounds and --transcribe-runs must be at least 1, --transcribe-seconds positive")
    web_port = free_port()
    with running_server("--no-llm", "--responder", "echo", "--web", "--web-port", str(web_port)) as (address, process):
        web_url = f"http://127.0.0.1:{web_port}"
        wait_http(f"{web_url}/healthz", process)
        speech = asyncio.run(speech_side_by_side(address, web_url, args.rounds))
        transcribe = asyncio.run(transcription(web_url, args.transcribe_seconds, args.transcribe_runs))
    print(json.dumps({"benchmark": "openai_audio", "machine": machine(), "rounds": args.rounds,
                      "sentence": SENTENCE, "rate": RATE, "speech": speech, "transcription": transcribe}, indent=1))


if __name__ == "__main__":
    main()
