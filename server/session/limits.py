"""The server-wide limits every duplex session runs under (sent in session.created).

One `Limits` is shared by the realtime service and all its sessions; its own module so
that the session's parts (outbox, reply pipeline, recognition) can take it without
importing the session. `rtmedia.server.session.session` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rtmedia.v1 import realtime_pb2


@dataclass
class Limits:
    inbox_ms: int = 2000
    max_camera_frames: int = 8
    max_camera_frame_bytes: int = 2 * 1024 * 1024
    max_camera_total_bytes: int = 4 * 1024 * 1024
    # A typed text item (conversation.item.create); like the instructions, sized so that one
    # fits the embedded LM's context beside the conversation and the reply.
    max_text_chars: int = 2000
    max_instructions_chars: int = 2000
    # The audio of one conversation.item.create audio item: a turn's worth (its recogniser
    # decodes it in one piece), well inside the server's 8 MiB message limit.
    max_item_audio_ms: int = 60_000
    # Ids and names a client sends and the server may echo (event_id, response and item ids,
    # voice, responder), in bytes.
    max_id_bytes: int = 256
    # What may wait for a client that does not read: events and bytes (server/session/outbox.py).
    max_outbox_events: int = 4096
    max_outbox_bytes: int = 8 * 1024 * 1024
    # The longest session and idle timeout a client may ask for (session.update), in seconds.
    max_session_s: int = 14400
    max_idle_timeout_s: int = 1800
    transcript_wait_s: float = 20.0  # a late reply beats a failed one under overload
    # At a pause in a server_vad turn (160 ms of silence, silence_duration_ms not
    # yet reached) the recogniser finishes the turn's audio so far, so the final is ready by
    # speech_stopped; speech that resumes starts a new segment, and the turn's transcript joins
    # the segments' finals.
    early_finals: bool = True
    # semantic_vad's thresholds by eagerness that replace server/hearing/semantic_turns.py's THRESHOLDS.
    turn_thresholds: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # Reply audio goes out in deltas of this length, at most output_lead_ms ahead of
    # the client's playback (acked position, or wall clock since the first delta).
    output_delta_ms: int = 200
    output_lead_ms: int = 1000
    # A function call's output (and the arguments of a call the client records), in characters.
    max_tool_output_chars: int = 8000
    # What the server says while a function call is out (a filler, taken in turn) and when one
    # goes unanswered for tool_timeout_ms (server/session/tool_calls.py).
    tool_fillers: tuple[str, ...] = ("One moment.", "Let me check.", "Just a second.")
    tool_apology: str = "Sorry, that is taking too long. Please ask me again in a moment."

    @property
    def session_caps(self) -> dict[str, int]:
        return {"max_session_s": self.max_session_s, "idle_timeout_s": self.max_idle_timeout_s}

    def to_proto(self, max_sessions: int, lm_slots: int) -> realtime_pb2.SessionLimits:
        return realtime_pb2.SessionLimits(
            inbox_ms=self.inbox_ms, max_camera_frames=self.max_camera_frames,
            max_camera_frame_bytes=self.max_camera_frame_bytes, max_camera_total_bytes=self.max_camera_total_bytes,
            max_text_chars=self.max_text_chars, max_sessions=max_sessions, lm_slots=lm_slots,
        )
