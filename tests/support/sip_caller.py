"""A second SIP user agent for the SIP door's tests, on PJSIP itself (a process of its own: one
pjsua2 Endpoint per process): calls URI, sends --digits as SIP INFO (application/dtmf-relay)
once the call is up, plays --play (a WAV file) into the call, records what it hears to
--record, and with --echo GAIN is a speakerphone: what it hears goes back into the call at
GAIN (PJSIP's conference bridge feeds the call's port to itself, a frame or two later); waits
--seconds, hangs up; prints the call's states.

    python tests/support/sip_caller.py URI [--digits D] [--seconds S] [--play WAV] [--record WAV] [--echo GAIN]
"""

from __future__ import annotations

import argparse
import sys
import time

import pjsua2 as pj


class Call(pj.Call):
    def __init__(self, account: pj.Account) -> None:
        super().__init__(account)
        self.state = ""

    def onCallState(self, prm: pj.OnCallStateParam) -> None:
        info = self.getInfo()
        self.state = info.stateText
        print(f"state {info.stateText} {info.lastStatusCode}", flush=True)


def wait(ep: pj.Endpoint, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ep.libHandleEvents(10)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("--digits", default="")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--play")
    p.add_argument("--record")
    p.add_argument("--echo", type=float)
    args = p.parse_args()
    ep = pj.Endpoint()
    ep.libCreate()
    cfg = pj.EpConfig()
    cfg.uaConfig.threadCnt, cfg.uaConfig.mainThreadOnly = 0, True
    cfg.logConfig.level = cfg.logConfig.consoleLevel = 0
    cfg.medConfig.clockRate = cfg.medConfig.sndClockRate = 8000
    ep.libInit(cfg)
    tcfg = pj.TransportConfig()
    tcfg.boundAddress = "127.0.0.1"
    ep.transportCreate(pj.PJSIP_TRANSPORT_UDP, tcfg)
    ep.libStart()
    ep.audDevManager().setNullDev()
    acfg = pj.AccountConfig()
    acfg.idUri = "sip:pjsua@127.0.0.1"
    acfg.mediaConfig.transportConfig.boundAddress = "127.0.0.1"
    account = pj.Account()
    account.create(acfg)
    call = Call(account)
    call.makeCall(args.uri, pj.CallOpParam(True))
    deadline = time.monotonic() + 20
    while call.state != "CONFIRMED" and time.monotonic() < deadline:
        ep.libHandleEvents(10)
    if call.state != "CONFIRMED":
        return 1
    wait(ep, 0.3)  # (the call's media is connected just after CONFIRMED)
    media = call.getAudioMedia(-1)
    player = recorder = None
    if args.record:
        recorder = pj.AudioMediaRecorder()
        recorder.createRecorder(args.record)
        media.startTransmit(recorder)
    if args.echo is not None:
        level = pj.AudioMediaTransmitParam()
        level.level = args.echo
        media.startTransmit2(media, level)
    if args.play:
        player = pj.AudioMediaPlayer()
        player.createPlayer(args.play, pj.PJMEDIA_FILE_NO_LOOP)
        player.startTransmit(media)
    for digit in args.digits:
        prm = pj.CallSendDtmfParam()
        prm.method, prm.digits = pj.PJSUA_DTMF_METHOD_SIP_INFO, digit
        call.sendDtmf(prm)
        wait(ep, 0.2)
    wait(ep, args.seconds)
    call.hangup(pj.CallOpParam(True))
    wait(ep, 1)
    del call, player, recorder
    ep.libDestroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
