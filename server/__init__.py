"""rtmedia.server."""
