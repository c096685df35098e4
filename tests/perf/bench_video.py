"""Video benchmark: chunked versus one-shot decode, and speech latency during a decode.

    .venv/bin/python tests/perf/bench_video.py [--frames 21] [--size 128] [--repeats 3] [--turns 6]

Drives a real `rtmedia serve` process (echo responder, embedded random-weight Wan
VAE) and measures at the client:
- time to first frame and total time of a chunked causal decode (raw RGB24), and
  the total time of a one-shot decode of the same latent, alternating, in one run;
- one decode step: the server's rtmedia_lane_step_seconds{lane="video"} mean
  over the chunked decodes (targets: first frame within 1.5x of one step, total
  chunked within 5 % of one-shot);
- speech response latency (docs/protocol.md#latency-definitions, one session, turns at real-time pace)
  alone and while decodes run back to back (target: p95 rises by under 20 %).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rtmedia.clients.channels import CHANNEL_OPTIONS  # noqa: E402
from rtmedia.v1 import video_pb2, video_pb2_grpc  # noqa: E402

from tests.perf.bench_realtime import SENTENCES, Clip, summary, talk_turns  # noqa: E402
from tests.perf.bench_speech import machine  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402
from tests.support.speech import Speaker  # noqa: E402


def video_step_seconds(metrics_port: int) -> tuple[float, float]:
    """(sum, count) of the server's video lane step histogram."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    values = {}
    for line in body.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f'rtmedia_lane_step_seconds_{key}{{lane="video"}}'):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values.get("sum", 0.0), values.get("count", 0.0)


async def decode(stub, request) -> tuple[float, float, int]:
    """(first frame s, total s, frames)."""
    started = time.perf_counter()
    first = None
    frames = 0
    async for reply in stub.DecodeVideo(request):
        if first is None:
            first = time.perf_counter() - started
        if reply.part + 1 == reply.parts:
            frames += reply.frame_count
    return first or 0.0, time.perf_counter() - started, frames


async def run(args: argparse.Namespace, target: str, metrics_port: int) -> dict:
    latent_hw = args.size // 8
    z = np.random.default_rng(0).standard_normal((16, args.frames, latent_hw, latent_hw)).astype(np.float32)
    tensor = video_pb2.Tensor(shape=z.shape, dtype=video_pb2.TENSOR_DTYPE_FLOAT32, data=z.tobytes())
    chunked_req = video_pb2.DecodeVideoRequest(latent=tensor)
    one_shot_req = video_pb2.DecodeVideoRequest(latent=tensor, one_shot=True)
    report: dict = {"latent": list(z.shape), "output": [1 + 4 * (args.frames - 1), args.size, args.size]}
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = video_pb2_grpc.VideoServiceStub(channel)
        await decode(stub, chunked_req)  # warm
        chunked, one_shot, steps = [], [], []
        for _ in range(args.repeats):
            before = video_step_seconds(metrics_port)
            chunked.append(await decode(stub, chunked_req))
            after = video_step_seconds(metrics_port)
            steps.append((after[0] - before[0]) / max(after[1] - before[1], 1))
            one_shot.append(await decode(stub, one_shot_req))
        step = float(np.mean(steps))
        first = float(np.median([c[0] for c in chunked]))
        total_chunked = float(np.median([c[1] for c in chunked]))
        total_one_shot = float(np.median([o[1] for o in one_shot]))
        report["decode"] = {
            "step_ms": round(step * 1000, 1),
            "chunked_first_frame_ms": round(first * 1000, 1),
            "chunked_total_ms": round(total_chunked * 1000, 1),
            "one_shot_first_frame_ms": round(float(np.median([o[0] for o in one_shot])) * 1000, 1),
            "one_shot_total_ms": round(total_one_shot * 1000, 1),
            "first_frame_over_step": round(first / step, 2),
            "chunked_over_one_shot": round(total_chunked / total_one_shot, 3),
            "repeats": args.repeats,
        }

        speaker = Speaker()
        clips = [Clip(speaker, s) for s in SENTENCES]
        alone: dict = {"response": [], "v2v": [], "statuses": []}
        await talk_turns(channel, clips, args.turns, 0, alone)
        stop = asyncio.Event()
        decodes = 0

        async def background() -> None:
            nonlocal decodes
            while not stop.is_set():
                await decode(stub, chunked_req)
                decodes += 1

        task = asyncio.create_task(background())
        during: dict = {"response": [], "v2v": [], "statuses": []}
        try:
            await asyncio.sleep(0.5)
            await talk_turns(channel, clips, args.turns, 0, during)
        finally:
            stop.set()
            await task
        p95_alone = summary(alone["response"])["p95"]
        p95_during = summary(during["response"])["p95"]
        report["speech"] = {
            "response_latency_ms_alone": summary(alone["response"]),
            "response_latency_ms_during_decode": summary(during["response"]),
            "p95_rise": round(p95_during / p95_alone - 1, 3) if p95_alone and p95_during else None,
            "decodes_during": decodes,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=21, help="latent frames (default 21: 81 output frames)")
    parser.add_argument("--size", type=int, default=128, help="output width and height (multiple of 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    metrics_port = free_port()
    with running_server("--metrics-port", str(metrics_port), "--log-level", "WARNING", "--no-llm",
                        "--responder", "echo") as (target, _):
        report = asyncio.run(run(args, target, metrics_port))
    print(json.dumps({"benchmark": "video", "machine": machine(), "vae": "embedded random-weight Wan-style "
                      "(base_dim 8), 1 torch thread", **report}, indent=2))


if __name__ == "__main__":
    main()
