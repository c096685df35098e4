"""`rtmedia loadtest`: many simulated people talking to a server at once, measured
as docs/protocol.md#latency-definitions defines, over RealtimeService.Converse through the
generated stubs (--transport grpc) or over OpenAI's Realtime API on the web front's
`/v1/realtime` WebSocket (--transport openai-ws, rtmedia.clients.loadtest.openai_ws).

Each person is one session and two tasks: a sender that streams speech at real-time pace
(one append event per --chunk-ms, silence between utterances, as a live microphone does)
and acknowledges the reply it is "playing", and a reader that handles the server's events.
Replies are played on a simulated clock that starts with their first audio delta. The
transports differ only in how a person connects, what it sends and how it reads events;
what it measures is the same code, so both give the same report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rtmedia.clients.channels import CHANNEL_OPTIONS, DEFAULT_TARGET
from rtmedia.clients.commands.common import CliError
from rtmedia.clients.credentials import (
    Credentials,
    add_credential_flags,
    from_args,
    unavailable_hint,
)
from rtmedia.clients.loadtest.report import (
    capacity,
    next_level,
    render_table,
    summary_lines,
    write_plot,
)
from rtmedia.clients.loadtest.run import Progress, Run
from rtmedia.clients.loadtest.settings import (
    DEFAULT_WEB_URL,
    INPUT_RATES,
    PROFILES,
    SESSIONS_PER_CONNECTION,
    SETTLE_S,
    TRANSPORTS,
    input_rate,
)
from rtmedia.clients.loadtest.speech import (
    Clip,
    audio_files,
    backchannel_clips,
    load_clips,
    noise_clips,
    paused_clips,
    synthesized,
)
from rtmedia.protocol.turn_kinds import NONE, SEMANTIC_VAD, SERVER_VAD

DESCRIPTION = """\
Simulate many people talking to an rtmedia server at once and measure what they
experience. Each session streams real speech (Piper-synthesised sentences, or the
audio files of --audio DIR, any format, one utterance per file) at real-time pace in --chunk-ms
chunks with 1-2.5 s silences between utterances (talking profiles: the next
utterance follows 0.4-1.2 s after the reply has played), plays replies on a
simulated clock and (grpc) acknowledges them with playback.ack every 200 ms of play.

Profiles (session config):
  listen       server VAD turn events only: transcription off, no responses
  transcribe   plus streaming transcription of every turn
  talk         full turns answered by the echo responder (openai-ws: the server's default)
  llm          full turns answered by the llm responder (grpc only)
  mixed        sessions take listen, listen, transcribe, talk in turn
  barge-in     talk, interrupting --barge-in-share of the replies 0.4-0.9 s into them; of those
               voices, --backchannel-share are backchannels ("yeah", "mm-hmm") and --noise
               a burst like a cough or a knock, neither of which should cancel the reply
               (--interruption confirmed tells them apart; immediate, the server's default, does not)

Measured on the client's clock (docs/protocol.md#latency-definitions): response latency (speech_stopped
received -> first reply audio), voice-to-voice (last voiced sample sent -> first
reply audio), barge-in (first voiced sample of the interruption sent ->
output_audio_buffer.cleared), VAD start (first voiced sample sent ->
speech_started), final transcript (speech_stopped -> transcription .completed),
jitter (how much later than the previous delta's play time each reply audio
delta arrived) and underruns (a reply delta arriving after the audio before it
had finished playing). Percentiles are p50/p95/p99/max.

Transports: grpc (default) speaks RealtimeService.Converse to --target. openai-ws
speaks OpenAI's Realtime API (GA) to the web front (`rtmedia web`, `rtmedia serve
--web`) at --web-url (https:// for TLS, with --ca and --cert/--key): each session is
a WebSocket to /v1/realtime?model=gpt-realtime (with --token: Authorization: Bearer),
set up with session.update (audio/pcm, PCM16 at 24 kHz both ways; server_vad or no
turn detection; transcription where the profile transcribes) and fed
input_audio_buffer.append events of base64 PCM16 at 24 kHz (the speech resampled;
--input-rate may only be 24000); it ends by closing the socket. The API has no
playback.ack: the client only plays its replies on its clock, and the server
estimates each reply's playback from the wall clock since its first delta. A
barge-in is the client's own: at speech_started during a reply it stops playing it
and sends conversation.item.truncate with what it played; barge-in latency ends
there (or at output_audio_buffer.cleared or the reply's cancelled response.done,
if one comes first). A handshake refused with 429 counts as rejected. Replies come
from the server's default responder (run the server with --responder echo for talk
and barge-in); llm needs the llm responder chosen per session, which the API cannot
do, so it is grpc only. The report has the same fields plus "transport"; its
"target" is then the WebSocket URL.

--find-capacity runs levels of sessions (starting at --sessions, growing 1.5x,
then bisecting) until the SLO breaks: p95 of the profile's key latency (response
latency; VAD start for listen, final transcript for transcribe) within
--slo-p95-ms, no underruns, no errors, nobody rejected. It reports the largest
level that held.
"""


def add_loadtest_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="many simulated sessions at once: latency percentiles and capacity",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"server gRPC address (default {DEFAULT_TARGET})")
    p.add_argument("--transport", choices=TRANSPORTS, default="grpc",
                   help="grpc (Converse, default) or openai-ws (OpenAI's Realtime API on --web-url's /v1/realtime)")
    p.add_argument("--web-url", default=DEFAULT_WEB_URL,
                   help=f"openai-ws: the web front's base URL, http:// or https:// (default {DEFAULT_WEB_URL})")
    p.add_argument("--sessions", type=int, default=10, help="concurrent sessions (default 10; the first "
                                                            "level with --find-capacity)")
    p.add_argument("--ramp-per-s", type=float, default=10.0, help="sessions started per second (default 10)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds from the first session's start until sessions stop speaking (default 30); "
                        "they then finish their turn and close")
    p.add_argument("--profile", choices=PROFILES, default="talk", help="what the sessions do (default talk)")
    p.add_argument("--chunk-ms", type=int, default=20, help="audio per append event, 10..1000 (default 20)")
    p.add_argument("--input-rate", type=int, default=None,
                   help="PCM16 input rate: 8000, 16000 (default), 24000; openai-ws: 24000 only (the default there)")
    p.add_argument("--turn-detection", choices=[SERVER_VAD, SEMANTIC_VAD, NONE], default=SERVER_VAD,
                   help="semantic_vad: a model decides at each pause whether the user has finished; none (listen "
                        "only) streams audio with no turn detection (the frame-path benchmark)")
    p.add_argument("--eagerness", choices=["low", "medium", "high", "auto"], default=None,
                   help="semantic_vad: how readily a pause ends the turn (default auto = medium)")
    p.add_argument("--paused-share", type=float, default=0.0,
                   help="the share of utterances spoken with a 600-900 ms pause where the sentence is plainly "
                        "unfinished (default 0); a turn that ends in such a pause counts as premature")
    p.add_argument("--barge-in-share", type=float, default=0.5,
                   help="barge-in: the share of replies interrupted (default 0.5)")
    p.add_argument("--interruption", choices=["immediate", "confirmed"], default=None,
                   help="turn_detection.interruption.mode (default: the server's, immediate)")
    p.add_argument("--preemptive", choices=["on", "off"], default=None,
                   help="turn_detection.preemptive: replies prepared at pauses (default: the server's, on)")
    p.add_argument("--backchannel-share", type=float, default=0.0,
                   help="barge-in: the share of the voices over replies that are backchannels (default 0)")
    p.add_argument("--noise", type=float, default=0.0, metavar="SHARE",
                   help="barge-in: the share of the voices over replies that are noise bursts (default 0)")
    p.add_argument("--audio", type=Path, default=None, metavar="DIR",
                   help="speak the audio files of DIR (wav, mp3, m4a, ogg/opus, flac, webm, ...: any format "
                        "PyAV decodes; other files are skipped) instead of the built-in sentences")
    p.add_argument("--seed", type=int, default=1, help="random seed for pauses and clip order (default 1)")
    p.add_argument("--reply-timeout", type=float, default=30.0,
                   help="seconds a turn may wait for its response before it counts as a no_response error")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to reach the server (default 5)")
    p.add_argument("--find-capacity", action="store_true", help="grow the session count until the SLO breaks")
    p.add_argument("--capacity-limit", type=int, default=2000, help="--find-capacity stops here (default 2000)")
    p.add_argument("--slo-p95-ms", type=float, default=500.0, help="SLO on the key latency's p95 (default 500)")
    p.add_argument("--fail-on-slo", action="store_true", help="exit non-zero when the SLO did not hold")
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart (latency and sessions over time)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout (the table goes to stderr)")
    p.add_argument("--quiet", action="store_true", help="no live progress")
    add_credential_flags(p)
    p.set_defaults(func=cmd_loadtest)


def check_args(args: argparse.Namespace) -> None:
    """Impossible parameters are one-line errors."""
    rate = input_rate(args)
    if args.transport == "openai-ws":
        from rtmedia.clients.loadtest.openai_ws import check_openai_args

        check_openai_args(args)
    problems = [
        (args.sessions < 1, f"--sessions must be at least 1, got {args.sessions}"),
        (args.ramp_per_s <= 0, f"--ramp-per-s must be positive, got {args.ramp_per_s:g}"),
        (args.duration <= 0, f"--duration must be positive, got {args.duration:g}"),
        (not 10 <= args.chunk_ms <= 1000, f"--chunk-ms must be 10..1000, got {args.chunk_ms}"),
        (rate not in INPUT_RATES, f"--input-rate must be one of {', '.join(map(str, INPUT_RATES))}, got {rate}"),
        (rate * args.chunk_ms % 1000 != 0, f"--chunk-ms {args.chunk_ms} is not a whole number of samples at {rate} Hz"),
        (not 0 <= args.barge_in_share <= 1, f"--barge-in-share must be 0..1, got {args.barge_in_share:g}"),
        (args.turn_detection == NONE and args.profile != "listen",
         "--turn-detection none is only for --profile listen"),
        (args.eagerness is not None and args.turn_detection != SEMANTIC_VAD,
         "--eagerness is for --turn-detection semantic_vad"),
        (not 0 <= args.paused_share <= 1, f"--paused-share must be 0..1, got {args.paused_share:g}"),
        (not 0 <= args.backchannel_share <= 1, f"--backchannel-share must be 0..1, got {args.backchannel_share:g}"),
        (not 0 <= args.noise <= 1, f"--noise must be 0..1, got {args.noise:g}"),
        (args.backchannel_share + args.noise > 1,
         f"--backchannel-share and --noise add up to {args.backchannel_share + args.noise:g}, more than 1"),
        ((args.backchannel_share or args.noise) and args.profile != "barge-in",
         "--backchannel-share and --noise are for --profile barge-in (they are said over replies)"),
        (args.interruption is not None and args.turn_detection == NONE,
         "--interruption needs turn detection"),
        (args.preemptive is not None and args.turn_detection == NONE,
         "--preemptive needs turn detection"),
        (args.paused_share > 0 and args.audio is not None, "--paused-share speaks built-in sentences, not --audio"),
        (args.slo_p95_ms <= 0, f"--slo-p95-ms must be positive, got {args.slo_p95_ms:g}"),
        (args.reply_timeout <= 0, f"--reply-timeout must be positive, got {args.reply_timeout:g}"),
        (args.connect_timeout <= 0, f"--connect-timeout must be positive, got {args.connect_timeout:g}"),
        (args.find_capacity and args.capacity_limit < args.sessions,
         f"--capacity-limit {args.capacity_limit} is below --sessions {args.sessions}"),
    ]
    for bad, message in problems:
        if bad:
            raise CliError(message)
    top = args.capacity_limit if args.find_capacity else args.sessions
    ramp_s = (top - 1) / args.ramp_per_s
    if ramp_s >= args.duration:
        raise CliError(f"starting {top} sessions at {args.ramp_per_s:g}/s takes {ramp_s:.1f} s, not less than "
                       f"--duration {args.duration:g} s: raise --ramp-per-s or --duration")


# ---- the command ------------------------------------------------------------------------------------

async def _connect(args: argparse.Namespace, sessions: int, credentials: Credentials) -> list[grpc.aio.Channel]:
    """Channels (one connection per 50 sessions, like separate users) to a server that is SERVING."""
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]

    def channel() -> grpc.aio.Channel:
        return credentials.aio_channel(args.target, options)

    first = channel()
    try:
        reply = await health_pb2_grpc.HealthStub(first).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=args.connect_timeout)
    except grpc.aio.AioRpcError as exc:
        await first.close()
        tls = credentials.describe()
        detail = (exc.details() or "").splitlines()[0] if exc.details() else exc.code().name
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            detail = f"no answer within {args.connect_timeout:g} s"
        raise CliError(f"cannot reach {args.target} ({tls}): {detail}; check the address and whether the server "
                       f"uses TLS (--tls){unavailable_hint(args, detail) if credentials.tls else ''}") from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        await first.close()
        raise CliError(f"{args.target} is not serving (health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)})")
    return [first, *(channel() for _ in range(-(-sessions // SESSIONS_PER_CONNECTION) - 1))]


async def _open(args: argparse.Namespace, sessions: int, credentials: Credentials) -> Any:
    """The transport's link to a server that answers: gRPC channels, or a SocketLink."""
    if args.transport == "openai-ws":
        from rtmedia.clients.loadtest.openai_ws import open_link

        return await open_link(args, credentials)
    return await _connect(args, sessions, credentials)


async def _close(args: argparse.Namespace, link: Any) -> None:
    if args.transport == "openai-ws":
        await link.close()
        return
    for channel in link:
        await channel.close()


async def _loadtest(args: argparse.Namespace, clips: list[Clip], credentials: Credentials) -> dict[str, Any]:
    top = args.capacity_limit if args.find_capacity else args.sessions
    link = await _open(args, top, credentials)
    progress = Progress(args.quiet)
    try:
        if not args.find_capacity:
            return await Run(args, link, clips, args.sessions).go(progress)
        results: dict[int, bool] = {}
        levels: list[dict[str, Any]] = []
        best: dict[str, Any] | None = None
        level = next_level(results, args.sessions, 1.5, 0.1, args.capacity_limit)
        while level is not None:
            progress.label = f"[{level} sessions] "
            report = await Run(args, link, clips, level).go(progress)
            held = report["slo"]["held"]
            results[level] = held
            metric = report["slo"]["metric"]
            levels.append({"sessions": level, "held": held, "verdict": report["slo"]["verdict"],
                           f"{metric}_p95": report[metric]["p95"], "errors": report["errors"],
                           "underruns": report["underruns"], "rejected": report["sessions_rejected"],
                           "loadgen_cpu_share": report["loadgen_cpu_share"]})
            if not args.quiet:
                print(f"{level} sessions: {report['slo']['verdict']}", file=sys.stderr, flush=True)
            if held and (best is None or level > best["sessions"]):
                best = report
            level = next_level(results, args.sessions, 1.5, 0.1, args.capacity_limit)
            if level is not None:
                await asyncio.sleep(SETTLE_S)
        final = best if best is not None else report
        final["capacity"] = capacity(results)
        final["capacity_levels"] = levels
        return final
    finally:
        await _close(args, link)


def cmd_loadtest(args: argparse.Namespace) -> None:
    check_args(args)
    credentials = from_args(args)
    paths = audio_files(args.audio) if args.audio else synthesized()
    clips = load_clips(paths, input_rate(args), args.chunk_ms)
    if args.paused_share:
        clips += paused_clips(input_rate(args), args.chunk_ms, args.seed)
    if args.backchannel_share:
        clips += backchannel_clips(input_rate(args), args.chunk_ms)
    if args.noise:
        clips += noise_clips(input_rate(args), args.chunk_ms, args.seed)
    if args.transport == "openai-ws":
        from rtmedia.clients.loadtest.openai_ws import socket_clips

        clips = socket_clips(clips)
    report = asyncio.run(_loadtest(args, clips, credentials))
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        write_plot(report, args.plot)
    from rich.console import Console

    console = Console(stderr=args.json)
    console.print(render_table(report))
    for line in summary_lines(report):
        console.print(line, highlight=False)
    if "capacity" in report:
        console.print(f"capacity: {report['capacity']} sessions held the SLO", highlight=False)
    if args.json:
        print(json.dumps(report), flush=True)
    if args.fail_on_slo and not report["slo"]["held"]:
        raise CliError(f"the SLO did not hold: {report['slo']['verdict']}")
