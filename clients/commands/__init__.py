"""The client commands of the `rtmedia` CLI (voices, synth, transcribe, talk, decode-video, devices), on
the client library."""
