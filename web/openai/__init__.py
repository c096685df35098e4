"""OpenAI's APIs on the web port: the audio APIs (speech, transcriptions) and the Realtime API
(WebSocket and WebRTC calls), translated to and from rtmedia's sessions (docs/openai.md)."""
