"""The SIP door's HTTP control port (docs/telephony.md#the-calls-api): the calls API and the
door's metrics. It has no authentication of its own and binds loopback by default; the web
front serves the same API on the web port, behind its tokens (`/v1/sip/calls`), by forwarding
to it.

- `POST /v1/sip/calls` {"to": SIP URI or number, "trunk"?, "session"?, "ring_timeout_s"?}: dial
  out; 201 with the call (its `status` `dialing`; `outcome` once it ended: `answered`, `busy`,
  `no_answer`, `failed`).
- `GET /v1/sip/calls`, `GET /v1/sip/calls/{id}`: the live calls (and the last 200 ended ones).
- `POST /v1/sip/calls/{id}/hangup`, `.../refer` {"target"} (a blind transfer, to `transfer_allow`
  targets only), `.../dtmf` {"digits"}: control a live call.
- `GET /metrics`: Prometheus.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from rtmedia.web.http_errors import error_response
from rtmedia.web.telephony.sip import SipCall, SipDoor

MAX_BODY = 16384


class SipControl:
    def __init__(self, door: SipDoor) -> None:
        self.door = door

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/sip/calls", self.dial)
        app.router.add_get("/v1/sip/calls", self.list)
        app.router.add_get("/v1/sip/calls/{id}", self.show)
        app.router.add_post("/v1/sip/calls/{id}/{action}", self.act)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.health)
        return app

    async def body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            raise web.HTTPBadRequest(text="the body is not JSON\n") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the body must be a JSON object\n")
        return body

    async def dial(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        to, trunk, session, ring = body.get("to"), body.get("trunk"), body.get("session"), body.get("ring_timeout_s")
        if not isinstance(to, str) or not to:
            return error_response(400, "`to` (a SIP URI, or a number with `trunk`) is required", reason="invalid_value")
        if (trunk is not None and not isinstance(trunk, str)) or (session is not None and not isinstance(session, dict)) \
                or (ring is not None and (not isinstance(ring, int | float) or not 1 <= ring <= 300)):
            return error_response(400, "`trunk` is a name, `session` an object of session settings and "
                                       "`ring_timeout_s` 1..300", reason="invalid_value")
        try:
            info = self.door.dial(to, trunk, session, ring)
        except LookupError as exc:
            return error_response(404, str(exc).strip("'\""), reason="not_found")
        except ValueError as exc:
            return error_response(400, str(exc), reason="invalid_value")
        except RuntimeError as exc:
            status = 503 if self.door.draining else 429
            return error_response(status, f"no capacity for another call ({exc})", reason="capacity")
        return web.json_response(info.describe(), status=201)

    async def list(self, request: web.Request) -> web.Response:
        live = [c.info.describe() for c in self.door.calls.values()]
        return web.json_response({"calls": live, "ended": [i.describe() for i in self.door.history]})

    async def show(self, request: web.Request) -> web.Response:
        info = self.door.find(request.match_info["id"])
        if info is None:
            return error_response(404, "no such call", reason="not_found")
        return web.json_response(info.describe())

    async def act(self, request: web.Request) -> web.Response:
        call: SipCall | None = self.door.calls.get(request.match_info["id"])
        action = request.match_info["action"]
        if action not in ("hangup", "refer", "dtmf"):
            raise web.HTTPNotFound(text=f"no action {action!r}: hangup, refer or dtmf\n")
        if call is None or call.info.status == "ended":
            return error_response(404, "no such live call", reason="not_found")
        body = await self.body(request)
        if action == "hangup":
            call.hang_up("hung up through the calls API")
            return web.json_response(call.info.describe())
        if call.info.status != "active":
            return error_response(409, f"the call is {call.info.status}, not active", reason="invalid_state")
        if action == "dtmf":
            output = await call.run_tool("send_dtmf", {"digits": str(body.get("digits", ""))})
        else:
            output = await call.run_tool("transfer_call", {"target": str(body.get("target", ""))})
        if output is not None and "error" in output:
            return error_response(400, output["error"], reason="invalid_value")
        return web.json_response({**call.info.describe(), "result": output or {"transferred": True}})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.door.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps({"status": "draining" if self.door.draining else "ok",
                                             "calls": len(self.door.calls)}), content_type="application/json")


