"""rtmedia.v1."""
