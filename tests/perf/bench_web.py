"""Added latency of the WebRTC bridge: voice-to-voice through the bridge (an aiortc peer:
Opus up, the bridge, Converse, the playout track, Opus down) versus the same audio sent
straight over gRPC, measured in one run against one `rtmedia serve --web` process.

    .venv/bin/python tests/perf/bench_web.py [--rounds 8] [--client-prefetch N] [--bridge-prefetch N]

The bridge is the one `rtmedia serve --web` runs beside the server (it decodes each
microphone packet as it arrives); `--bridge-prefetch N` measures a separate
`rtmedia web --audio-prefetch N` against the same server instead (aiortc's own
default is 4, as is the client's with `--client-prefetch 4`). The client decodes each
reply packet as it arrives unless `--client-prefetch N` says otherwise.

voice-to-voice (docs/protocol.md#latency-definitions): from the last voiced 20 ms frame the client sent to the first
audible reply frame at the client (-45 dBFS). Over gRPC, the reply is "played" from its
first delta at real time, so a quiet lead-in of the reply counts the same on both paths.
Both paths speak the same Piper sentence at real-time pace with the session at 16 kHz
in, 48 kHz out, echo responder. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np
from rtmedia.web.bridge import BridgeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.converse import Conversation
from tests.support.speech import Speaker
from tests.support.webrtc import (
    FRAME,
    RATE,
    VOICED_RMS,
    BridgePeer,
    frame_rms,
    running_bridge,
    serve_with_web,
)

SENTENCE = "Hello, can you hear me today?"
IN_RATE = 16000


def voiced_frames(pcm: np.ndarray, frame: int) -> list[bool]:
    return [frame_rms(pcm[i:i + frame]) > VOICED_RMS for i in range(0, len(pcm), frame)]


async def direct_round(channel: grpc.aio.Channel, speech16: np.ndarray) -> float:
    async with Conversation(channel) as conv:
        conv.send("session.update", session={"input_audio_format": {"sample_rate": IN_RATE},
                                             "output_sample_rate": RATE})
        await conv.wait_for("session.updated")
        pcm = np.concatenate([speech16, np.zeros(IN_RATE * 2, np.int16)])
        step = IN_RATE * 20 // 1000
        voiced = voiced_frames(pcm, step)
        last_voiced = 0.0
        started = time.perf_counter()
        for n, offset in enumerate(range(0, len(pcm), step)):
            conv.send("input_audio_buffer.append", audio=pcm[offset:offset + step].tobytes())
            if voiced[n]:
                last_voiced = time.perf_counter()
            await asyncio.sleep(max(0.0, started + (n + 1) * 0.02 - time.perf_counter()))
            if conv.of_type("response.output_audio.delta"):
                break
        await conv.wait_for("response.done", timeout=30)
        deltas = conv.of_type("response.output_audio.delta")
        first_t = conv.t0 + deltas[0]["t"]
        reply = np.frombuffer(b"".join(base64.b64decode(d["audio"]) for d in deltas), "<i2")
        lead = next(i for i, v in enumerate(voiced_frames(reply, FRAME)) if v)
        return (first_t + lead * FRAME / RATE - last_voiced) * 1000


async def bridge_round(url: str, http: aiohttp.ClientSession, speech48: np.ndarray, prefetch: int) -> float:
    peer = BridgePeer(url, prefetch=prefetch)
    try:
        await peer.connect(http)
        await peer.wait_for("session.updated")
        await asyncio.sleep(0.5)
        peer.mic.say(speech48)
        done = await peer.wait_for("response.done", timeout=30)
        assert done["status"] == "completed", done
        await asyncio.sleep(0.5)
        last_voiced = peer.mic.voiced_sent[-1]
        audible = peer.first_audible(last_voiced)
        assert audible is not None, "no reply audio on the track"
        return (audible - last_voiced) * 1000
    finally:
        await peer.close()


async def run(rounds: int, url: str, target: str, prefetch: int, bridge_prefetch: int) -> dict:
    speaker = Speaker()
    speech16, speech48 = speaker.say(SENTENCE, IN_RATE), speaker.say(SENTENCE, RATE)
    direct, bridge = [], []
    async with grpc.aio.insecure_channel(target) as channel, aiohttp.ClientSession() as http:
        await direct_round(channel, speech16)  # warm both paths
        await bridge_round(url, http, speech48, prefetch)
        for _ in range(rounds):
            direct.append(await direct_round(channel, speech16))
            bridge.append(await bridge_round(url, http, speech48, prefetch))

    def summary(values: list[float]) -> dict:
        ordered = sorted(values)
        return {"p50_ms": round(statistics.median(values), 1), "min_ms": round(ordered[0], 1),
                "max_ms": round(ordered[-1], 1), "all_ms": [round(v, 1) for v in values]}

    added = [b - d for b, d in zip(bridge, direct, strict=True)]
    return {"benchmark": "web_bridge_voice_to_voice", "rounds": rounds, "direct_grpc": summary(direct),
            "through_bridge": summary(bridge), "bridge_adds_p50_ms": round(statistics.median(added), 1),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "client_audio_prefetch": prefetch, "bridge_audio_prefetch": bridge_prefetch,
            "notes": "echo responder, --no-llm; session 16 kHz in, 48 kHz out; aiortc peer on the same host"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--client-prefetch", type=int, default=0,
                        help="the aiortc client's audio receive buffer: 0 decodes each packet as it arrives, as "
                             "the direct gRPC client plays each delta as it arrives (default); N holds N frames "
                             "(aiortc's own default is 4 = 80 ms; a browser's adaptive buffer sits near 1-2 "
                             "frames on a clean local path)")
    parser.add_argument("--bridge-prefetch", type=int, default=None,
                        help="measure a separate `rtmedia web --audio-prefetch N` instead of the bridge of "
                             "`rtmedia serve --web` (which holds none)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        served = stack.enter_context(serve_with_web(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        url, bridge_prefetch = served["url"], BridgeConfig.audio_prefetch  # serve --web's bridge: the default
        if args.bridge_prefetch is not None:
            bridge_prefetch = args.bridge_prefetch
            url = stack.enter_context(running_bridge(served["target"], "--audio-prefetch", str(bridge_prefetch)))
        result = asyncio.run(run(args.rounds, url, served["target"], args.client_prefetch, bridge_prefetch))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
