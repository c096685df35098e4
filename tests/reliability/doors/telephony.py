"""The telephony doors: Twilio Media Streams (web/telephony/twilio.py), and the SIP door
(web/telephony/sip.py) with its calls API."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import time
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from tests.reliability.doors.core import END_S, Outcome, Target, door
from tests.reliability.strategies import (
    blobs,
    header_values,
    json_values,
    strings,
    weighted,
)

# ---- Twilio Media Streams (web/telephony/twilio.py) ----------------------------------------------

TWILIO_PATH = "/twilio/media"
# The door's closes: its own end (stop), and refusals that name the reason.
TWILIO_CLOSES = {1000: "the call ended", 1003: "not Twilio's messages", 1008: "out of order", 1013: "at capacity"}
TWILIO_FORMAT = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}


def _twilio_frames() -> st.SearchStrategy[str | bytes]:
    """One frame of a Media Streams socket: Twilio's messages, right or with fuzzed fields, or
    anything else."""
    sid = st.sampled_from(["MZ1", ""])
    fmt = weighted([st.just(TWILIO_FORMAT)] * 3 + [json_values()])
    start = st.builds(lambda s, f, p: {"event": "start", "streamSid": s, "start": {"streamSid": s, "mediaFormat": f,
                                                                                   "customParameters": p}},
                      sid, fmt, weighted([st.just({}), st.dictionaries(strings(12), json_values(), max_size=4)]))
    payload = weighted([st.binary(max_size=800).map(lambda b: base64.b64encode(b).decode())] * 3
                       + [strings()])
    media = st.builds(lambda s, p: {"event": "media", "streamSid": s, "media": {"track": "inbound", "payload": p}},
                      sid, payload)
    other = st.builds(lambda kind, body: {"event": kind, "streamSid": "MZ1", kind: body},
                      st.sampled_from(["mark", "dtmf", "stop", "connected", "nonsense"]),
                      weighted([st.fixed_dictionaries({"name": strings()}),
                                st.fixed_dictionaries({"digit": strings(4)}), json_values()]))
    as_json = weighted([start, media, media, media, other, json_values()]).map(json.dumps)
    return weighted([as_json] * 6 + [strings(), blobs(256)])


TWILIO_CASES = st.tuples(
    st.lists(_twilio_frames(), max_size=12).map(
        lambda frames: [json.dumps({"event": "connected"}),
                        json.dumps({"event": "start", "streamSid": "MZ1",
                                    "start": {"streamSid": "MZ1", "mediaFormat": TWILIO_FORMAT}}), *frames]),
    st.booleans())  # whether the well-formed opening comes first (else the frames alone)


@door("twilio_media", TWILIO_CASES, needs=["web", "twilio"])
async def twilio_media(target: Target, case: tuple[list[str | bytes], bool]) -> Outcome:
    """One `/twilio/media` socket: the frames, what comes back, and the client's close. The
    door may close it, with one of TWILIO_CLOSES and a reason; whatever it sends is Twilio's
    JSON (`media`, `mark`, `clear` with the call's streamSid)."""
    import aiohttp

    frames, opening = case
    frames = frames if opening else frames[2:]
    outcome = Outcome()
    url = target.web_url.replace("http", "ws", 1) + TWILIO_PATH
    try:
        async with target.http.ws_connect(url, heartbeat=None) as ws:
            outcome.status("HTTP 101")
            for frame in frames:
                if ws.closed:
                    break
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
            deadline = time.monotonic() + 0.5
            while not ws.closed and (left := deadline - time.monotonic()) > 0:
                try:
                    msg = await ws.receive(timeout=left)
                except TimeoutError:
                    break
                if msg.type == aiohttp.WSMsgType.TEXT:
                    event = json.loads(msg.data)
                    if event.get("event") not in ("media", "mark", "clear") or event.get("streamSid") != "MZ1":
                        outcome.problems.append(f"a message that is not Twilio's: {msg.data[:200]}")
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                    break
                else:
                    outcome.problems.append(f"a {msg.type.name} frame from the door")
            server_closed = ws.closed
            await asyncio.wait_for(ws.close(), END_S)
            code = ws.close_code
        if server_closed:
            outcome.status(f"WS {code}")
            if code not in TWILIO_CLOSES:
                outcome.problems.append(f"the door closed the socket with {code}")
    except aiohttp.WSServerHandshakeError as exc:
        outcome.status(f"HTTP {exc.status}")
        if exc.status >= 500 and exc.status != 503:
            outcome.problems.append(f"the handshake got HTTP {exc.status}")
    except TimeoutError:
        outcome.problems.append(f"the socket did not close within {END_S:g} s of the client's close")
    return outcome


# ---- the SIP door (web/telephony/sip.py) -----------------------------------------------------------

SIP_METHODS = ["OPTIONS", "BYE", "CANCEL", "INFO", "REGISTER", "MESSAGE", "SUBSCRIBE", "NOTIFY", "REFER", "ACK",
               "PRACK", "UPDATE", "INVITE", "FOO"]
# An offer the door can never take (no codec it speaks), so a fuzzed INVITE never becomes a call.
UNKNOWN_CODECS_SDP = ("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
                      "m=audio 4000 RTP/AVP 3 18\r\na=rtpmap:3 GSM/8000\r\na=rtpmap:18 G729/8000\r\n")


def _sip_requests() -> st.SearchStrategy[bytes]:
    """A SIP request, well-formed or with fuzzed lines and body, or any datagram at all."""
    header = st.tuples(weighted([st.sampled_from(["Via", "From", "To", "Call-ID", "CSeq", "Contact", "Max-Forwards",
                                                  "Content-Type", "Content-Length", "Event", "Refer-To", "X-Fuzz",
                                                  "v", "f", "t", "i", "m", "l"]), strings(16)]),
                       weighted([header_values(), strings(80)]))

    def request(method: str, uri: str, extra: list[tuple[str, str]], body: str, n: int) -> bytes:
        lines = [f"{method} {uri} SIP/2.0", f"Via: SIP/2.0/UDP 127.0.0.1:5999;branch=z9hG4bK-fuzz-{n};rport",
                 "Max-Forwards: 70", f"From: <sip:fuzz@127.0.0.1>;tag=f{n}", "To: <sip:rtmedia@127.0.0.1>",
                 f"Call-ID: fuzz-{n}", f"CSeq: 1 {method}", "Contact: <sip:fuzz@127.0.0.1:5999>",
                 *(f"{k}: {v}" for k, v in extra)]
        if method == "INVITE":  # (never a codec the door speaks: a fuzzed INVITE is never a call)
            body, extra = UNKNOWN_CODECS_SDP, [*extra, ("Content-Type", "application/sdp")]
            lines.append("Content-Type: application/sdp")
        lines.append(f"Content-Length: {len(body.encode())}")
        return ("\r\n".join(lines) + "\r\n\r\n" + body).encode("utf-8", "surrogatepass")

    well = st.builds(request, st.sampled_from(SIP_METHODS),
                     weighted([st.just("sip:rtmedia@127.0.0.1"), strings(60)]),
                     st.lists(header, max_size=4), weighted([st.just(""), strings(200)]),
                     st.integers(0, 1 << 30))
    return weighted([well] * 6 + [blobs(512), strings(300).map(lambda t: t.encode("utf-8", "surrogatepass"))])


SIP_CASES = st.lists(_sip_requests(), min_size=1, max_size=6)


@door("sip_signalling", SIP_CASES, needs=["sip"])
async def sip_signalling(target: Target, case: list[bytes]) -> Outcome:
    """Datagrams to the door's SIP port: whatever comes back is a SIP response (a status line
    with a code); no call comes of it; the door goes on (judged by run_case)."""
    import socket

    assert target.sip is not None
    outcome = Outcome()
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        sock.bind(("127.0.0.1", 0))
        for datagram in case:
            with contextlib.suppress(OSError):
                await loop.sock_sendto(sock, datagram[:65000], ("127.0.0.1", target.sip.port))
        deadline = time.monotonic() + 0.3
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await asyncio.wait_for(loop.sock_recv(sock, 65536), left)
            except TimeoutError:
                break
            line = reply.split(b"\r\n", 1)[0]
            if not (line.startswith(b"SIP/2.0 ") and line[8:11].isdigit() and 100 <= int(line[8:11]) < 700):
                outcome.problems.append(f"a reply that is not a SIP response: {reply[:120]!r}")
                continue
            outcome.status(f"SIP {int(line[8:11])}")
            cseq = re.search(rb"\r\nCSeq:[ \t]*\d+[ \t]+(\S+)", reply)
            if line[8:11] in (b"200", b"180") and cseq is not None and cseq.group(1) == b"INVITE":
                outcome.problems.append("a fuzzed INVITE was answered as a call")
    live = await _sip_calls(target)
    if live:
        outcome.problems.append(f"{len(live)} SIP call(s) live after the case")
    return outcome


async def _sip_calls(target: Target) -> list[dict[str, Any]]:
    assert target.sip is not None
    async with target.http.get(f"{target.sip.control}/v1/sip/calls") as res:
        return [c for c in (await res.json())["calls"] if c["status"] != "ended" and c["direction"] == "inbound"]


SIP_API_CASES = st.lists(st.tuples(
    st.sampled_from(["POST /v1/sip/calls", "GET /v1/sip/calls", "GET /v1/sip/calls/{id}",
                     "POST /v1/sip/calls/{id}/hangup", "POST /v1/sip/calls/{id}/refer", "POST /v1/sip/calls/{id}/dtmf",
                     "POST /v1/sip/calls/{id}/nonsense"]),
    weighted([st.just("0123456789abcdef"), strings(40)]),
    weighted([json_values().map(json.dumps), strings(200), st.just('{"to": "sip:nobody@127.0.0.1:9"}'),
              st.fixed_dictionaries({"to": strings(60), "ring_timeout_s": json_values()}).map(json.dumps)])),
    min_size=1, max_size=5)


@door("sip_calls_api", SIP_API_CASES, needs=["sip"])
async def sip_calls_api(target: Target, case: list[tuple[str, str, str]]) -> Outcome:
    """The door's calls API: every answer below 500 in the `{"error", "reason"}` shape; a call
    it dials is hung up (through the API) by the end of the case."""
    assert target.sip is not None
    outcome = Outcome()
    for route, call_id, body in case:
        method, path = route.split(" ")
        url = target.sip.control + path.replace("{id}", quote(call_id, safe=""))
        async with target.http.request(method, url, data=body.encode("utf-8", "surrogatepass"),
                                       headers={"Content-Type": "application/json"}) as res:
            outcome.status(f"HTTP {res.status}")
            text = await res.text()
            if res.status >= 500:
                outcome.problems.append(f"{route}: HTTP {res.status}: {text[:200]}")
            elif res.status >= 400 and res.content_type == "application/json" and "error" not in json.loads(text):
                outcome.problems.append(f"{route}: an error without the error shape: {text[:200]}")
    async with target.http.get(f"{target.sip.control}/v1/sip/calls") as res:
        calls = (await res.json())["calls"]
    for call in calls:  # (a well-formed dial: end it, as a client would)
        async with target.http.post(f"{target.sip.control}/v1/sip/calls/{call['id']}/hangup") as res:
            await res.read()
    return outcome
