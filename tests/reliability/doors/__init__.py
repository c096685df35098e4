"""The server's doors, for fuzzing: one registry (`DOORS`) of what can be sent through each
door (a Hypothesis strategy of cases) and how one case is sent and judged (an async runner),
shared by the quick tests (tests/reliability/test_fuzz.py) and the long run
(tests/reliability/fuzz.py).

A door is registered with `@door(name, cases, needs=...)` (doors/core.py) on its runner;
`needs` names what the server must offer for it ("riva", "web", "auth", "openai", "twilio",
"sip"). A new door (a service, a method, an HTTP route) is one strategy and one runner in the
module of its kind (services, web_port, realtime, telephony), and both the quick tests and the
long run pick it up. Request messages come from `strategies.message`, which fuzzes every field of a request
type, so a field added to a request later is covered without a change here.

What every case must end with (`run_case` checks it all):
- a clear answer: a gRPC status other than UNKNOWN or INTERNAL, with an ErrorInfo reason
  whenever rtmedia (not grpc's core: message size, unknown method) ends the call; or `error`
  events on a stream that stays open, each with a code and a message, never `server_error`;
  over HTTP a status below 500 (or 502/503) and, for an error, the bridge's JSON shape; on a
  WebSocket (/v1/realtime) the upgrade or OpenAI's error below 500, then server events that are
  JSON with a type and a unique event_id, and `error` events in OpenAI's nested shape, never
  `server_error`, on a socket that stays open (only a frame over its limit closes it, 1009);
- an end: a stream ends within a bounded time once the client closes it (a response still
  playing out is the only thing that may hold a half-closed Converse stream open), and a
  socket answers the client's close;
- nothing left behind: the server's sessions and the bridge's peers back to their baseline;
- the server still there: alive and answering health, with no error logged.
"""

from tests.reliability.doors import realtime, services, telephony, web_port  # noqa: F401  (they register their doors)
from tests.reliability.doors.core import (
    DOORS,
    Door,
    Outcome,
    SipTarget,
    Target,
    Verdict,
    case_repr,
    doors_for,
    offer_sdp,
    probe_latent_channels,
    run_case,
)
from tests.reliability.doors.services import METHODS

__all__ = ["DOORS", "METHODS", "Door", "Outcome", "SipTarget", "Target", "Verdict", "case_repr", "doors_for",
           "offer_sdp", "probe_latent_channels", "run_case"]
