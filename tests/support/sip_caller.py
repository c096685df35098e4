"""A second SIP user agent for the SIP door's tests, on PJSIP itself (a process of its own: one
pjsua2 Endpoint per process): calls URI, sends DIGITS as SIP INFO (application/dtmf-relay)
once the call is up, waits, hangs up; prints the call's states.

    python tests/support/sip_caller.py URI DIGITS [SECONDS]
"""

from __future__ import annotations

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


def main() -> int:
    uri, digits = sys.argv[1], sys.argv[2]
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
    ep = pj.Endpoint()
    ep.libCreate()
    cfg = pj.EpConfig()
    cfg.uaConfig.threadCnt, cfg.uaConfig.mainThreadOnly = 0, True
    cfg.logConfig.level = cfg.logConfig.consoleLevel = 0
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
    call.makeCall(uri, pj.CallOpParam(True))
    deadline = time.monotonic() + 20
    while call.state != "CONFIRMED" and time.monotonic() < deadline:
        ep.libHandleEvents(10)
    if call.state != "CONFIRMED":
        return 1
    for digit in digits:
        prm = pj.CallSendDtmfParam()
        prm.method, prm.digits = pj.PJSUA_DTMF_METHOD_SIP_INFO, digit
        call.sendDtmf(prm)
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            ep.libHandleEvents(10)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ep.libHandleEvents(10)
    call.hangup(pj.CallOpParam(True))
    end = time.monotonic() + 1
    while time.monotonic() < end:
        ep.libHandleEvents(10)
    del call
    ep.libDestroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
