"""`make loadtest-smoke`: a short `rtmedia loadtest` (mixed profile: listening,
transcribing and talking sessions) against a real `rtmedia serve --no-llm
--responder echo`; fails when the run does not hold a loose SLO (p95 response
latency 1500 ms on this shared 2-core box, no errors, no underruns, no rejects).

    .venv/bin/python tests/perf/loadtest_smoke.py [--report out.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.serve import RTMEDIA, running_server  # noqa: E402

SMOKE = ["--profile", "mixed", "--sessions", "8", "--ramp-per-s", "4", "--duration", "14", "--chunk-ms", "20",
         "--slo-p95-ms", "1500", "--fail-on-slo", "--quiet"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    with running_server("--metrics-port", "0", "--no-llm", "--responder", "echo", "--grace", "2") as (target, _):
        extra = ["--report", args.report] if args.report else []
        result = subprocess.run([RTMEDIA, "loadtest", "--target", target, *SMOKE, *extra], check=False)
    print(f"loadtest-smoke: {'passed' if result.returncode == 0 else 'FAILED'} in "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
