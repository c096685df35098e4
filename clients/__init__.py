"""rtmedia.clients: the Python client library (docs/python.md) and the client commands.

    from rtmedia.clients import RealtimeSession, SpeechClient, VideoClient, RtmediaError, events
"""

import os
from typing import TYPE_CHECKING, Any

from rtmedia.protocol.import_names import step_aside

step_aside(__name__, __file__)

# Client commands report a failed connection (refused, TLS mismatch) as one line; gRPC
# core's own info logs about it would add more. Set before grpc is first imported; the
# `rtmedia` entry point imports this package first, so `rtmedia serve` gets it too (gRPC core
# errors still reach its log; set GRPC_VERBOSITY yourself to see more).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# The public names, imported when first used (so `rtmedia serve` does not load the client).
_EXPORTS = {
    "RealtimeSession": "session", "RealtimeClient": "client", "SpeechClient": "client",
    "AsyncSpeechClient": "client", "VideoClient": "client", "SpeechChunk": "client", "VideoChunk": "client",
    "Credentials": "credentials", "RtmediaError": "errors", "events": "events",
    "read_audio": "audio_file", "AudioWriter": "audio_file",
}
__all__ = ["AsyncSpeechClient", "AudioWriter", "Credentials", "RealtimeClient", "RealtimeSession", "RtmediaError",
           "SpeechChunk", "SpeechClient", "VideoChunk", "VideoClient", "events", "read_audio"]

if TYPE_CHECKING:
    from rtmedia.clients import events
    from rtmedia.clients.audio_file import AudioWriter, read_audio
    from rtmedia.clients.client import (
        AsyncSpeechClient,
        RealtimeClient,
        SpeechChunk,
        SpeechClient,
        VideoChunk,
        VideoClient,
    )
    from rtmedia.clients.credentials import Credentials
    from rtmedia.clients.errors import RtmediaError
    from rtmedia.clients.session import RealtimeSession


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rtmedia.clients' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f"rtmedia.clients.{_EXPORTS[name]}")
    return module if name == "events" else getattr(module, name)
