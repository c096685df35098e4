"""Confirmed interruptions against immediate ones: backchannels and real interruptions spoken
over replies.

    .venv/bin/python tests/perf/bench_interruptions.py [--concurrency 3] [--out results.json]
        [--modes confirmed,immediate] [--server-log serve.log]

One `rtmedia serve --no-llm --responder echo` hears, per setting (`confirmed`, `immediate`),
20 backchannels ("yeah, okay, sure") and 20 interruptions ("wait, stop", a bare "stop"), each
said by Piper at real time half a second into the audio of a long reply, `--concurrency`
sessions at once. Per trial: whether the reply was cancelled, and from the voice's first
voiced sample (as sent) to the reply's pause (`input_audio_buffer.speech_tentative`) and to
its cancel (`output_audio_buffer.cleared`); in confirmed mode, what the backchannels were
heard as. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.perf.bench_speech import machine, report
from tests.support.converse import Conversation
from tests.support.serve import running_server
from tests.support.speech import Speaker

RATE = 24000
REPLY = ("The weather today is sunny with a light breeze from the west, and tomorrow it will rain in the "
         "morning, then clear up in the afternoon, with a cool evening.")
BACKCHANNELS = ["Yeah.", "Okay.", "Right.", "Got it.", "Yes, I see.", "Yeah, okay, sure.", "Okay, sure.",
                "Okay, got it.", "Uh huh.", "Sure.", "All right.", "I see.", "Yeah, right.", "Mm-hmm.", "Exactly.",
                "Of course.", "Sounds good.", "Makes sense.", "Cool.", "Great."]
INTERRUPTIONS = ["Stop!", "Wait, stop.", "Hold on.", "Yeah, but wait.", "No, that is wrong.", "Wait a second.",
                 "Stop talking.", "Actually, I meant tomorrow.", "Can you repeat that?", "Hang on a moment.",
                 "No, no, no.", "Excuse me.", "That is not what I asked.", "Let me stop you there.", "Wait.",
                 "Sorry, what?", "Cancel that.", "Pause.", "Go back.", "Never mind."]
SETTINGS = ("confirmed", "immediate")


def clip(speaker: Speaker, text: str, lead: float, tail: float) -> tuple[bytes, float]:
    """PCM16 at RATE: silence, the speech, silence; and where its voice starts (s)."""
    speech = speaker.say(text, RATE)
    voiced = np.flatnonzero(np.abs(speech) > 0.005 * 32768)
    pcm = np.concatenate([speaker.silence(lead, RATE), speech, speaker.silence(tail, RATE)]).tobytes()
    return pcm, lead + voiced[0] / RATE


async def trial(channel: grpc.aio.Channel, mode: str, reply: bytes, voice: bytes, onset_s: float) -> dict[str, Any]:
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"type": "server_vad", "interruption": {"mode": mode}}})
        await c.wait_for("session.updated")
        await c.stream(reply, RATE, speed=2.0)
        created = await c.wait_for("response.created", timeout=30)
        await c.wait_for("response.output_audio.delta", timeout=30)
        await asyncio.sleep(0.5)
        sent_at = await c.stream(voice, RATE)
        onset = sent_at + onset_s
        done = await c.wait_for("response.done", response_id=created["response_id"], timeout=60)
        await asyncio.sleep(0.5)
        first = {kind: next((e["t"] for e in c.of_type(kind) if e["t"] > onset - 1), None)
                 for kind in ("input_audio_buffer.speech_tentative", "output_audio_buffer.cleared")}
        heard = c.of_type("input_audio_buffer.backchannel")
        pause = first["input_audio_buffer.speech_tentative"] or first["output_audio_buffer.cleared"]
        return {"cancelled": done["status"] == "cancelled",
                "pause_ms": round((pause - onset) * 1000, 1) if pause else None,
                "cancel_ms": round((first["output_audio_buffer.cleared"] - onset) * 1000, 1)
                if first["output_audio_buffer.cleared"] else None,
                "heard": [e["transcript"] for e in heard]}


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


async def run(target: str, concurrency: int, modes: list[str]) -> dict[str, Any]:
    speaker = Speaker()
    reply, _ = clip(speaker, REPLY, 0.3, 1.0)
    voices = {t: clip(speaker, t, 0.1, 1.5) for t in BACKCHANNELS + INTERRUPTIONS}
    out: dict[str, Any] = {}
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        for mode in modes:
            async def one(text: str, mode: str = mode) -> tuple[str, dict[str, Any]]:
                async with gate:
                    return text, await trial(channel, mode, reply, *voices[text])

            results = dict(await asyncio.gather(*(one(t) for t in BACKCHANNELS + INTERRUPTIONS)))
            backchannels = [results[t] for t in BACKCHANNELS]
            interruptions = [results[t] for t in INTERRUPTIONS]
            pauses = [r["pause_ms"] for r in interruptions if r["pause_ms"] is not None]
            cancels = [r["cancel_ms"] for r in interruptions if r["cancel_ms"] is not None]
            out[mode] = {
                "backchannels_not_cancelling": sum(not r["cancelled"] for r in backchannels),
                "interruptions_cancelling": sum(r["cancelled"] for r in interruptions),
                "interruption_pause_ms": {"p50": pct(pauses, 50), "p95": pct(pauses, 95)},
                "interruption_cancel_ms": {"p50": pct(cancels, 50), "p95": pct(cancels, 95)},
                "backchannels_heard": {t: r["heard"] for t, r in zip(BACKCHANNELS, backchannels, strict=True)},
                "missed": [t for t, r in results.items() if r["cancelled"] != (t in INTERRUPTIONS)],
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=3, help="sessions at once (3)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--modes", default=",".join(SETTINGS), help="the modes to run (confirmed,immediate)")
    parser.add_argument("--server-log", type=Path, default=None,
                        help="the server's log at DEBUG here (each confirmed interruption with the words it heard)")
    args = parser.parse_args()
    level = "DEBUG" if args.server_log else "WARNING"
    with running_server("--no-llm", "--responder", "echo", "--log-level", level, log=args.server_log) as (target, _):
        result = {"benchmark": "interruptions", "machine": machine(), **asyncio.run(run(target, args.concurrency, args.modes.split(",")))}
    report(result, args.out)


if __name__ == "__main__":
    main()
