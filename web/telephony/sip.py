"""The SIP door (docs/telephony.md#sip): phone calls over SIP and RTP on PJSIP (`pjsua2`), one
`Converse` session per call, a gRPC client of the server like the web bridge.

It runs as a process of its own (`rtmedia sip`, or beside `rtmedia serve --sip`). PJSIP is
created with no worker threads and `mainThreadOnly`: its SIP events are handled in this
process's event loop by `SipDoor.poll` (`libHandleEvents`), so every call to PJSIP's API and
every SIP callback runs on the loop. Only the media clock is PJSIP's own thread (the null
sound device's conference bridge, every 20 ms): it hands each call's `CallPort` the caller's
decoded frame (after the jitter buffer) and takes the next frame of the reply. The port queues
the first for the loop (`inbound`, a deque) and takes the second from the call's
`ReplyPlayout` under its lock; nothing else crosses threads.

A call: the INVITE is checked (draining: 503; over `max_calls`, or its trunk's: 486; the accept
rules and hook: 403 or the hook's status), answered 180, its session opened (the server
refusing: 503), then answered 200. Its audio is 20 ms PCM at the codec's rate (8 kHz for
G.711, 16 kHz for G.722); the reply is paced by the media clock and acknowledged from what the
clock took (`playback.ack`), so a barge-in truncates at what the caller heard. DTMF (RFC 4733
or SIP INFO) becomes `input_audio_buffer.dtmf`. The agent may call `end_call`, `transfer_call`
(a blind transfer: SIP REFER, only to `transfer_allow` targets) and `send_dtmf` (RFC 4733).
A call whose RTP stopped for `rtp_timeout_s` is ended; a caller who hangs up ends the session
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp
import grpc
import pjsua2 as pj
from rtmedia.clients.errors import RtmediaError
from rtmedia.web.playout import FRAME_MS
from rtmedia.web.telephony.sip_call import (
    CallInfo,
    CallPort,
    SipCall,
    callback,
    end_call,
    fill,  # noqa: F401  (the door's helpers are importable from it)
    invite_headers,
    send_dtmf,
    transfer_call,
    uri_user,
)
from rtmedia.web.telephony.sip_config import PJSIP_MAX_CALLS, SipConfig, Trunk, session_settings
from rtmedia.web.telephony.sip_metrics import SipMetrics

log = logging.getLogger("rtmedia.sip")
POLL_S = 0.005  # how often the loop handles PJSIP's SIP events and moves the calls' audio
ACK_EVERY_POLLS = 10
STATS_EVERY_S = 1.0
BUSY, UNAVAILABLE, FORBIDDEN, SERVER_ERROR = 486, 503, 403, 500


# ---- the door -------------------------------------------------------------------------------------
class Account(pj.Account):
    def __init__(self, door: SipDoor, trunk: Trunk | None) -> None:
        super().__init__()
        self.door, self.trunk = door, trunk

    @callback
    def onIncomingCall(self, prm: pj.OnIncomingCallParam) -> None:
        self.door.incoming(self, prm)

    @callback
    def onRegState(self, prm: pj.OnRegStateParam) -> None:
        assert self.trunk is not None
        ok = 200 <= prm.code < 300
        self.door.metrics.registered.labels(self.trunk.name).set(1 if ok and prm.expiration > 0 else 0)
        if not ok:
            self.door.metrics.registration_failures.labels(self.trunk.name).inc()
            log.warning("sip registration failed", extra={"trunk": self.trunk.name, "code": prm.code,
                                                          "reason": prm.reason})
        else:
            log.info("sip registered", extra={"trunk": self.trunk.name, "expires_s": prm.expiration})


@contextlib.contextmanager
def quiet_stdio() -> Any:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


class LogWriter(pj.LogWriter):
    def write(self, entry: pj.LogEntry) -> None:  # any thread
        log.debug("pjsip: %s", entry.msg.rstrip())


class SipDoor:
    """PJSIP's endpoint, its transports and accounts, and the calls."""

    def __init__(self, config: SipConfig, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = (),
                 metrics: SipMetrics | None = None) -> None:
        self.config, self.channel, self.metadata = config, channel, metadata
        self.metrics = metrics or SipMetrics()
        self.calls: dict[str, SipCall] = {}  # by CallInfo.id, until disconnected
        self.history: deque[CallInfo] = deque(maxlen=200)  # ended calls, newest last
        self.draining = False
        self.no_calls = asyncio.Event()
        self.no_calls.set()
        self.ep: pj.Endpoint | None = None
        self.accounts: list[Account] = []
        self.spare_ports: dict[int, list[CallPort]] = {}  # by rate: ports of ended calls (CallPort)
        self.ports: dict[str, int] = {}  # transport -> the bound port
        self._poller: asyncio.Task[None] | None = None
        self._log_writer = LogWriter()

    # ---- life cycle ----
    def start(self) -> None:
        config = self.config
        ep = self.ep = pj.Endpoint()
        with quiet_stdio():  # (PJSIP's banner, written before its log settings apply)
            ep.libCreate()
        cfg = pj.EpConfig()
        cfg.uaConfig.threadCnt, cfg.uaConfig.mainThreadOnly = 0, True
        cfg.uaConfig.maxCalls = PJSIP_MAX_CALLS  # (over it, pjsua answers 486 itself)
        cfg.uaConfig.userAgent = "rtmedia"
        med = cfg.medConfig
        # The conference bridge runs at 16 kHz where G.722 may be negotiated, else at G.711's 8 kHz:
        # each call's audio is then resampled by neither the bridge nor its port.
        med.clockRate = med.sndClockRate = 16000 if "G722" in config.codecs else 8000
        med.audioFramePtime = med.ptime = FRAME_MS
        med.noVad, med.ecTailLen = True, 0
        med.maxMediaPorts = 4 * PJSIP_MAX_CALLS + 4
        cfg.logConfig.level = cfg.logConfig.consoleLevel = config.log_level
        cfg.logConfig.writer = self._log_writer
        cfg.logConfig.decor = 0
        ep.libInit(cfg)
        host, port = config.listen
        for kind, name in ((pj.PJSIP_TRANSPORT_UDP, "udp"), (pj.PJSIP_TRANSPORT_TCP, "tcp")):
            # (UDP first: with port 0 it picks the port, and TCP takes the same one)
            port = self.ports[name] = self._transport(kind, self._transport_config(host, port))
        if config.tls_listen is not None:
            tcfg = self._transport_config(*config.tls_listen)
            tcfg.tlsConfig.certFile, tcfg.tlsConfig.privKeyFile = config.tls_cert, config.tls_key
            self.ports["tls"] = self._transport(pj.PJSIP_TRANSPORT_TLS, tcfg)
        ep.libStart()
        ep.audDevManager().setNullDev()
        for codec in ep.codecEnum2():
            name = codec.codecId.split("/")[0].upper()
            ep.codecSetPriority(codec.codecId, 200 - config.codecs.index(name) if name in config.codecs else 0)
        local = Account(self, None)
        acfg = self._account_config()
        advertised = config.public_address or host
        acfg.idUri = f"sip:rtmedia@{advertised}:{self.ports['udp']}"
        local.create(acfg, True)
        self.accounts.append(local)
        for trunk in config.trunks:
            acc = Account(self, trunk)
            acfg = self._account_config()
            acfg.idUri, acfg.regConfig.registrarUri = trunk.register, trunk.registrar
            acfg.regConfig.timeoutSec, acfg.regConfig.retryIntervalSec = trunk.expires_s, 30
            if trunk.password is not None:
                acfg.sipConfig.authCreds.append(pj.AuthCredInfo("digest", "*", trunk.username, 0, trunk.password))
            acc.create(acfg)
            self.accounts.append(acc)
        self._poller = asyncio.get_running_loop().create_task(self.poll(), name="sip-poll")
        log.info("sip listening", extra={"host": host, **self.ports, "public_address": advertised,
                                         "rtp_ports": f"{config.rtp_ports[0]}-{config.rtp_ports[1]}"})

    def _transport(self, kind: int, tcfg: pj.TransportConfig) -> int:
        """Creates a transport; its bound port."""
        assert self.ep is not None
        try:
            tid = self.ep.transportCreate(kind, tcfg)
        except pj.Error as exc:
            where = f"{tcfg.boundAddress or '0.0.0.0'}:{tcfg.port}"
            raise OSError(f"cannot listen for SIP on {where}: {exc.reason}") from None
        return int(self.ep.transportGetInfo(tid).localName.rsplit(":", 1)[1])

    def _transport_config(self, host: str, port: int) -> pj.TransportConfig:
        tcfg = pj.TransportConfig()
        tcfg.port = port
        if host not in ("0.0.0.0", "::"):
            tcfg.boundAddress = host
        if self.config.public_address:
            tcfg.publicAddress = self.config.public_address
        return tcfg

    def _account_config(self) -> pj.AccountConfig:
        acfg = pj.AccountConfig()
        lo, hi = self.config.rtp_ports
        media = acfg.mediaConfig.transportConfig
        media.port, media.portRange = lo, hi - lo
        host = self.config.listen[0]
        if host not in ("0.0.0.0", "::"):
            media.boundAddress = host
        media.publicAddress = self.config.public_address or host
        acfg.mediaConfig.srtpUse = {"off": pj.PJMEDIA_SRTP_DISABLED, "optional": pj.PJMEDIA_SRTP_OPTIONAL,
                                    "mandatory": pj.PJMEDIA_SRTP_MANDATORY}[self.config.srtp]
        acfg.mediaConfig.srtpSecureSignaling = 0
        acfg.natConfig.sdpNatRewriteUse = 0
        acfg.natConfig.contactRewriteUse = 0 if self.config.public_address else 1
        return acfg

    async def poll(self) -> None:
        """PJSIP's SIP events, the calls' audio and acks, and their RTP checks, on the loop."""
        tick = 0
        stats_at = time.monotonic()
        while True:
            tick += 1
            now = time.monotonic()
            stats = now - stats_at >= STATS_EVERY_S
            if stats:
                stats_at = now
            self._tick(tick % ACK_EVERY_POLLS == 0, now if stats else None)
            await asyncio.sleep(POLL_S)

    def _tick(self, ack: bool, stats_at: float | None) -> None:
        """(Not inlined in poll: this frame's references to calls go with it.)"""
        assert self.ep is not None
        self.ep.libHandleEvents(0)
        for call in list(self.calls.values()):
            call.pump(ack)
            if stats_at is not None:
                call.check_rtp(stats_at)

    async def drain(self, grace_s: float) -> None:
        """New calls get 503; live calls go on for at most `grace_s`, then are hung up."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_calls.wait(), grace_s)
        for call in list(self.calls.values()):
            call.hang_up("the server is shutting down")

    async def stop(self) -> None:
        for call in list(self.calls.values()):
            call.hang_up("the SIP door is stopping")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_calls.wait(), 3)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for call in list(self.calls.values()):
            await call.close()
            self.retire(call)
        self.calls.clear()
        # Every Call object must go while PJSIP lives: its destructor calls into PJSIP (and
        # asserts after libDestroy). Ended calls wait in reference cycles for the collector.
        gc.collect()
        if self.ep is not None:
            self.ep.audDevManager().setNoDev()  # the media clock stops: now ports may go
            self.spare_ports.clear()
            gc.collect()
            for acc in self.accounts:
                with contextlib.suppress(pj.Error):
                    acc.shutdown()
            self.accounts.clear()
            self.ep.libDestroy()
            self.ep = None

    # ---- inbound calls ----
    def incoming(self, account: Account, prm: pj.OnIncomingCallParam) -> None:
        trunk = account.trunk
        info = CallInfo(uuid.uuid4().hex[:16], "inbound", "", "", trunk=trunk.name if trunk else "",
                        headers=invite_headers(prm.rdata.wholeMsg, self.config.headers))
        call = SipCall(self, account, info, prm.callId, trunk)
        ci = call.getInfo()
        info.caller, info.called = uri_user(ci.remoteUri), uri_user(ci.localUri)
        info.caller_uri, info.called_uri, info.sip_call_id = ci.remoteUri[:256], ci.localUri[:256], ci.callIdString[:128]
        call.settings = self.config.for_call(info.called, trunk)
        self.add(call)
        refusal = self._refusal(trunk)
        if refusal is not None:
            status, why = refusal
            self.reject(call, status, why)
            return
        info.status = "ringing"
        self.metrics.active.inc()
        op = pj.CallOpParam(True)
        op.statusCode = 180
        call.answer(op)
        call.start(self.accept(call))

    def add(self, call: SipCall) -> None:
        self.calls[call.info.id] = call
        self.no_calls.clear()

    def port_for(self, rate: int) -> CallPort:
        """A spare port at `rate`, else a new one (see CallPort: ports are kept, not deleted)."""
        spares = self.spare_ports.setdefault(rate, [])
        return spares.pop() if spares else CallPort(rate)

    def retire(self, call: SipCall) -> None:
        """An ended call's port goes back to the spares, detached (PJSIP dropped its connections
        with the call's stream)."""
        if call.port is not None:
            call.port.attach(None)
            self.spare_ports.setdefault(call.port.rate, []).append(call.port)
            call.port = None

    def remove(self, call: SipCall) -> None:
        self.calls.pop(call.info.id, None)
        if not self.calls:
            self.no_calls.set()

    def _refusal(self, trunk: Trunk | None) -> tuple[int, str] | None:
        if self.draining:
            return UNAVAILABLE, "draining"
        live = [c for c in self.calls.values() if c.info.status in ("ringing", "active", "dialing", "answering")]
        if len(live) >= self.config.max_calls:
            return BUSY, "max_calls"
        if trunk is not None and trunk.max_calls is not None \
                and sum(c.trunk is trunk for c in live) >= trunk.max_calls:
            return BUSY, f"trunk {trunk.name} max_calls"
        return None

    def reject(self, call: SipCall, status: int, why: str) -> None:
        call.info.outcome, call.info.end_reason = "rejected", why
        self.metrics.calls.labels(call.info.direction, "rejected").inc()
        log.info("sip call refused", extra={"call": call.info.id, "status": status, "why": why,
                                            "caller": call.info.caller, "called": call.info.called})
        op = pj.CallOpParam(True)
        op.statusCode = status
        with contextlib.suppress(pj.Error):
            call.answer(op)

    async def accept(self, call: SipCall) -> None:
        """Decide (the rules, then the hook), open the session, answer 200."""
        info = call.info
        decision = await self.decide(info)
        if decision is not None:
            status, why = decision
            self._unring(call)
            self.reject(call, status, why)
            return
        try:
            await call.open_session()
            if info.status == "ended":  # the caller gave up while the session opened
                await call.close()
                return
        except (RtmediaError, TimeoutError) as exc:
            busy = isinstance(exc, RtmediaError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            if not busy:
                log.warning("sip call: the server refused the session",
                            extra={"call": info.id, "error": getattr(exc, "details", str(exc))})
            self._unring(call)
            self.reject(call, UNAVAILABLE, "the server refused the session")
            return
        op = pj.CallOpParam(True)
        op.statusCode = 200
        try:
            call.answer(op)
        except pj.Error as exc:
            log.warning("sip answer failed", extra={"call": info.id, "error": exc.info()})
            return
        info.status, info.answered_at = "active", time.time()
        self.metrics.setup.observe(time.perf_counter() - call.invite_at)
        self.metrics.calls.labels("inbound", "answered").inc()
        log.info("sip call", extra={"call": info.id, "caller": info.caller, "called": info.called,
                                    "trunk": info.trunk, "session_id": info.session_id})

    def _unring(self, call: SipCall) -> None:
        if call.info.status == "ringing":
            self.metrics.active.dec()
            call.info.status = "new"

    async def decide(self, info: CallInfo) -> tuple[int, str] | None:
        """None to answer; else the status to refuse with, and why."""
        rules = self.config.accept
        if not rules.decide(info.caller, info.caller_uri):
            return FORBIDDEN, "the accept rules"
        if rules.webhook is None:
            return None
        body = {k: getattr(info, k) for k in ("id", "caller", "called", "caller_uri", "called_uri", "sip_call_id",
                                              "trunk", "headers")}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=rules.webhook_timeout_s)) as http, \
                    http.post(rules.webhook, json=body) as res:
                answer = await res.json(content_type=None) if res.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("sip accept hook failed: the call is refused", extra={"call": info.id, "error": str(exc)})
            return UNAVAILABLE, "the accept hook did not answer"
        if not isinstance(answer, dict) or not isinstance(answer.get("accept"), bool):
            return UNAVAILABLE, "the accept hook's answer is not {\"accept\": true|false}"
        if not answer["accept"]:
            status = answer.get("status")
            return (status if isinstance(status, int) and 400 <= status < 700 else FORBIDDEN), "the accept hook"
        if answer.get("session") is not None:
            try:
                session = session_settings(answer["session"], "the accept hook's session")
            except ValueError as exc:
                log.warning("sip accept hook: bad session settings: the call is refused",
                            extra={"call": info.id, "error": str(exc)})
                return UNAVAILABLE, str(exc)
            call = self.calls.get(info.id)
            if call is not None:
                call.settings = {**call.settings, **session}
        return None

    # ---- outbound calls ----
    def dial(self, to: str, trunk_name: str | None = None, session: dict[str, Any] | None = None,
             ring_timeout_s: float | None = None) -> CallInfo:
        """Starts an outbound call (ValueError: a bad request; LookupError: no such trunk;
        RuntimeError: no capacity)."""
        session = session_settings(session, "session")
        trunk = next((t for t in self.config.trunks if t.name == trunk_name), None)
        if trunk_name and trunk is None:
            raise LookupError(f"no trunk {trunk_name!r}")
        uri = self.target_uri(to, trunk)
        if uri is None:
            raise ValueError(f"`to` must be a SIP URI, or a number with a trunk to dial it through; got {to!r}")
        refusal = self._refusal(trunk)
        if refusal is not None:
            raise RuntimeError(refusal[1])
        account = self.accounts[self.config.trunks.index(trunk) + 1] if trunk else self.accounts[0]
        info = CallInfo(uuid.uuid4().hex[:16], "outbound", "", uri_user(uri) or to, "", uri,
                        trunk=trunk.name if trunk else "", status="dialing")
        settings = {**self.config.for_call(info.called, trunk), **session}
        call = SipCall(self, account, info, trunk=trunk, session=settings)
        self.add(call)
        self.metrics.active.inc()
        try:
            call.makeCall(uri, pj.CallOpParam(True))
        except pj.Error as exc:
            self.remove(call)
            self.metrics.active.dec()
            raise ValueError(f"cannot dial {uri}: {exc.reason or exc.info()}") from None
        call.start(self.ring_deadline(call, ring_timeout_s or self.config.ring_timeout_s))
        log.info("sip dialing", extra={"call": info.id, "to": uri, "trunk": info.trunk})
        return info

    async def ring_deadline(self, call: SipCall, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        if call.info.status == "dialing":
            call.info.outcome = "no_answer"
            call.hang_up(f"no answer within {timeout_s:g} s")

    async def answered_outbound(self, call: SipCall) -> None:
        try:
            await call.open_session()
        except (RtmediaError, TimeoutError) as exc:
            call.info.outcome = "failed"
            call.hang_up(f"the server refused the session: {getattr(exc, 'details', exc)}")
            return
        call.info.status, call.info.answered_at = "active", time.time()
        call.info.outcome = "answered"
        self.metrics.setup.observe(time.perf_counter() - call.invite_at)
        self.metrics.calls.labels("outbound", "answered").inc()

    def target_uri(self, to: str, trunk: Trunk | None) -> str | None:
        """A SIP URI as it is; a number (digits, + and *#) through `trunk`'s host."""
        if re.fullmatch(r"sips?:[^\s<>\"]+", to):
            return to
        if trunk is not None and re.fullmatch(r"\+?[0-9*#]{1,32}", to):
            return f"sip:{to}@{trunk.registrar.split(':', 1)[1]}"
        return None

    def transfer_uri(self, target: str, trunk: Trunk | None) -> str | None:
        uri = self.target_uri(target, trunk)
        if uri is None or not (self.config.may_transfer_to(target) or self.config.may_transfer_to(uri)):
            return None
        return uri

    def tools(self) -> list[Callable[..., Any]]:
        return [end_call, send_dtmf, *([transfer_call] if self.config.transfer_allow else [])]

    # ---- the end of a call ----
    def disconnected(self, call: SipCall, status: int, reason: str) -> None:
        info = call.info
        was = info.status
        if was in ("ringing", "active", "dialing", "answering"):
            self.metrics.active.dec()
        if not info.outcome:
            info.outcome = ("busy" if status in (486, 600) else "no_answer" if status in (408, 480, 487)
                            else "failed") if was == "dialing" else "cancelled" if was == "ringing" else "ended"
        if was == "dialing":
            self.metrics.calls.labels("outbound", info.outcome).inc()
        if not info.end_reason:
            info.end_reason = f"hung up by the other side ({status} {reason})" if was == "active" else \
                f"{status} {reason}"
        info.status, info.ended_at = "ended", time.time()
        self.metrics.observe_rtp(call.rtp)
        if call.playout is not None:
            info.underruns = call.playout.buffer.stats.underruns
            self.metrics.underruns.inc(info.underruns)
        log.info("sip call ended", extra={"call": info.id, "outcome": info.outcome, "reason": info.end_reason,
                                          "seconds": round(info.ended_at - info.created_at, 1)})
        asyncio.get_running_loop().create_task(self._forget(call))

    async def _forget(self, call: SipCall) -> None:
        await call.close()
        self.retire(call)
        self.remove(call)
        self.history.append(call.info)

    def find(self, call_id: str) -> CallInfo | None:
        call = self.calls.get(call_id)
        return call.info if call is not None else next((i for i in self.history if i.id == call_id), None)
