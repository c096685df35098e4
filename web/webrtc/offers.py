"""What the bridge takes in an SDP offer (`POST /offer`, `POST /whip`, `POST /v1/realtime/calls`).

`validate_offer` checks an offer before any slot, session or peer connection is spent on it,
and refuses it with `OfferError(4xx)` naming what is wrong, in words a client can act on (a
line, a section, an attribute; never an exception of aiortc's parser):

- its size and number of media sections (the operator's bounds);
- what aiortc would otherwise fail on deep inside, or worse in a task of its own: a line it
  cannot read, the sections' kinds and mids, the BUNDLE groups, the codecs;
- what would let it be answered but never connect, holding a slot and a session until the
  connect deadline: no audio section, an audio section the browser rejected (port 0) or does
  not send on, a section without ICE credentials, or whose DTLS fingerprints are all in
  algorithms aiortc cannot check the browser's certificate with.

`negotiation_failure` words what aiortc raises while it takes or answers an offer that passed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from aiortc.exceptions import InternalError, InvalidAccessError, InvalidStateError, OperationError
from aiortc.rtcdtlstransport import X509_DIGEST_ALGORITHMS
from aiortc.rtcrtpsender import RTCRtpSender
from aiortc.sdp import SessionDescription
from rtmedia.web.webrtc.peer import OfferError

# A browser's offer (audio, video, data channel) is 4-12 KB of SDP; JSON adds a little.
MAX_BODY_BYTES = 64 * 1024
# The page offers audio, video and the data channel; WHIP clients audio and video.
MAX_MEDIA_SECTIONS = 4
MEDIA_KINDS = ("audio", "video", "application")
# The fingerprint algorithms aiortc checks a browser's DTLS certificate against (a=fingerprint).
DTLS_ALGORITHMS = tuple(X509_DIGEST_ALGORITHMS)
# aiortc's own exceptions: their messages say what it could not negotiate.
AIORTC_ERRORS = (InternalError, InvalidAccessError, InvalidStateError, OperationError)
# What aiortc raises for an offer it cannot take (setRemoteDescription, createAnswer, setLocalDescription).
NEGOTIATION_ERRORS = (ValueError, TypeError, KeyError, IndexError, *AIORTC_ERRORS)
# An unreadable offer of at most this many lines has its line found (by parsing prefixes, a few
# times over); a longer one, never a browser's, is only said to be unreadable, at the cost of one parse.
LOCATE_MAX_LINES = 400
SENDING = ("sendrecv", "sendonly")


def validate_offer(sdp: Any, max_bytes: int = MAX_BODY_BYTES, max_media: int = MAX_MEDIA_SECTIONS) -> SessionDescription:
    """The parsed offer, or OfferError(4xx) naming what is wrong with it (see the module's text)."""
    if not isinstance(sdp, str) or not sdp.strip():
        raise OfferError(400, "the offer has no SDP")
    try:
        size = len(sdp.encode("utf-8"))
    except UnicodeEncodeError:
        raise OfferError(400, "the SDP offer is not valid Unicode text (it holds a lone surrogate)") from None
    if size > max_bytes:
        raise OfferError(413, f"the SDP offer is {size} bytes; at most {max_bytes} are accepted (--max-body-bytes)")
    if not sdp.lstrip().startswith("v=0"):
        raise OfferError(400, "malformed SDP offer: it must start with 'v=0'")
    sections = sum(1 for line in sdp.splitlines() if line.startswith("m="))
    if sections > max_media:
        raise OfferError(400, f"the SDP offer has {sections} media sections (m= lines); at most {max_media} are "
                              "accepted (--max-media-sections)")
    parsed = _parse(sdp)
    _check_sections(parsed)
    _check_microphone(parsed, _bundle_only(sdp))
    _check_transport(parsed)
    return parsed


def negotiation_failure(exc: BaseException) -> str:
    """What aiortc could not negotiate, in its own words where it has some (its exceptions, and
    the ValueErrors of its checks: `RTCP mux is not enabled`); never a bare exception of
    Python's (a KeyError's text is only the missing key)."""
    text = str(exc).strip()
    if isinstance(exc, (ValueError, *AIORTC_ERRORS)) and text:
        return text[:200]
    return "aiortc could not negotiate its media sections"


def _parses(sdp: str) -> bool:
    try:
        SessionDescription.parse(sdp)
    except Exception:  # the parser raises whatever the bad line provokes
        return False
    return True


def _parse(sdp: str) -> SessionDescription:
    """aiortc's parse of the offer; OfferError naming the first line it cannot read."""
    try:
        return SessionDescription.parse(sdp)
    except Exception:  # the parser raises whatever the bad line provokes: AssertionError, KeyError, ...
        pass
    lines = sdp.splitlines()
    if len(lines) > LOCATE_MAX_LINES:
        raise OfferError(400, "malformed SDP offer: aiortc cannot read it (one of its lines is not valid SDP)")
    # The prefix of `good` lines parses and that of `bad` lines does not: line `bad` is the culprit.
    good, bad = 0, len(lines)
    while bad - good > 1:
        middle = (good + bad) // 2
        if _parses("\r\n".join(lines[:middle]) + "\r\n"):
            good = middle
        else:
            bad = middle
    raise OfferError(400, f"malformed SDP offer: line {bad} cannot be read: {lines[bad - 1][:100]!r}")


def _bundle_only(sdp: str) -> list[bool]:
    """Per media section, in order: whether it carries a=bundle-only (RFC 8843: port 0, yet in use
    through its BUNDLE group). aiortc's parser drops that attribute."""
    flags: list[bool] = []
    for line in sdp.splitlines():
        if line.startswith("m="):
            flags.append(False)
        elif flags and line.strip() == "a=bundle-only":
            flags[-1] = True
    return flags


def _section(m: Any) -> str:
    return f"{m.kind} section (mid {m.rtp.muxId[:32]})"


def _check_microphone(parsed: SessionDescription, bundle_only: list[bool]) -> None:
    """An audio section the browser sends its microphone on: present, not rejected (port 0
    without a=bundle-only), and sendrecv or sendonly."""
    audio = [(m, only) for m, only in zip(parsed.media, bundle_only, strict=True) if m.kind == "audio"]
    if not audio:
        raise OfferError(400, "the SDP offer has no audio section: the bridge needs the microphone (m=audio)")
    live = [m for m, only in audio if m.port != 0 or only]
    if not live:
        raise OfferError(400, f"the SDP offer's {_section(audio[0][0])} is rejected (m=audio 0, port 0): "
                              "the bridge needs the microphone on an audio section with a port")
    if not any((m.direction or "sendrecv") in SENDING for m in live):
        direction = live[0].direction
        said = "receive-only" if direction == "recvonly" else direction
        raise OfferError(400, f"the SDP offer's audio is {said} (a={direction}): the bridge needs the browser "
                              "to send its microphone (a=sendrecv or a=sendonly)")


def _check_transport(parsed: SessionDescription) -> None:
    """ICE credentials and a DTLS fingerprint aiortc can check, in every section (aiortc reads
    them even from a rejected one)."""
    for m in parsed.media:
        if not (m.ice.usernameFragment and m.ice.password and m.dtls and m.dtls.fingerprints):
            raise OfferError(400, f"the SDP offer's {_section(m)} lacks ICE credentials or a DTLS fingerprint")
        if not any(f.algorithm.lower() in DTLS_ALGORITHMS for f in m.dtls.fingerprints):
            given = ", ".join(dict.fromkeys(f.algorithm[:16] for f in m.dtls.fingerprints[:8]))
            raise OfferError(400, f"the SDP offer's {_section(m)} has no DTLS fingerprint the bridge can check: "
                                  f"it gives {given} (a=fingerprint); the bridge checks "
                                  f"{', '.join(DTLS_ALGORITHMS)}")


def _check_sections(parsed: SessionDescription) -> None:
    """Kinds, mids, BUNDLE groups and codecs of the offer's media sections."""
    for m in parsed.media:
        if m.kind not in MEDIA_KINDS:
            raise OfferError(400, f"the SDP offer has a {m.kind[:32]!r} section (m={m.kind[:32]}); the bridge takes "
                                  "audio, video and one application (data channel) section")
    if sum(m.kind == "application" for m in parsed.media) > 1:
        raise OfferError(400, "the SDP offer has more than one application (data channel) section")
    mids = [m.rtp.muxId for m in parsed.media]
    if not all(mids):
        index = mids.index(next(mid for mid in mids if not mid))
        raise OfferError(400, f"media section {index} (m={parsed.media[index].kind}) of the SDP offer has no a=mid")
    shared = sorted(mid for mid, n in Counter(mids).items() if n > 1)
    if shared:
        raise OfferError(400, f"mid {shared[0][:32]} names more than one media section of the SDP offer")
    bundled: set[str] = set()
    for group in parsed.group:
        if group.semantic != "BUNDLE":
            continue
        items = [str(item) for item in group.items]
        unknown = [item for item in items if item not in mids]
        if unknown:
            raise OfferError(400, f"the SDP offer's BUNDLE group names mid {unknown[0][:32]}, "
                                  "which no media section has")
        if len(set(items)) != len(items) or bundled & set(items):
            raise OfferError(400, "the SDP offer's BUNDLE groups name a mid more than once")
        bundled.update(items)
    for m in parsed.media:
        if m.kind == "application":
            continue
        supported = {c.mimeType.lower(): c.mimeType.split("/", 1)[1] for c in RTCRtpSender.getCapabilities(m.kind).codecs
                     if not c.mimeType.lower().endswith("/rtx")}
        offered = [c.mimeType for c in m.rtp.codecs]
        if not any(mime.lower() in supported for mime in offered):
            named = ", ".join(mime.split("/", 1)[1] for mime in offered[:8] if "/" in mime) or "none"
            raise OfferError(400, f"the SDP offer's {m.kind} section (mid {m.rtp.muxId[:32]}) has no codec the "
                                  f"bridge supports: it offers {named[:200]}; the bridge takes "
                                  f"{', '.join(dict.fromkeys(supported.values()))}")
