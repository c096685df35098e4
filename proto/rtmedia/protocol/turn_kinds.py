"""The turn-detection kinds of a session (docs/protocol.md#turn-detection), named once.

Their spellings are the protocol's (`TurnDetectionType` short names, as the canonical JSON
writes them); every module that branches on a session's turn kind imports them from here.
"""

from __future__ import annotations

SERVER_VAD = "server_vad"  # the VAD ends a turn after `silence_duration_ms` of silence
SEMANTIC_VAD = "semantic_vad"  # the VAD finds pauses, an LM scores whether the words are finished
MANUAL = "manual"  # the client commits each turn (half duplex while a response plays)
NONE = "none"  # the client commits each turn; nothing interrupts a response

VAD_TURNS = (SERVER_VAD, SEMANTIC_VAD)  # the kinds whose turns the VAD finds
TURN_KINDS = (SERVER_VAD, MANUAL, NONE, SEMANTIC_VAD)
