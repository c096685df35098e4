"""`rtmedia talk`: one duplex speech session fed from an audio file (RealtimeService.Converse,
docs/protocol.md#sessions); the command's flags, and the file mode (`--mic` is talk_mic's).

The file goes to the server as `input_audio_buffer.append` chunks; replies are
"played" on a simulated clock that sends `playback.ack` as a real client would;
latencies follow docs/protocol.md#latency-definitions as the client sees them. One asyncio task sends (the
file at its pace, then commit / response.create, then waits for the session to
go idle and closes it), one acknowledges playback, and the command itself reads
the server's events (rtmedia.clients.commands.talk_session).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rtmedia.clients.audio_file import FORMATS
from rtmedia.clients.client import DEFAULT_TARGET
from rtmedia.clients.commands.common import AUDIO_IN_HELP, RATE_HELP, CliError, positive_float, positive_int
from rtmedia.clients.commands.talk_session import (
    Talk,
    converse,
    finish,
    load_input,
    output_and_tools,
    recorded,
)
from rtmedia.clients.credentials import add_credential_flags, from_args
from rtmedia.protocol.turn_kinds import MANUAL, NONE, SEMANTIC_VAD, SERVER_VAD, VAD_TURNS

DESCRIPTION = """\
Open a duplex speech session, stream IN to it as the user's voice, and show
what happens: your turns as the server transcribed them, its replies, latencies
and barge-ins. IN is any audio file PyAV decodes (wav, mp3, m4a/aac, ogg/opus,
flac, webm, ...; downmixed, and resampled to 24 kHz unless at 8/16/24 kHz), or -
for standard input (raw PCM16 with --rate). The reply audio can be saved with -o
in the format its extension names (.wav, .mp3, .ogg, .opus, .flac, .m4a, .pcm)
or --format; -o - writes it to standard output as raw PCM16, and then every
message (and --json) goes to stderr.

The file is sent in --chunk-ms chunks, at real-time pace with --realtime and
otherwise as fast as allowed but at most 10x real time: the server's input inbox
holds 2 s of audio and answers an overflow with an input_backpressure error.
In server_vad mode one second of silence follows the file, as a live microphone
would keep sending, so that the last turn ends.
The reply is played on a simulated clock (real time, from its first audio
delta), acknowledged with playback.ack every ~200 ms of play time. After the
file (and, in manual/none mode, commit/response.create) the command waits until
every response is done and played and no speech_started came for 1.5 s, then
closes the session.

Latencies, on the client's clock: response = from receiving speech_stopped
(manual: sending commit; none: sending response.create) to the first reply
audio byte. voice-to-voice = from sending the last voiced chunk of the turn to
the first reply audio byte; a chunk is voiced when its RMS is above -45 dBFS,
and the turn's chunks are those before the server's decision point
(speech_stopped's audio_end_ms + silence_duration_ms) and after the previous
turn's. barge-in = from sending the first voiced chunk of the interrupting
speech (the voiced run around speech_started's audio_start_ms) to receiving
output_audio_buffer.cleared. Without --realtime the file is sent faster than it
plays, so voice-to-voice leaves out most of the silence window: use --realtime
for numbers comparable with a live user.

With --mic there is no IN: the microphone (--input-device; `rtmedia devices` lists
them) is the user's voice, in --chunk-ms chunks, and replies play on the speaker
(--output-device) through a --jitter-ms buffer; playback.ack reports what the
speaker actually played (PortAudio's output timing), so a barge-in truncates the
history at what was heard. A live view shows the level, your words, the reply
and latencies; Ctrl-C (or --duration) closes the session. Latencies are then
acoustic: voice-to-voice from the capture of the turn's last voiced chunk to the
reply's first sample at the speaker, barge-in from the capture of the
interrupting speech to the reply's last sample out. --push-to-talk makes manual
turns (space starts one, interrupting any reply; space again sends it);
--half-duplex mutes the microphone while a reply plays (speakers that reach the
microphone without echo cancellation would otherwise interrupt themselves).

With --tools FILE the session offers FILE's public Python functions as tools (their
docstrings and type hints are the declarations); each call the model makes runs here,
is printed with its result, and its output goes back with response.create for the answer.

--json prints one canonical JSON event per line (rtmedia.protocol.events.to_json)
with "t_ms" added: the client clock in ms from sending the first audio chunk
(negative before it). Audio deltas carry "audio_bytes" (the PCM16 byte count)
instead of the base64 "audio". The last line is {"type": "summary", ...}.
"""


def add_talk_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("talk", help="a duplex speech session from an audio file (RealtimeService)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", type=Path, metavar="IN", nargs="?", help=f"the user's voice: {AUDIO_IN_HELP}")
    p.add_argument("--rate", type=positive_int, default=None, metavar="HZ", help=RATE_HELP)
    p.add_argument("-o", "--output", type=Path, default=None, metavar="OUT",
                   help="write the reply audio (every audio delta, in order) to this file, its format from the "
                        "extension; - for raw PCM16 on standard output")
    p.add_argument("--format", choices=list(FORMATS), default=None,
                   help="the format of -o whatever it is called (default: from its extension)")
    p.add_argument("--record", type=Path, default=None, metavar="FILE.ogg",
                   help="record the conversation as this client heard it: stereo Ogg Opus, what was sent on the "
                        "left, the replies as played on the right (cut at barge-ins), on the input's clock")
    p.add_argument("--mode", choices=[SERVER_VAD, SEMANTIC_VAD, MANUAL, NONE], default=SERVER_VAD,
                   help="turn detection: server_vad (the server finds turns and answers; default), semantic_vad "
                        "(the same, a model deciding at each pause whether you have finished), manual "
                        "(commit + response.create after the file), none (response.create after the file)")
    p.add_argument("--eagerness", choices=["low", "medium", "high", "auto"], default=None,
                   help="semantic_vad: how readily a pause ends the turn (default auto = medium)")
    p.add_argument("--interruption", choices=["immediate", "confirmed"], default=None,
                   help="voice over a reply: immediate (it cancels the reply; the server's default) or confirmed "
                        "(the reply pauses, and a backchannel such as \"yeah okay\" lets it go on)")
    p.add_argument("--preemptive", choices=["on", "off"], default=None,
                   help="server_vad, semantic_vad: the server prepares the reply at your pauses and sends it the "
                        "moment your turn ends (default on)")
    p.add_argument("--noise-reduction", choices=["off", "near_field", "far_field"], default=None,
                   help="noise suppression of your voice for the server's VAD: near_field (a headset), far_field "
                        "(a laptop or room microphone) or off (default: the server's)")
    p.add_argument("--responder", default=None, help="responder, e.g. echo (default: the server's)")
    p.add_argument("--instructions", default=None, help="instructions for the responder")
    p.add_argument("--voice", default=None, help="reply voice (see `rtmedia voices`; default: the server's)")
    p.add_argument("--output-rate", type=positive_int, default=None,
                   help="reply sample rate in Hz (default: the voice's)")
    p.add_argument("--realtime", action="store_true",
                   help="send the audio at real-time pace (default: as fast as allowed, at most 10x real time)")
    p.add_argument("--chunk-ms", type=positive_int, default=20, help="audio per append event, 1..1000 (default 20 ms)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    p.add_argument("--json", action="store_true", help="one JSON event per line, then a summary line")
    p.add_argument("--tools", type=Path, default=None, metavar="FILE.py",
                   help="offer FILE.py's public functions as tools and run the calls here")
    p.add_argument("--timeout", type=positive_float, default=60.0,
                   help="after the file is sent, wait at most this many seconds for the session to go idle "
                        "(default 60); then exit non-zero")
    live = p.add_argument_group("live voice (--mic)")
    live.add_argument("--mic", action="store_true",
                      help="talk live: the microphone is your voice and replies play on the speaker, instead of IN")
    live.add_argument("--input-device", default=None, metavar="DEV",
                      help="microphone: index or name from `rtmedia devices` (default: the system's)")
    live.add_argument("--output-device", default=None, metavar="DEV",
                      help="speaker: index or name from `rtmedia devices` (default: the system's)")
    live.add_argument("--push-to-talk", action="store_true",
                      help="manual turns: space starts a turn (interrupting a reply), space again sends it")
    live.add_argument("--half-duplex", action="store_true",
                      help="mute the microphone while a reply plays (laptop speakers without echo cancellation)")
    live.add_argument("--jitter-ms", type=positive_int, default=None,
                      help="reply audio buffered before it starts playing (default 60 ms)")
    live.add_argument("--duration", type=positive_float, default=None, metavar="S",
                      help="end the session after S seconds (default: at Ctrl-C)")
    add_credential_flags(p)
    p.set_defaults(func=cmd_talk)


def cmd_talk(args: argparse.Namespace) -> None:
    if args.mic:
        from rtmedia.clients.commands.talk_mic import cmd_talk_mic

        return cmd_talk_mic(args)
    if args.input is None:
        raise CliError("give IN, the audio file to speak, or --mic to speak into the microphone")
    for flag in ("input_device", "output_device", "push_to_talk", "half_duplex", "duration", "jitter_ms"):
        if getattr(args, flag) not in (None, False):
            raise CliError(f"--{flag.replace('_', '-')} is for --mic")
    credentials = from_args(args)
    out_format, toolbox = output_and_tools(args)
    # server_vad: a second of silence after the file, as a live microphone keeps sending
    audio = load_input(args.input, args.chunk_ms, tail_ms=1000 if args.mode in VAD_TURNS else 0, raw_rate=args.rate)
    if args.timeout <= 0:
        raise CliError(f"--timeout must be positive, got {args.timeout}")
    if args.eagerness is not None and args.mode != SEMANTIC_VAD:
        raise CliError(f"--eagerness is for --mode semantic_vad, not {args.mode}")
    if args.preemptive is not None and args.mode not in VAD_TURNS:
        raise CliError(f"--preemptive is for --mode server_vad or semantic_vad, not {args.mode}")
    with recorded(args.record) as recording:
        talk = asyncio.run(converse(Talk(args, audio, toolbox=toolbox, recording=recording), credentials))
    if sys.stderr.isatty() and not args.json and talk.partial:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    finish(talk, args, out_format)
