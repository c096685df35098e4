"""What the sessions of one server share (`SessionContext`): the servicer builds it once and
hands it to every `Session` it opens (server/session/session.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.lanes.clock import SYSTEM_CLOCK, Clock
from rtmedia.server.observe.recording import NO_RECORDINGS, RecordingPolicy
from rtmedia.server.session.limits import Limits


@dataclass(frozen=True)
class SessionContext:
    """What the sessions of one server share: the engines (through the scheduler's handles),
    the limits, and the admission figures that session.created states."""

    access: EngineAccess
    limits: Limits
    max_sessions: int
    lm_slots: int
    recording: RecordingPolicy = NO_RECORDINGS  # which sessions are recorded (server/observe/recording.py)
    clock: Clock = SYSTEM_CLOCK  # what its timers run on (server/lanes/clock.py)
