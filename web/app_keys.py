"""What the web front's `authenticate` middleware (rtmedia.web.bridge) leaves on a request,
as aiohttp's typed request keys, for the routes of every door on the web port to read.

A module of its own so that the doors (the OpenAI front's Realtime routes, Twilio, the SIP
calls API) read them without importing the bridge that mounts them.
"""

from __future__ import annotations

from aiohttp import web
from rtmedia.protocol.tokens import Token

TOKEN_KEY = web.RequestKey("rtmedia_token", Token)  # the bridge's token that matched (its name is loggable)
BEARER_KEY = web.RequestKey("rtmedia_bearer", str)  # the presented secret: forwarded to the server, never logged
# The subprotocol that carried the token, for a WebSocket route to select (a browser drops a
# handshake whose answer selects none of the subprotocols it offered).
WS_PROTOCOL_KEY = web.RequestKey("rtmedia_ws_protocol", str)
SECRET_KEY = web.RequestKey("rtmedia_client_secret", str)  # the ek_ key a request presented
