"""The load test's settings: its profiles and transports, the pacing of a simulated person, and
the session config each profile asks for (`session_config`, Converse's; the Realtime API's is
rtmedia.clients.loadtest.openai_ws.api_session) at the rate the run streams (`input_rate`)."""

from __future__ import annotations

import argparse
from typing import Any

from rtmedia.protocol.turn_kinds import NONE, SEMANTIC_VAD

PROFILES = ("listen", "transcribe", "talk", "llm", "mixed", "barge-in")
TRANSPORTS = ("grpc", "openai-ws")
DEFAULT_WEB_URL = "http://127.0.0.1:8080"
MIXED = ("listen", "listen", "transcribe", "talk")  # mixed: sessions take these in turn
RESPONDERS = {"talk": "echo", "barge-in": "echo", "llm": "llm"}
INPUT_RATES = (8000, 16000, 24000)
DEFAULT_INPUT_RATE = 16000
API_INPUT_RATE = 24000  # openai-ws: the Realtime API's audio/pcm is PCM16 at 24 kHz
CONFIG_ID = "loadtest-config"
PAUSE_S = (1.0, 2.5)  # silence between utterances when nothing answers
GAP_S = (0.4, 1.2)  # after a reply has played, before speaking again
BARGE_AFTER_S = (0.4, 0.9)  # barge-in: interrupt this long after the reply's first audio
QUIET_S = 1.5  # at the end: this much silence after the last utterance, so its turn ends
STARTED_BACK_MS = 700  # speech_started's audio_start_ms may lie this far before the voice (prefix padding)
SESSIONS_PER_CONNECTION = 50
CLOSE_WAIT_S = 10.0
SETTLE_S = 3.0  # between capacity levels, for the server to close the last level's sessions


def input_rate(args: argparse.Namespace) -> int:
    """The PCM16 rate the sessions stream: --input-rate, else the transport's default."""
    if args.input_rate is not None:
        return int(args.input_rate)
    return API_INPUT_RATE if args.transport == "openai-ws" else DEFAULT_INPUT_RATE


def session_config(profile: str, args: argparse.Namespace) -> dict[str, Any]:
    turn: dict[str, Any] = {"type": args.turn_detection}
    if args.turn_detection == SEMANTIC_VAD:
        turn["eagerness"] = args.eagerness
    if args.interruption:
        turn["interruption"] = {"mode": args.interruption}
    if args.preemptive is not None:
        turn["preemptive"] = args.preemptive == "on"
    if profile in ("listen", "transcribe") and args.turn_detection != NONE:
        turn["create_response"] = False
    config: dict[str, Any] = {"input_audio_format": {"sample_rate": input_rate(args)},
                              "input_audio_transcription": {"enabled": profile != "listen"},
                              "turn_detection": turn}
    if profile in RESPONDERS:
        config["responder"] = RESPONDERS[profile]
    return config
