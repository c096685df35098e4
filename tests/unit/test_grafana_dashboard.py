"""The Grafana dashboard queries only metrics the server (and the SIP door) registers
(docs/operations.md#metrics, docs/telephony.md#sip)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rtmedia.server.observe.metrics import Metrics
from rtmedia.web.telephony.sip_metrics import SipMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "rtmedia-dashboard.json"


def test_dashboard_metrics_exist():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\b(?:rtmedia|grpc_server)_\w+", e)}
    registered = {m.name for r in (Metrics().registry, SipMetrics().registry) for m in r.collect()}
    # prometheus_client names counters without the _total suffix
    registered |= {f"{name}_total" for name in registered}
    assert used <= registered, used - registered
    for name in ("rtmedia_sessions_active", "rtmedia_sessions_total", "rtmedia_response_latency_seconds",
                 "rtmedia_voice_to_voice_seconds", "rtmedia_barge_in_seconds", "rtmedia_lane_step_seconds",
                 "rtmedia_lane_queue_depth", "rtmedia_lm_slots", "rtmedia_input_backpressure_total",
                 "rtmedia_graph_replays_total", "rtmedia_graph_misses_total"):
        assert name in used
