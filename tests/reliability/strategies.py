"""Hypothesis strategies for hostile input to rtmedia's doors.

- `message(RequestType, hints)`: a protobuf message of any type, built from its descriptor:
  every field at random presence, with the values that break servers (bounds and wrong signs
  of every integer type, unknown enum values, NaN and infinities, empty, blank, control and
  very long strings, odd-length and oversized bytes), nested messages, repeated and map fields,
  and at most one member of each oneof. `hints` replace the generic strategy of the fields
  whose domain matters (a sample rate, a voice name), keyed by dotted field path; a hint may
  draw `UNSET` to leave its field out. A field added to a request later is fuzzed with no
  change here.
- `audio()`: PCM that is real speech (sliced anywhere, so odd lengths and mid-sample cuts),
  silence, full-scale square waves, garbage, empty, or huge.
- `sdp_edits()` / `apply_edits()`: line-level mutations of a real SDP offer.
- `json_values()`, `header_values()`: JSON of any shape, HTTP header values.

Values that need the server or a real offer (the last response id a stream saw, the VAE's
latent channels, the offer to mutate) are drawn as markers that the door's runner resolves.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()
Hints = Mapping[str, st.SearchStrategy[Any]]

_F = FieldDescriptor
_BOUNDS = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1), _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1), _F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1), _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}
# Sample rates, sizes and limits rtmedia checks, and their neighbours.
RATES = (0, 1, 7, 8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 96000)
SPECIAL_INTS = (0, 1, -1, 2, 3, 4, 7, 16, 100, 255, 256, 257, 1000, 2000, 2001, 4096, 5000, 5001, 65535, 86400)
SPECIAL_FLOATS = (0.0, 0.5, 1.0, -1.0, 0.04, 0.05, 0.95, 0.96, 1e-9, 3e38, -3e38, math.nan, math.inf, -math.inf)
SPECIAL_TEXT = ("", " ", "\t\n", "x", "en-US", "en-us", "EN-us", "de-DE", "\x00", "é", "\u202e", "🙂", "..", "/",
                "%s%n", "${x}", "'; --", "a" * 257)
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)


def sometimes(strategy: st.SearchStrategy[Any], present: int = 1, absent: int = 1) -> st.SearchStrategy[Any]:
    """`strategy`'s value `present` times in `present + absent`, else UNSET (shrinks towards UNSET)."""
    return st.sampled_from([False] * absent + [True] * present).flatmap(
        lambda on: strategy if on else st.just(UNSET))


def weighted(strategies: list[st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of `strategies`, each as often as it is listed (st.one_of would merge repeats)."""
    return st.sampled_from(strategies).flatmap(lambda strategy: strategy)


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Any integer in [low, high], often one of the values limits are made of."""
    special = sorted({v for v in (*SPECIAL_INTS, *RATES, low, low + 1, high - 1, high) if low <= v <= high})
    return st.one_of(st.sampled_from(special), st.integers(low, high))


def floats() -> st.SearchStrategy[float]:
    """float32 values, NaN and infinities included."""
    return st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(width=32))


def long_text(low: int = 200, high: int = 6000) -> st.SearchStrategy[str]:
    return st.builds(lambda char, n: char * n, st.sampled_from(["a", "é", "🙂", " ", "word "]), st.integers(low, high))


def strings(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=max_size), st.sampled_from(SPECIAL_TEXT), long_text())


def blobs(max_repeat: int = 1 << 16) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=64),
                     st.builds(lambda pattern, n: pattern * n, st.binary(min_size=1, max_size=4),
                               st.integers(16, max_repeat)))


# ---- audio -------------------------------------------------------------------------------------------

SENTENCE = "Please tell me what the weather will be like tomorrow morning."


@functools.cache
def speech_pcm(rate: int) -> bytes:
    """A spoken sentence as PCM16 at `rate` (Piper, deterministic); synthesised on first use."""
    from tests.support.speech import Speaker

    return Speaker().say(SENTENCE, rate).tobytes()


def _speech_slice(rate: int, start: float, length: int, odd: bool) -> bytes:
    pcm = speech_pcm(rate)
    offset = int(start * len(pcm))
    piece = pcm[offset:offset + length]
    return piece + b"\x01" if odd else piece


def audio(max_huge: int = 7 * 1024 * 1024) -> st.SearchStrategy[bytes]:
    """Audio a client might send: speech at a supported rate (possibly not the session's, cut at
    any byte), silence, full-scale square waves, garbage, empty, or huge (up to `max_huge`)."""
    speech = st.builds(_speech_slice, st.sampled_from([8000, 16000, 24000]), st.floats(0, 1),
                       st.integers(0, 96000), st.booleans())
    silence = st.builds(lambda n: b"\0\0" * n, st.integers(0, 24000))
    square = st.builds(lambda n: b"\xff\x7f\x00\x80" * n, st.integers(1, 12000))
    huge = st.builds(lambda pattern, n: (pattern * (n // len(pattern) + 1))[:n], st.binary(min_size=1, max_size=3),
                     st.integers(max(1, max_huge // 2), max_huge))
    kinds = [speech, speech, speech, silence, silence, square, st.binary(max_size=512), st.just(b""),
             st.binary(min_size=1, max_size=1)]
    if max_huge > 0:
        kinds.append(huge)
    return weighted(kinds)


# ---- protobuf messages ---------------------------------------------------------------------------------

def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _real_oneofs(descriptor: Descriptor) -> list[Any]:
    """The oneofs that are not proto3 `optional` (a synthetic oneof of one field named `_field`)."""
    return [o for o in descriptor.oneofs if not (len(o.fields) == 1 and o.name == f"_{o.fields[0].name}")]


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _BOUNDS:
        return integers(*_BOUNDS[kind])
    if kind in (_F.TYPE_FLOAT, _F.TYPE_DOUBLE):
        return floats()
    if kind == _F.TYPE_BOOL:
        return st.booleans()
    if kind == _F.TYPE_STRING:
        return strings()
    if kind == _F.TYPE_BYTES:
        return blobs()
    if kind == _F.TYPE_ENUM:
        known = st.sampled_from(sorted(field.enum_type.values_by_number))
        return known if field.enum_type.is_closed else st.one_of(known, known, st.integers(-3, 64))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _value(field: FieldDescriptor, hints: Hints, path: str, depth: int) -> st.SearchStrategy[Any]:
    if path in hints:
        return hints[path]
    if _is_map(field):
        entry = field.message_type
        key = _value(entry.fields_by_name["key"], hints, f"{path}.key", depth)
        value = _value(entry.fields_by_name["value"], hints, f"{path}.value", depth - 1)
        return st.dictionaries(key, value, max_size=3)
    if field.message_type is not None:
        single = _message(field.message_type, hints, f"{path}.", depth - 1)
    else:
        single = _scalar(field)
    if field.is_repeated:
        return st.lists(single, max_size=4)
    return single


def _assign(msg: Message, field: FieldDescriptor, value: Any) -> None:
    """Set `value` on `msg`; a value protobuf refuses (a closed enum, an out-of-range number) is skipped."""
    target = getattr(msg, field.name) if (field.is_repeated or field.message_type is not None) else None
    try:
        if _is_map(field):
            for key, item in value.items():
                if isinstance(item, Message):
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif field.is_repeated:
            for item in value:
                if isinstance(item, Message):
                    target.add().CopyFrom(item)
                else:
                    target.append(item)
        elif field.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(msg, field.name, value)
    except (ValueError, TypeError, OverflowError):
        pass


def _message(descriptor: Descriptor, hints: Hints, prefix: str, depth: int) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(descriptor)
    if depth < 0:
        return st.just(cls())
    oneofs = []  # (member strategy, {member: (field, value strategy)})
    in_oneof = set()
    for oneof in _real_oneofs(descriptor):
        names = [f.name for f in oneof.fields]
        in_oneof.update(names)
        path = f"{prefix}{oneof.name}"
        members = {f.name: (f, _value(f, hints, f"{prefix}{f.name}", depth)) for f in oneof.fields}
        oneofs.append((hints[path] if path in hints else st.sampled_from([None, *names]), members))
    fields = []  # (field, strategy drawing a value or UNSET)
    for field in descriptor.fields:
        if field.name not in in_oneof:
            path = f"{prefix}{field.name}"
            strategy = _value(field, hints, path, depth)
            fields.append((field, strategy if path in hints else sometimes(strategy)))

    @st.composite
    def build(draw: Any) -> Message:
        msg = cls()
        for choose, members in oneofs:
            member = draw(choose)
            if member is not None:
                field, strategy = members[member]
                value = draw(strategy)
                if value is not UNSET:
                    _assign(msg, field, value)
        for field, strategy in fields:
            value = draw(strategy)
            if value is not UNSET:
                _assign(msg, field, value)
        return msg

    return build()


def message(cls: type[Message], hints: Hints | None = None, depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of type `cls` (see the module docstring). Hints are keyed by the dotted path of
    a field from `cls` (`config.sample_rate_hertz`), or of a oneof, whose hint draws the
    member name to set (or None)."""
    return _message(cls.DESCRIPTOR, hints or {}, "", depth)


# ---- SDP ------------------------------------------------------------------------------------------------

SDP_LINES = (
    "a=group:BUNDLE 0 1 2 3", "a=group:BUNDLE", "a=group:LS 0", "m=text 9 UDP/TLS/RTP/SAVPF 0",
    "m=audio 0 RTP/AVP 0", "m=audio 9 UDP/TLS/RTP/SAVPF", "m=video 9 UDP/TLS/RTP/SAVPF 96",
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel", "a=mid:", "a=mid:0", "a=rtpmap:111 nosuch/48000/2",
    "a=rtpmap:x opus/48000/2", "a=rtpmap:111 opus/0/0", "c=IN IP4 0.0.0.0", "c=IN IP6 ::1", "c=IN XX 1",
    "a=fingerprint:sha-256 00", "a=fingerprint:md5 AB:CD", "a=ice-ufrag:", "a=ice-pwd:", "a=setup:actpass",
    "a=setup:nonsense", "a=sendonly", "a=recvonly", "a=inactive", "a=ssrc:1 cname:x", "a=ssrc:x",
    "a=extmap:1 urn:x", "a=extmap:99999999999 urn:x", "a=candidate:1 1 udp 1 1.2.3.4 5 typ host",
    "a=candidate:garbage", "a=sctp-port:99999", "a=sctp-port:-1", "a=max-message-size:-1", "b=AS:-5",
    "a=rtcp-mux", "a=rtcp:9 IN IP4 0.0.0.0", "a=fmtp:111 minptime=10;useinbandfec=1", "a=fmtp:111",
    "a=rtcp-fb:111 nack", "a=msid:- -", "o=- 0 0 IN IP4 127.0.0.1", "o=", "s=-", "t=0 0", "v=1", "v=0", "",
    "a=", "=", "m=", "a=ice-options:trickle", "a=ssrc-group:FID 1 2 3",
)
SDP_OPS = ("drop", "duplicate", "replace", "insert", "truncate", "swap", "lf", "upper")


@dataclass(frozen=True)
class SdpEdit:
    op: str
    at: float  # where, as a fraction of the offer's lines (or characters, for truncate)
    line: str


def sdp_lines() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(SDP_LINES), st.text(PRINTABLE, max_size=40),
                     st.builds(lambda p, t: p + t, st.sampled_from(["a=", "m=", "c=", "b=", "o="]),
                               st.text(PRINTABLE, max_size=40)))


def sdp_edits(max_edits: int = 4) -> st.SearchStrategy[list[SdpEdit]]:
    return st.lists(st.builds(SdpEdit, st.sampled_from(SDP_OPS), st.floats(0, 1), sdp_lines()), max_size=max_edits)


def apply_edits(sdp: str, edits: list[SdpEdit]) -> str:
    """`sdp` with the edits applied in order."""
    lines = sdp.split("\r\n")
    for edit in edits:
        at = min(len(lines) - 1, int(edit.at * len(lines))) if lines else 0
        if edit.op == "drop" and lines:
            del lines[at]
        elif edit.op == "duplicate" and lines:
            lines.insert(at, lines[at])
        elif edit.op == "replace" and lines:
            lines[at] = edit.line
        elif edit.op == "insert":
            lines.insert(at, edit.line)
        elif edit.op == "swap" and len(lines) > 1:
            other = (at + 1 + int(edit.at * 997)) % len(lines)
            lines[at], lines[other] = lines[other], lines[at]
        elif edit.op == "truncate":
            text = "\r\n".join(lines)
            lines = text[:int(edit.at * len(text))].split("\r\n")
        elif edit.op == "lf":
            lines = "\n".join(lines).split("\r\n")
        elif edit.op == "upper" and lines:
            lines[at] = lines[at].upper()
    return "\r\n".join(lines)


# ---- HTTP -----------------------------------------------------------------------------------------------

def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=20))
    return st.recursive(scalars, lambda children: st.one_of(st.lists(children, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), children,
                                                                            max_size=4)),
                        max_leaves=max_leaves)


def header_values(max_size: int = 80) -> st.SearchStrategy[str]:
    """Printable ASCII without leading or trailing blanks (what an HTTP client lets through)."""
    return st.text(PRINTABLE, max_size=max_size).map(str.strip)


def path_segments() -> st.SearchStrategy[str]:
    return st.one_of(st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=50),
                     st.sampled_from(["..", ".", "%00", "%2e%2e", "a%2Fb", "🙂", " ", "x" * 3000, "None", "null"]),
                     st.text(PRINTABLE, min_size=1, max_size=30))
