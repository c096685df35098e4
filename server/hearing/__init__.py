"""What a session hears: the audio inbox and VAD tick, turn detection and endpointing, the feed to the
recogniser, and semantic end of turn."""
