"""Voice activity detection: Silero VAD, batched across sessions, and its batch-wide graph."""
