"""rtmedia.web."""
