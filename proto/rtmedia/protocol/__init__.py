"""The protocol's hand-written helpers, shared by every door: the canonical JSON form of
events (`events`), error reasons and their `ErrorInfo` (`errors`), WAV and fragmented-MP4
framing (`wav`, `video_mp4`), the structured log format (`logs`), the turn-detection kinds
(`turn_kinds`) and when a client acknowledges playback (`playback`). They import nothing of
the server, the clients or the web front."""
