"""The gRPC servicers: RealtimeService (Converse), SpeechService, VideoService and NVIDIA Riva's speech
API."""
