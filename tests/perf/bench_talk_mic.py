"""What `rtmedia talk --mic` adds to voice-to-voice against `rtmedia talk FILE --realtime`, on the same
clocked devices (a private PulseAudio: pipe source at real-time pace, null sink), and the live
client's CPU per session-second.

Each round runs both, in alternating order, on the same sentence against one `rtmedia serve` with
the echo responder: the file's voice-to-voice runs from sending the turn's last voiced chunk to
receiving the first reply audio; the microphone's from capturing it (PortAudio's ADC time) to the
reply's first sample at the speaker (its DAC time). The difference is what the live path adds:
capture buffering, the jitter buffer and the output latency. Prints one JSON object.

    .venv/bin/python tests/perf/bench_talk_mic.py --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.pulse import MIC_RATE, LiveTalk, running_pulse
from tests.support.serve import RTMEDIA, free_port, running_server
from tests.support.speech import Speaker, write_wav

SENTENCE = "Please tell me about the weather today."


def file_round(served: dict, wav: Path) -> dict:
    result = subprocess.run([RTMEDIA, "talk", str(wav), "--realtime", "--json", "--responder", "echo",
                             "--target", served["target"]], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"talk FILE failed: {result.stderr}")
    return json.loads(result.stdout.splitlines()[-1])


def mic_round(served: dict, pulse, speech: np.ndarray) -> dict:
    live = LiveTalk(served, pulse)
    live.wait(lambda: live.events("session.updated"), why="session.updated")
    pulse.voice.say(np.concatenate([np.zeros(MIC_RATE // 2, np.int16), speech]))
    live.wait(lambda: live.events("response.done"), why="the reply")
    rid = live.events("response.done")[0]["response_id"]
    sent_ms = sum(d["audio_bytes"] for d in live.events("response.output_audio.delta")
                  if d["response_id"] == rid) * 1000 // 2 // MIC_RATE
    live.wait(lambda: any(a["response_id"] == rid and a["played_ms"] >= sent_ms - 1
                          for a in live.events("playback.acknowledged")), why="the reply played out")
    _, summary, _ = live.interrupt()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    speaker = Speaker()
    speech = speaker.say(SENTENCE, MIC_RATE)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wav = write_wav(root / "in.wav", MIC_RATE, speaker.silence(0.5, MIC_RATE), speech,
                        speaker.silence(1.5, MIC_RATE))
        log = root / "serve.log"
        with running_pulse(root / "pulse") as pulse, \
                running_server("--metrics-port", str(free_port()), log=log) as (target, _):
            served = {"target": target, "log": log}
            file_round(served, wav)  # warm-up, not counted
            rounds = []
            for n in range(args.rounds):
                order = ("file", "mic") if n % 2 == 0 else ("mic", "file")
                got = {}
                for kind in order:
                    got[kind] = file_round(served, wav) if kind == "file" else mic_round(served, pulse, speech)
                    time.sleep(0.5)
                rounds.append(got)
    file_v2v = [r["file"]["voice_to_voice_ms"][0] for r in rounds]
    mic_v2v = [r["mic"]["voice_to_voice_ms"][0] for r in rounds]
    added = [m - f for m, f in zip(mic_v2v, file_v2v, strict=True)]
    mic = [r["mic"] for r in rounds]
    print(json.dumps({
        "rounds": args.rounds,
        "file_voice_to_voice_ms": file_v2v,
        "mic_voice_to_voice_ms": mic_v2v,
        "mic_added_ms_per_round": [round(a, 1) for a in added],
        "mic_added_ms_median": round(statistics.median(added), 1),
        "mic_playout_ms_median": statistics.median(s["playout_ms"][0] for s in mic),
        "mic_output_latency_ms_median": statistics.median(s["output_latency_ms"] for s in mic),
        "mic_underruns": [s["underruns"] for s in mic],
        "mic_cpu_ms_per_session_s_median": statistics.median(s["cpu_ms_per_session_s"] for s in mic),
        "target_added_ms": 30,
    }, indent=1))


if __name__ == "__main__":
    main()
