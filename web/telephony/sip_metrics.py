"""The SIP door's Prometheus metrics, served on its control port (`GET /metrics`) beside the
calls API: calls active and by outcome, call setup time, codecs, DTMF, transfers, RTP loss and
jitter from PJSIP's stream statistics, registrations. The server's own metrics count the
calls' sessions (transport `sip`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SipMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.active = Gauge("rtmedia_sip_calls_active", "SIP calls ringing or up", registry=r)
        self.calls = Counter("rtmedia_sip_calls_total", "SIP calls by direction and outcome (answered, rejected, "
                             "busy, no_answer, failed)", ["direction", "outcome"], registry=r)
        self.setup = Histogram("rtmedia_sip_call_setup_seconds", "from the INVITE (or the dial) to the call's "
                               "session answering", buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10), registry=r)
        self.codecs = Counter("rtmedia_sip_codec_calls_total", "calls by negotiated codec", ["codec"], registry=r)
        self.dtmf = Counter("rtmedia_sip_dtmf_total", "DTMF digits received", ["method"], registry=r)
        self.transfers = Counter("rtmedia_sip_transfers_total", "transfers (REFER) by result", ["result"], registry=r)
        self.rtp_packets = Counter("rtmedia_sip_rtp_received_packets_total", "RTP packets received", registry=r)
        self.rtp_lost = Counter("rtmedia_sip_rtp_lost_packets_total", "RTP packets lost (sequence gaps)", registry=r)
        self.jitter = Histogram("rtmedia_sip_rtp_jitter_seconds", "each call's mean RTP interarrival jitter",
                                buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1), registry=r)
        self.underruns = Counter("rtmedia_sip_playout_underruns_total", "reply frames that ran dry at the door "
                                 "(the caller heard a gap)", registry=r)
        self.dropped_frames = Counter("rtmedia_sip_dropped_requests_total", "requests toward the server dropped "
                                      "because its stream did not keep up", registry=r)
        self.registered = Gauge("rtmedia_sip_trunk_registered", "1 while the trunk's registration holds",
                                ["trunk"], registry=r)
        self.registration_failures = Counter("rtmedia_sip_registration_failures_total", "failed registrations",
                                             ["trunk"], registry=r)

    def observe_rtp(self, rtp: tuple[int, int, float] | None) -> None:
        """A call's last RTP statistics (packets, lost, mean jitter in seconds), once it ended."""
        if rtp is None:
            return
        packets, lost, jitter = rtp
        self.rtp_packets.inc(packets)
        self.rtp_lost.inc(lost)
        self.jitter.observe(jitter)


def sample(stat: Any) -> tuple[int, int, float]:
    """(packets, lost, mean jitter in s) of PJSIP's RtcpStreamStat."""
    return int(stat.pkt), int(stat.loss), float(stat.jitterUsec.mean) / 1e6
