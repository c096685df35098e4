"""The web port's HTTP doors: WebRTC offers and WHIP, every other route, and OpenAI's audio APIs
(speech and transcriptions)."""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import numpy as np
from hypothesis import strategies as st

from tests.reliability.doors.core import END_S, Outcome, Target, door
from tests.reliability.strategies import (
    RATES,
    apply_edits,
    floats,
    header_values,
    json_values,
    long_text,
    path_segments,
    sdp_edits,
    speech_pcm,
    strings,
    weighted,
)

# ---- the web port (web/bridge.py) -------------------------------------------------------------------------

WEB_CREDENTIALS = ("good", "good", "good", "good", "good", "none", "wrong", "malformed")
CONTENT_TYPES = ("application/json", "application/sdp", "text/plain", "", "application/json; charset=utf-8",
                 "application/json; charset=latin-1", "application/json; charset=nonsense",
                 "application/sdp; charset=ascii", "multipart/form-data; boundary=x",
                 "application/x-www-form-urlencoded")
EXTRA_HEADERS = ("Origin", "Cookie", "User-Agent", "X-Forwarded-For", "Accept", "Sec-WebSocket-Protocol",
                 "Upgrade", "Connection")


@dataclass(frozen=True)
class WebCall:
    method: str
    path: str  # may hold {peer}: a path segment
    segment: str
    body: Any  # bytes, or ("offer", edits, type, extra fields), or ("sdp", edits), or ("json", value)
    content_type: str
    credential: str
    junk: str
    headers: tuple[tuple[str, str], ...]


def _content_types() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(CONTENT_TYPES), header_values(40))


def _headers() -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    return st.lists(st.tuples(st.sampled_from(EXTRA_HEADERS),
                              st.one_of(header_values(), st.just("websocket"),
                                        st.builds(lambda t: f"rtmedia.bearer.{t}", header_values(40)))),
                    max_size=3).map(tuple)


OFFER_BODIES = st.one_of(
    st.tuples(st.just("offer"), sdp_edits(), st.sampled_from(["offer", "offer", "answer", "", None, 1]),
              st.dictionaries(st.text(max_size=8), json_values(4), max_size=2)),
    st.tuples(st.just("json"), json_values()),
    st.binary(max_size=256),
)
WHIP_BODIES = st.one_of(st.tuples(st.just("sdp"), sdp_edits()), st.binary(max_size=256),
                        st.text(max_size=200).map(str.encode))


def _web_call(method: st.SearchStrategy[str], path: st.SearchStrategy[str], bodies: st.SearchStrategy[Any],
              content_types: st.SearchStrategy[str]) -> st.SearchStrategy[WebCall]:
    return st.builds(WebCall, method, path, path_segments(), bodies, content_types, st.sampled_from(WEB_CREDENTIALS),
                      header_values(60), _headers())


WEB_OFFER = _web_call(st.just("POST"), st.just("/offer"), OFFER_BODIES,
                      weighted([st.just("application/json")] * 3 + [_content_types()]))
WEB_WHIP = _web_call(st.just("POST"), st.just("/whip"), WHIP_BODIES,
                     weighted([st.just("application/sdp")] * 3 + [_content_types()]))
WEB_ROUTES = _web_call(st.sampled_from(["GET", "DELETE", "PATCH", "OPTIONS", "PUT", "POST", "HEAD"]),
                       st.sampled_from(["/peers/{peer}", "/whip/{peer}", "/whip", "/offer", "/healthz", "/config",
                                        "/", "/static/{peer}", "/{peer}", "/peers/{peer}/{peer}", "/v1/models",
                                        "/v1/models/{peer}", "/v1/{peer}", "/v1/audio/{peer}"]),
                       st.one_of(st.binary(max_size=64), st.tuples(st.just("json"), json_values(6))), _content_types())
OPEN_PATHS = ("/", "/healthz")


def _web_body(target: Target, body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if body[0] == "multipart":
        return multipart_body(target, body[1])
    if body[0] == "sdp":
        return apply_edits(target.offer_sdp, body[1]).encode("utf-8", "surrogatepass")
    if body[0] == "json":
        return json.dumps(body[1]).encode()
    _, edits, kind, extra = body
    return json.dumps({**extra, "sdp": apply_edits(target.offer_sdp, edits), "type": kind}).encode()


def _web_headers(target: Target, call: WebCall) -> dict[str, str]:
    headers = dict(call.headers)
    if call.content_type:
        headers["Content-Type"] = call.content_type
    token = {"good": target.token, "wrong": "wrong-token-0123456789abcdef"}.get(call.credential)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    elif call.credential == "malformed" and call.junk:
        headers["Authorization"] = call.junk
    return headers


async def _web(target: Target, call: WebCall) -> Outcome:
    import aiohttp
    from yarl import URL

    outcome = Outcome()
    path = call.path.replace("{peer}", quote(call.segment, safe=""))
    url = URL(f"{target.web_url}{path}", encoded=True)
    try:
        async with target.http.request(call.method, url, data=_web_body(target, call.body),
                                       headers=_web_headers(target, call),
                                       timeout=aiohttp.ClientTimeout(total=END_S * 2)) as res:
            body = await res.read()
            status, content_type = res.status, res.content_type
            location = res.headers.get("Location", "")
    except TimeoutError:
        outcome.status("CLIENT_TIMEOUT")
        outcome.problems.append(f"{call.method} {path[:80]} got no answer within {END_S * 2:g} s")
        return outcome
    reason = ""
    parsed: Any = None
    if content_type == "application/json":
        with contextlib.suppress(ValueError):
            parsed = json.loads(body)
            reason = parsed.get("reason", "") if isinstance(parsed, dict) else ""
            if openai_error(parsed):  # OpenAI's shape: its code (or type) is the reason
                reason = parsed["error"].get("code") or parsed["error"]["type"]
    outcome.status(f"HTTP {status}", reason)
    where = f"{call.method} {path[:80]}"
    if status >= 500 and status not in (502, 503):
        outcome.problems.append(f"{where}: HTTP {status}: {body[:300]!r}")
    if status >= 400 and call.method != "HEAD" and not (isinstance(parsed, dict) and parsed.get("error")):
        outcome.problems.append(f"{where}: HTTP {status} without the bridge's JSON error: {body[:300]!r}")
    elif status >= 400 and call.method != "HEAD" and path.startswith("/v1/") and not openai_error(parsed):
        outcome.problems.append(f"{where}: HTTP {status} without OpenAI's error object: {body[:300]!r}")
    valid = call.credential == "good" or target.token is None
    if target.token and not valid and status < 400 and path not in OPEN_PATHS and \
            not (call.method in ("GET", "HEAD") and path.startswith("/static/")):
        outcome.problems.append(f"{where}: HTTP {status} without a valid token")
    if target.token and call.credential == "good" and status == 401:
        outcome.problems.append(f"{where}: HTTP 401 with a valid token: {body[:300]!r}")
    # A peer the case made is ended by its own id, as its browser would.
    peer = ""
    if status == 200 and path == "/offer" and isinstance(parsed, dict):
        peer = f"/peers/{parsed.get('id', '')}"
    elif status == 201 and location.startswith("/whip/"):
        peer = location
    if peer:
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        async with target.http.delete(f"{target.web_url}{peer}", headers=headers) as res:
            if res.status != 200:
                outcome.problems.append(f"DELETE {peer[:20]}... of a peer this case made: HTTP {res.status}")
    return outcome


@door("web_offer", WEB_OFFER, needs=["web"], peers=True)
async def web_offer(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


@door("web_whip", WEB_WHIP, needs=["web"], peers=True)
async def web_whip(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


@door("web_routes", WEB_ROUTES, needs=["web"], peers=True)
async def web_routes(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


# ---- OpenAI's audio APIs on the web port (web/openai_*.py) -------------------------------------------------

def openai_error(parsed: Any) -> bool:
    """Whether a JSON body is OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return isinstance(error, dict) and bool(error.get("message")) and isinstance(error.get("type"), str) and \
        {"param", "code"} <= error.keys()


SPEAKABLE = ("Hello there.", "Open the window, please.", "Nine o'clock.", "Yes")
SPEECH_FIELDS = {
    "model": weighted([st.just("tts-1")] * 3 + [st.sampled_from(["gpt-4o-mini-tts", "rtmedia-piper", "whisper-1",
                                                                  ""]), json_values(2)]),
    "input": weighted([st.sampled_from(SPEAKABLE)] * 4 + [strings(60), json_values(2), long_text(4990, 5010)]),
    "voice": st.one_of(st.sampled_from(["alloy", "en_US-joe-medium", "nobody", "", "verse"]), json_values(2),
                       st.fixed_dictionaries({"id": st.sampled_from(["alloy", "x"])})),
    "response_format": st.one_of(st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "xml", ""]),
                                 json_values(1)),
    "speed": st.one_of(st.sampled_from([0.25, 1, 1.5, 4, 0, 4.01, 0.2]), floats(), json_values(1)),
    "stream_format": st.one_of(st.sampled_from(["audio", "sse", "x"]), json_values(1)),
    "sample_rate": st.one_of(st.sampled_from((*RATES, -1, 10**12)), json_values(1)),
    "instructions": st.one_of(strings(40), json_values(1)),
}
OPENAI_SPEECH = _web_call(
    st.just("POST"), st.just("/v1/audio/speech"),
    weighted([st.tuples(st.just("json"), st.fixed_dictionaries({}, optional=SPEECH_FIELDS))] * 6
             + [st.tuples(st.just("json"), json_values()), st.binary(max_size=256)]),
    weighted([st.just("application/json")] * 4 + [_content_types()]))

BOUNDARY = "rtmedia-fuzz-boundary"
SAMPLE_KINDS = ("wav", "mp3", "ogg", "m4a", "flac")
TRANSCRIPTION_FIELDS = {
    "model": weighted([st.just("whisper-1")] * 4 + [st.sampled_from(["gpt-4o-transcribe", "tts-1", ""]),
                                                    header_values(20)]),
    "language": st.one_of(st.sampled_from(["en", "en-US", "", "fr", "EN"]), header_values(10)),
    "response_format": st.one_of(st.sampled_from(["json", "text", "verbose_json", "srt", "vtt", "xml"]),
                                 header_values(10)),
    "stream": st.sampled_from(["true", "false", "1", "yes", ""]),
    "timestamp_granularities[]": st.sampled_from(["word", "segment", "char", ""]),
    "temperature": st.sampled_from(["0", "0.5", "warm", "nan", "-1"]),
    "prompt": header_values(40),
    "include[]": st.sampled_from(["logprobs", "x"]),
}
# The file part: a real recording (whole, cut short, or with bytes overwritten), garbage, empty, or
# none; then the whole body may be cut short or be over the front's upload limit.
UPLOAD_FILES = st.one_of(
    st.tuples(st.just("real"), st.sampled_from(SAMPLE_KINDS), st.none()),
    st.tuples(st.just("cut"), st.sampled_from(SAMPLE_KINDS), st.floats(0, 1)),
    st.tuples(st.just("flipped"), st.sampled_from(SAMPLE_KINDS),
              st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=16)),
    st.tuples(st.just("junk"), st.binary(max_size=4096), st.none()),
    st.tuples(st.just("empty"), st.none(), st.none()),
    st.none(),
)
MULTIPART = st.tuples(st.just("multipart"), st.tuples(
    st.fixed_dictionaries({}, optional=TRANSCRIPTION_FIELDS), UPLOAD_FILES, st.sampled_from(["a.wav", "", "x/../y"]),
    weighted([st.just("whole")] * 8 + [st.sampled_from(["cut", "no-end", "oversize"])]), st.floats(0, 1)))
OPENAI_TRANSCRIPTION = _web_call(
    st.just("POST"), st.just("/v1/audio/transcriptions"),
    weighted([MULTIPART] * 6 + [st.binary(max_size=256), st.tuples(st.just("json"), json_values(4))]),
    weighted([st.just(f"multipart/form-data; boundary={BOUNDARY}")] * 6 + [_content_types()]))


@functools.cache
def sample_file(kind: str) -> bytes:
    """A short real recording as a `kind` file (made once per process)."""
    from tests.support.audio_files import encode

    pcm = np.frombuffer(speech_pcm(16000), np.int16)
    return encode(pcm, 16000, kind)


def _upload_file(spec: Any) -> bytes | None:
    if spec is None:
        return None
    what, kind, detail = spec
    if what == "junk":
        return kind
    if what == "empty":
        return b""
    data = sample_file(kind)
    if what == "cut":
        return data[:int(len(data) * detail)]
    if what == "flipped":
        data = bytearray(data)
        for at, value in detail:
            data[min(len(data) - 1, int(len(data) * at))] = value
        return bytes(data)
    return data


def multipart_body(target: Target, parts: Any) -> bytes:
    """A multipart/form-data body (boundary BOUNDARY) of the case's fields and file, possibly
    cut short, without its closing boundary, or over the front's upload limit."""
    fields, file_spec, filename, ending, cut = parts
    out = b""
    for name, value in fields.items():
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n"
                .encode() + value.encode("utf-8", "surrogatepass") + b"\r\n")
    data = _upload_file(file_spec)
    if ending == "oversize":
        data = bytes(target.max_upload_bytes + 1)
    if data is not None:
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    if ending != "no-end":
        out += f"--{BOUNDARY}--\r\n".encode()
    return out[:int(len(out) * cut)] if ending == "cut" else out


@door("openai_speech", OPENAI_SPEECH, needs=["web", "openai"])
async def openai_speech(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)


@door("openai_transcription", OPENAI_TRANSCRIPTION, needs=["web", "openai"])
async def openai_transcription(target: Target, call: WebCall) -> Outcome:
    return await _web(target, call)
