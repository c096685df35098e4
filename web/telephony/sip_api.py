"""The SIP door's calls API on the web port (`/v1/sip/calls`, behind the web port's tokens):
each request is forwarded to the door's control port (web/telephony/sip_control.py), which
binds loopback without authentication of its own. Distinct from the WebRTC calls of OpenAI's
API (`/v1/realtime/calls`)."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from rtmedia.web.http_errors import error_response

MAX_BODY = 16384


class SipCallsApi:
    def __init__(self, control_url: str) -> None:
        self.control = control_url.rstrip("/")
        self.http: aiohttp.ClientSession | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/v1/sip/calls", self.forward)
        app.router.add_route("*", "/v1/sip/calls/{tail:.+}", self.forward)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()

    async def forward(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
        body = await request.read() if request.can_read_body else b""
        if len(body) > MAX_BODY:
            return error_response(413, f"the body is over {MAX_BODY} bytes", reason="too_large")
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
        try:
            async with self.http.request(request.method, f"{self.control}{request.path}", data=body or None,
                                         headers={"Content-Type": request.content_type}) as res:
                return web.Response(status=res.status, body=await res.read(),
                                    content_type=res.content_type or "application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(502, f"the SIP door did not answer: {exc or type(exc).__name__}",
                                  reason="sip_unavailable")
