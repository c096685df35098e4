"""Prometheus metrics (docs/operations.md#metrics): names, base units, one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets around the realtime frame budget (5-100 ms), with a tail for slow steps.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.032, 0.05, 0.08, 0.1, 0.2, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
RPC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Values of rtmedia_transport_sessions_active{transport}: what a client may say in the
# rtmedia-transport metadata (anything else counts as "other"; none: "grpc").
TRANSPORTS = ("grpc", "webrtc", "openai-ws", "openai-webrtc", "twilio", "sip", "other")


class Metrics:
    """All of rtmedia's metrics, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # Registered in this order (the order of the exposition).
        self._engine_work(self.registry)
        self._sessions(self.registry)
        self._responses(self.registry)
        self._admission(self.registry)
        self._recordings(self.registry)
        self._video_and_graphs(self.registry)
        self._rpcs(self.registry)

    def _engine_work(self, r: CollectorRegistry) -> None:
        """The lanes, the ASR workers and the media: queues, batches, steps, faults, bytes."""
        self.lane_queue_depth = Gauge(
            "rtmedia_lane_queue_depth", "Work items waiting in a lane", ["lane"], registry=r
        )
        self.lane_batch_size = Histogram(
            "rtmedia_lane_batch_size", "Items per engine step", ["lane"], buckets=BATCH_BUCKETS, registry=r
        )
        self.lane_step_seconds = Histogram(
            "rtmedia_lane_step_seconds", "Engine step latency", ["lane"], buckets=STEP_BUCKETS, registry=r
        )
        self.lane_deadline_misses = Counter(
            "rtmedia_lane_deadline_misses_total",
            "Steps that outlasted their deadline (tick lanes: the tick period; others: the lane's step deadline)",
            ["lane"], registry=r,
        )
        self.lane_healthy = Gauge(
            "rtmedia_lane_healthy", "1 while the lane serves, 0 while it is unhealthy (stalled, failing, or its "
            "engine cannot recover)", ["lane"], registry=r,
        )
        self.asr_streams = Gauge(
            "rtmedia_asr_streams", "Recognition streams open on each ASR worker process", ["worker"], registry=r
        )
        self.asr_decoders = Gauge(
            "rtmedia_asr_decoders", "PocketSphinx decoders each ASR worker holds (idle and lent), as of its last "
            "reply", ["worker"], registry=r,
        )
        self.asr_decodes = Counter(
            "rtmedia_asr_decodes_total", "Whisper decodes, by kind (partial, final)", ["kind"], registry=r
        )
        self.asr_batch = Histogram(
            "rtmedia_asr_batch_size", "Whisper decodes per batch (one encoder and one decode pass), by kind",
            ["kind"], buckets=(1, 2, 4, 8, 16), registry=r,
        )
        self.asr_partial_cadence = Gauge(
            "rtmedia_asr_partial_cadence_ms", "New speech between two partial decodes of a stream (Whisper; "
            "stretched while the recogniser is busy)", registry=r,
        )
        self.asr_worker_restarts = Counter(
            "rtmedia_asr_worker_restarts_total", "ASR worker processes restarted after they died or hung",
            ["worker"], registry=r,
        )
        self.lane_step_failures = Counter(
            "rtmedia_lane_step_failures_total", "Engine steps that raised", ["lane"], registry=r
        )
        self.bytes_total = Counter(
            "rtmedia_bytes_total", "Media payload bytes", ["direction"], registry=r
        )
        self.tts_first_audio_seconds = Histogram(
            "rtmedia_tts_first_audio_seconds", "Synthesize: request to first audio chunk",
            buckets=STEP_BUCKETS, registry=r,
        )

    def _sessions(self, r: CollectorRegistry) -> None:
        """Open sessions, by transport, and their outcomes."""
        self.sessions_active = Gauge("rtmedia_sessions_active", "Open Converse sessions", registry=r)
        self.sessions_capacity = Gauge(
            "rtmedia_sessions_capacity", "Converse sessions this replica is sized for (capacity_sessions): "
            "occupancy is rtmedia_sessions_active / rtmedia_sessions_capacity", registry=r)
        self.transport_sessions = Gauge(
            "rtmedia_transport_sessions_active", "Open Converse sessions by the client's transport "
            "(metadata rtmedia-transport: grpc, webrtc, openai-ws, openai-webrtc, twilio, other)", ["transport"], registry=r,
        )
        for transport in TRANSPORTS:
            self.transport_sessions.labels(transport)  # each shows 0 before its first session
        self.sessions_total = Counter(
            "rtmedia_sessions_total", "Converse sessions by outcome (admitted, rejected, completed, cancelled, failed)",
            ["outcome"], registry=r,
        )

    def _responses(self, r: CollectorRegistry) -> None:
        """Responses and turns: latency, stages, prepared replies, interruptions, turn ends, LM slots."""
        self.response_latency = Histogram(
            "rtmedia_response_latency_seconds", "speech_stopped (or commit) to the first reply audio sent",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.voice_to_voice = Histogram(
            "rtmedia_voice_to_voice_seconds", "Server estimate: end of speech to the first reply audio sent "
            "(response latency plus the silence window)", buckets=LATENCY_BUCKETS, registry=r,
        )
        self.response_stage = Histogram(
            "rtmedia_response_stage_seconds", "A response's stages (response.timings): turn_detection, transcription, "
            "first_text, first_audio (each the time it added after the one before), voice_to_voice",
            ["stage", "responder"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.preemptive = Counter(
            "rtmedia_preemptive_replies_total", "Replies prepared at a pause in the user's speech, by outcome: started, "
            "committed (sent at the turn's end), discarded (never seen), skipped (the lanes were behind)",
            ["outcome"], registry=r,
        )
        self.preemptive_discarded_audio = Counter(
            "rtmedia_preemptive_discarded_audio_seconds_total", "Reply audio synthesised for prepared replies that were "
            "discarded (the TTS work spent on them)", registry=r,
        )
        self.barge_in = Histogram(
            "rtmedia_barge_in_seconds", "Interrupting audio taken by the VAD tick to output_audio_buffer.cleared",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.interruptions = Counter(
            "rtmedia_interruptions_total", "Voice over a reply in confirmed mode, by outcome: interrupted (the reply "
            "was cancelled) or resumed (a backchannel, or no words)", ["outcome"], registry=r,
        )
        self.turn_ends = Counter(
            "rtmedia_turn_ends_total", "Turns ended by the VAD, by reason (silence, semantic, max_wait)", ["reason"],
            registry=r,
        )
        self.turn_score_seconds = Histogram(
            "rtmedia_turn_score_seconds", "semantic_vad: a pause's words known to its end-of-turn score",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.turn_score_batch = Histogram(
            "rtmedia_turn_score_batch_size", "semantic_vad: end-of-turn scores per batched LM forward",
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=r,
        )
        self.lm_slots = Gauge(
            "rtmedia_lm_slots", "LM KV-cache slots: busy, free, and generations waiting for one", ["state"], registry=r
        )

    def _admission(self, r: CollectorRegistry) -> None:
        """Draining, tokens, refused calls and input backpressure."""
        self.sessions_draining = Gauge(
            "rtmedia_sessions_draining", "Sessions finishing their turn in flight before a shutdown closes them",
            registry=r,
        )
        self.token_sessions = Gauge(
            "rtmedia_token_sessions_active", "Open Converse sessions by token name (with --auth-tokens)", ["token"],
            registry=r,
        )
        self.auth_refused = Counter(
            "rtmedia_auth_refused_total", "Calls refused by authentication or quota (UNAUTHENTICATED, QUOTA)",
            ["reason"], registry=r,
        )
        self.input_backpressure = Counter(
            "rtmedia_input_backpressure_total", "Times a session's input inbox overflowed", registry=r
        )

    def _recordings(self, r: CollectorRegistry) -> None:
        """Session recordings (--record-dir)."""
        self.recordings_active = Gauge(
            "rtmedia_recordings_active", "Session recordings being written (--record-dir)", registry=r
        )
        self.recordings_total = Counter(
            "rtmedia_recordings_total", "Session recordings ended, by outcome: completed (with the session or a "
            "session.update), max_bytes, max_duration (stopped at a bound), failed", ["outcome"], registry=r,
        )
        self.recording_bytes = Counter(
            "rtmedia_recording_bytes_total", "Bytes written to session recordings (Ogg Opus and JSON Lines)", registry=r
        )
        self.recording_failures = Counter(
            "rtmedia_recording_failures_total", "Session recordings a file error ended or kept from starting, by "
            "reason (permission, disk_full, exists, io_error)", ["reason"], registry=r,
        )
        self.recording_dropped = Counter(
            "rtmedia_recording_dropped_total", "Events and audio chunks left out of recordings because the writer "
            "fell behind (its queue was full)", registry=r,
        )

    def _video_and_graphs(self, r: CollectorRegistry) -> None:
        """DecodeVideo streams and the engines' CUDA graphs."""
        self.video_chunks_total = Counter(
            "rtmedia_video_chunks_total", "DecodeVideo chunks sent (a chunk split into parts counts once)", registry=r
        )
        self.video_decodes_total = Counter(
            "rtmedia_video_decodes_total", "DecodeVideo streams by outcome (completed, cancelled, failed)",
            ["outcome"], registry=r,
        )
        self.video_first_chunk_seconds = Histogram(
            "rtmedia_video_first_chunk_seconds", "DecodeVideo: request to the first chunk sent",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.graph_replays = Counter(
            "rtmedia_graph_replays_total", "Engine steps run by replaying a CUDA graph", ["engine"], registry=r
        )
        self.graph_misses = Counter(
            "rtmedia_graph_misses_total", "Engine steps run eagerly, by reason (ineligible, capacity, warmup, memory, failed)",
            ["engine", "reason"], registry=r,
        )
        self.graphs = Gauge("rtmedia_graphs", "CUDA graphs an engine holds (captured, never evicted)", ["engine"],
                            registry=r)
        self.graph_capture_failures = Gauge(
            "rtmedia_graph_capture_failures", "CUDA-graph captures that failed (an engine then runs eagerly)",
            ["engine"], registry=r,
        )

    def _rpcs(self, r: CollectorRegistry) -> None:
        """The gRPC server's RPCs."""
        self.grpc_handled = Counter(
            "grpc_server_handled_total", "RPCs completed on the server",
            ["grpc_type", "grpc_service", "grpc_method", "grpc_code"], registry=r,
        )
        self.grpc_handling_seconds = Histogram(
            "grpc_server_handling_seconds", "RPC duration on the server",
            ["grpc_type", "grpc_service", "grpc_method"], buckets=RPC_BUCKETS, registry=r,
        )
