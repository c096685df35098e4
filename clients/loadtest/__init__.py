"""`rtmedia loadtest`: simulated people talking to a server at once, over gRPC or OpenAI's Realtime
WebSocket, and the report of what they measured."""
