"""Session recordings: their alignment and what they cost the server, in one sitting.

    .venv/bin/python tests/perf/bench_recording.py [--sessions 16] [--duration 60] [--rounds 2]
        [--alignment-sessions 3] [--out results.json]

Two `rtmedia serve --responder echo` processes, one with `--record-dir` (every session recorded)
and one without:

1. Alignment. `--alignment-sessions` conversations with the recording server, each a spoken
   sentence and a reply the user talks over (a barge-in), then a second reply, as
   tests/integration/test_recording.py has them: the user's channel cross-correlated with what
   was sent, the agent's with what the client played (each reply from its first delta, cut where
   output_audio_buffer.cleared came), both on the session clock: offsets in ms (target: within
   20 ms).
2. Cost. `rtmedia loadtest --profile talk --sessions N` against each server in turn,
   alternating `--rounds` times: server CPU (the process and its ASR workers) per
   session-second, the SLO held, and the recording server's bytes written and recordings
   dropped or failed. The target: at most 5 % more CPU per session, the hold rate unchanged.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.perf.bench_loadtest import tree_cpu_s  # noqa: E402
from tests.perf.bench_realtime_ws import loadtest, spread  # noqa: E402
from tests.perf.bench_speech import machine, report  # noqa: E402
from tests.support.serve import free_port, running_server  # noqa: E402


def recording_counters(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("rtmedia_recording") and not s.name.endswith("_created"):
                key = s.name + "".join(f"{{{v}}}" for v in s.labels.values())
                out[key] = out.get(key, 0.0) + s.value
    return out


async def alignment(target: str, directory: Path, speaker: Any) -> dict[str, Any]:
    """One conversation with a barge-in; the recording's offsets against what was sent and played."""
    import grpc
    import numpy as np

    from tests.integration.test_recording import (
        CHUNK_MS,
        FIRST,
        RATE,
        SECOND,
        SILENCE_MS,
        Mic,
        decode,
        offset_ms,
        played,
    )
    from tests.support.converse import Conversation

    async with grpc.aio.insecure_channel(target) as channel, Conversation(channel) as c:
        created = await c.wait_for("session.created")
        c.send("session.update", session={"input_audio_format": {"encoding": "pcm16", "sample_rate": RATE},
                                          "turn_detection": {"type": "server_vad",
                                                             "silence_duration_ms": SILENCE_MS}})
        await c.wait_for("session.updated")
        mic = Mic(c)
        mic.say(speaker.silence(0.5))
        mic.say(speaker.say(FIRST))
        mic.start()
        await c.wait_for("response.output_audio.delta", timeout=30)
        await asyncio.sleep(1.2)
        mic.say(speaker.say(SECOND))
        await c.wait_for("response.done", count=2, timeout=30)
        await asyncio.sleep(c.of_type("response.done")[-1]["usage"]["output_audio_ms"] / 1000 + 0.5)
        await mic.stop()
        c.end_requests()
        await c.ended()
    path, events = (directory / f"{created['session_id']}{suffix}" for suffix in (".ogg", ".jsonl"))
    for _ in range(100):  # the server's writer closes them once the session is released
        if '"recording.stopped"' in events.read_text():
            break
        await asyncio.sleep(0.1)
    stereo = decode(path)
    sent = np.frombuffer(bytes(mic.sent), "<i2").astype(np.float32) / 32768
    expected, spans = played(c, mic)
    cleared = c.of_type("output_audio_buffer.cleared")
    cut = {}
    if cleared:
        rid = cleared[0]["response_id"]
        end_ms = spans[rid][1]
        next_ms = min([start for start, _ in spans.values() if start > end_ms], default=len(stereo) * 1000 / RATE)
        tail = np.abs(stereo[int(end_ms * RATE / 1000):int(next_ms * RATE / 1000), 1])
        loud = np.flatnonzero(tail > 0.02)  # the cut reply still sounding where the user no longer heard it
        cut = {"cut_at_ms": round(end_ms, 1), "next_reply_ms": round(next_ms, 1),
               "audio_after_cut_ms": round(float(loud[-1] + 1) * 1000 / RATE, 1) if loud.size else 0.0}
    return {"user_offset_ms": offset_ms(stereo[:, 0], sent), "agent_offset_ms": offset_ms(stereo[:, 1], expected),
            "replies": len(spans), "chunk_ms": CHUNK_MS, **cut}


def cost(target: str, pid: int, sessions: int, duration: float) -> dict[str, Any]:
    cpu0, t0 = tree_cpu_s(pid), time.perf_counter()
    report = loadtest(["--target", target, "--profile", "talk", "--sessions", str(sessions), "--duration",
                       str(duration), "--ramp-per-s", "50"])
    cpu, wall = tree_cpu_s(pid) - cpu0, time.perf_counter() - t0
    return {"held": report["slo"]["held"], "v2v_p50_ms": report["voice_to_voice_ms"]["p50"],
            "errors": report["errors"], "server_cpu_ms_per_session_s": round(cpu / wall / sessions * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=16, help="talk sessions per cost run (16)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per cost run (60)")
    parser.add_argument("--rounds", type=int, default=2, help="cost runs per server (2)")
    parser.add_argument("--alignment-sessions", type=int, default=3, help="conversations of part 1 (3)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from tests.support.speech import Speaker

    result: dict[str, Any] = {"benchmark": "recording", "machine": machine(), "sessions": args.sessions,
                              "duration_s": args.duration}
    with tempfile.TemporaryDirectory(prefix="rtmedia-recordings-") as folder:
        directory = Path(folder) / "recordings"
        port = free_port()
        common = ("--responder", "echo", "--max-sessions", "3000", "--log-level", "WARNING")
        with running_server(*common, "--metrics-port", str(port), "--record-dir", str(directory)) as (rec, rec_p), \
                running_server(*common, "--metrics-port", "0") as (plain, plain_p):
            speaker = Speaker()
            result["alignment"] = [asyncio.run(alignment(rec, directory, speaker))
                                   for _ in range(args.alignment_sessions)]
            runs: dict[str, list[dict[str, Any]]] = {"off": [], "recording": []}
            before = recording_counters(port)
            for round_ in range(args.rounds):
                order = [("off", plain, plain_p), ("recording", rec, rec_p)]
                for name, target, process in order if round_ % 2 == 0 else order[::-1]:
                    run = cost(target, process.pid, args.sessions, args.duration)
                    print(json.dumps({name: run}), file=sys.stderr, flush=True)
                    runs[name].append(run)
            after = recording_counters(port)
        result["cost"] = {name: {"held": [r["held"] for r in rs], "v2v_p50_ms": spread([r["v2v_p50_ms"] for r in rs]),
                                 "server_cpu_ms_per_session_s": spread([r["server_cpu_ms_per_session_s"] for r in rs])}
                          for name, rs in runs.items()}
        off = [r["server_cpu_ms_per_session_s"] for r in runs["off"]]
        on = [r["server_cpu_ms_per_session_s"] for r in runs["recording"]]
        if off and on:
            result["cost"]["cpu_increase_pct"] = round((sum(on) / len(on) / (sum(off) / len(off)) - 1) * 100, 1)
        result["recording_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
    report(result, args.out)


if __name__ == "__main__":
    main()
