"""rtmedia.engines."""
