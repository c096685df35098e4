"""rtmedia.clients."""
