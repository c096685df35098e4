"""Transcribe with many small requests: a stream's per-request cost.

    .venv/bin/python tests/perf/bench_transcribe_chunks.py [--requests 4000] [--at-once 4]

One in-process server (echo responder, no LM). A Transcribe stream of `--requests` audio
requests of 8 samples (silence, 16 bytes each) and one of 1600 samples (3200 bytes), each
alone and `--at-once` together: the wall time to the end of the stream. The server gives the
recogniser what arrived while the last piece was being recognised as one piece, so a client
of tiny requests costs a lane round trip per piece, not per request. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.perf.bench_speech import machine


async def stream(stub, requests) -> None:
    async for _ in stub.Transcribe(iter(requests)):
        pass


async def run(args: argparse.Namespace) -> dict:
    from rtmedia.server.app import RtmediaServer
    from rtmedia.server.config import ServerConfig
    from rtmedia.v1 import speech_pb2, speech_pb2_grpc

    server = RtmediaServer(ServerConfig.of(port=0, metrics_port=0, grace_s=1, llm=False, default_responder="echo"))
    await server.start()
    result: dict = {"benchmark": "transcribe_chunks", "machine": machine(), "requests": args.requests,
                    "at_once": args.at_once, "runs": []}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = speech_pb2_grpc.SpeechServiceStub(channel)
            for samples in (8, 1600):
                requests = [speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig())]
                requests += [speech_pb2.TranscribeRequest(audio=bytes(2 * samples)) for _ in range(args.requests)]
                started = time.perf_counter()
                await stream(stub, requests)
                alone = time.perf_counter() - started
                started = time.perf_counter()
                await asyncio.gather(*(stream(stub, requests) for _ in range(args.at_once)))
                together = time.perf_counter() - started
                result["runs"].append({"request_bytes": 2 * samples, "alone_s": round(alone, 2),
                                       "at_once_s": round(together, 2),
                                       "ms_per_request_alone": round(alone * 1000 / args.requests, 3)})
    finally:
        await server.stop(0)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description="Transcribe with many small requests")
    parser.add_argument("--requests", type=int, default=4000, help="audio requests per stream (default 4000)")
    parser.add_argument("--at-once", type=int, default=4, help="streams at once in the second run (default 4)")
    args = parser.parse_args()
    if args.requests < 1 or args.at_once < 1:
        parser.error("--requests and --at-once must be at least 1")
    print(json.dumps(asyncio.run(run(args)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
