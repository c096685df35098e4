"""The soak, the quick version of tests/reliability/soak.py: `rtmedia loadtest --profile talk`
with 4 sessions for a minute against one real `rtmedia serve` (echo responder): no errors, no
rejected session, and every resource of the server back at the baseline afterwards. Latency is
not asserted: this machine's speed varies by the hour."""

from __future__ import annotations

import pytest

from tests.reliability.soak import parse_args, run

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(420)
async def test_four_talk_sessions_for_a_minute_leave_nothing_behind():
    args = parse_args(["--minutes", "1", "--sessions", "4", "--window-min", "1", "--warmup-min", "0.5",
                       "--primer-s", "8", "--sample-s", "2", "--settle-s", "45"])
    result = await run(args)
    assert result["ok"], result["problems"]
    [window] = result["windows"]
    assert window["sessions_started"] == window["sessions_completed"] == 4
    assert window["errors"] == 0 and window["sessions_rejected"] == 0
    assert window["responses"] >= 4, "the sessions were not answered"
    assert window["server_cpu_ms_per_session_s"] > 0 and window["mean_step_ms"]["tts"] > 0, window
    assert max(s["sessions_active"] for s in result["rss_timeline"]) == 4
    assert not result["not_returned"]
