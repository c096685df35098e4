"""The speaker's output latency against its block size and the latency asked for: PortAudio on the
private PulseAudio of the `talk --mic` tests (null sink, through ALSA's pulse plugin), playing
silence for a few seconds per setting with nothing else running.

    .venv/bin/python tests/perf/bench_speaker_blocks.py [--seconds 4]

Per setting: the latency PortAudio reports, the median of outputBufferDacTime - currentTime over
the callbacks (how long a frame handed over now waits for the DAC), device underflows and the
process's CPU ms per second. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.pulse import running_pulse  # noqa: E402

RATE = 24000
SETTINGS = ((10, "low"), (10, 0.005), (10, 0.01), (10, 0.02), (5, "low"), (5, 0.005))


def measure(sd, block_ms: int, latency: float | str, seconds: float) -> dict:
    underflows, waits = [0], []

    def callback(out, frames, t, status) -> None:
        underflows[0] += bool(status.output_underflow)
        waits.append(t.outputBufferDacTime - t.currentTime)
        out[:] = 0

    cpu = time.process_time()
    with sd.OutputStream(samplerate=RATE, blocksize=RATE * block_ms // 1000, channels=1, dtype="int16",
                         latency=latency, callback=callback) as stream:
        time.sleep(seconds)
        reported = stream.latency
    return {"block_ms": block_ms, "latency_asked": latency, "reported_ms": round(reported * 1000, 1),
            "dac_wait_ms_median": round(statistics.median(waits) * 1000, 1), "underflows": underflows[0],
            "cpu_ms_per_s": round((time.process_time() - cpu) * 1000 / seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, running_pulse(Path(tmp)) as pulse:
        os.environ.update(pulse.env)
        from rtmedia.clients.commands.audio_devices import native_quiet, portaudio

        sd = portaudio()
        with native_quiet():
            results = [measure(sd, block, latency, args.seconds) for block, latency in SETTINGS]
    print(json.dumps({"benchmark": "speaker_blocks", "rate": RATE, "settings": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
