"""Client commands of the `rtmedia` CLI: voices, synth, transcribe, health, talk (in talk.py),
decode-video (in video.py), loadtest (in loadtest.py), and `run`, which turns every user mistake
(a missing or non-audio file, an unreachable server, a TLS mismatch, a bad value, a server's
refusal) into one line `rtmedia COMMAND: PROBLEM` on stderr and a non-zero exit. A traceback is
printed only with --debug (or RTMEDIA_DEBUG=1); anything unexpected is reported as an internal
error in one line too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from rtmedia.clients.client import DEFAULT_TARGET, SpeechClient
from rtmedia.clients.commands.common import (
    AUDIO_IN_HELP,
    RATE_HELP,
    CliError,
    non_negative_int,
    positive_float,
    positive_int,
)
from rtmedia.clients.credentials import (
    add_credential_flags,
    from_args,
    status_refusal,
    token_of,
    unavailable_hint,
)

# Rates the server takes PCM16 at; other input rates are resampled to 16 kHz here.
SERVER_RATES = (8000, 16000, 24000, 48000)
DEBUG_ENV = "RTMEDIA_DEBUG"


def add_debug_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help=f"on an error, print the traceback too (or set {DEBUG_ENV}=1)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
        p.add_argument("--json", action="store_true", help="machine-readable JSON output")
        p.add_argument("--timeout", type=positive_float, default=None, help="give up after this many seconds")
        add_credential_flags(p)

    p = sub.add_parser("voices", help="list the server's voices and their output rates")
    common(p)
    p.set_defaults(func=cmd_voices)

    from rtmedia.clients.audio_file import EXTENSIONS, FORMATS

    p = sub.add_parser("synth", help="speak text with streaming TTS and save the audio in any format",
                       description="Stream speech for TEXT from the server and write it to OUT as it arrives, "
                                   "in the container and codec OUT's extension names "
                                   f"({', '.join(EXTENSIONS)}) or --format; Opus files run at 48 kHz. "
                                   "`-o -` writes raw PCM16 mono to standard output (with every message, "
                                   "--json included, on stderr), for a pipe: "
                                   "rtmedia synth \"Hello.\" -o - | aplay -f S16_LE -r 22050. "
                                   "Prints when the first audio arrived and what was written.")
    p.add_argument("text", help="the text to speak")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="OUT",
                   help="output file (its extension picks the format), or - for raw PCM16 on standard output")
    p.add_argument("--voice", default="", help="voice name (see `rtmedia voices`; default: the server's)")
    p.add_argument("--sample-rate", type=non_negative_int, default=0,
                   help="output rate in Hz (default 0: the voice's own)")
    p.add_argument("--format", choices=list(FORMATS), default=None,
                   help="write this format whatever OUT is called (default: from OUT's extension)")
    common(p)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("transcribe", help="transcribe any audio file with streaming ASR",
                       description="Stream an audio file (any container and codec PyAV decodes, at any rate "
                                   "and channel count) to the server and print partial and final transcripts "
                                   "as they arrive. IN - reads standard input: a file, or raw PCM16 with "
                                   "--rate, e.g. rtmedia synth \"Hello.\" -o - | rtmedia transcribe - "
                                   "--rate 22050.")
    p.add_argument("input", type=Path, metavar="IN", help=AUDIO_IN_HELP)
    p.add_argument("--rate", type=positive_int, default=None, metavar="HZ", help=RATE_HELP)
    p.add_argument("--chunk-ms", type=positive_int, default=100, help="audio per request (default 100 ms)")
    p.add_argument("--realtime", action="store_true", help="send the audio at real-time pace")
    common(p)
    p.set_defaults(func=cmd_transcribe)

    p = sub.add_parser("health", help="ask the server's grpc.health.v1: exit 0 when SERVING, 1 otherwise",
                       description="Check the server (or one of its services) through grpc.health.v1, as a "
                                   "container HEALTHCHECK or a script does: prints the status, exits 0 when "
                                   "SERVING and 1 otherwise (NOT_SERVING, unknown service, unreachable).")
    p.add_argument("--service", default="", help="a service name, e.g. rtmedia.v1.RealtimeService (default: the "
                                                 "whole server)")
    common(p)
    p.set_defaults(func=cmd_health, timeout=5.0)

    p = sub.add_parser("devices", help="list the audio devices `talk --mic` can use",
                       description="List the microphones and speakers PortAudio sees, as `talk --mic "
                                   "--input-device/--output-device` name them (by index or name); * marks the "
                                   "defaults.")
    p.add_argument("--json", action="store_true", help="one JSON object per device")
    p.set_defaults(func=cmd_devices)

    # Imported here: the commands' own modules load only when the CLI builds its parser.
    from rtmedia.clients.commands.talk import add_talk_parser
    from rtmedia.clients.commands.video import add_video_parser
    from rtmedia.clients.loadtest.harness import add_loadtest_parser

    add_talk_parser(sub)
    add_video_parser(sub)
    add_loadtest_parser(sub)
    for name in ("voices", "synth", "transcribe", "health", "devices", "talk", "decode-video", "loadtest"):
        add_debug_flag(sub.choices[name])


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _status_line(args: argparse.Namespace, error: Any) -> str:
    """A failed call (a grpc.RpcError, or the client library's RtmediaError) as one line."""
    from rtmedia.clients.errors import RtmediaError

    if isinstance(error, grpc.RpcError):
        error = RtmediaError.from_rpc(error)
    code, details, reason, metadata = error.code, error.details, error.reason, error.metadata
    line = status_refusal(code, details, reason, metadata, token_sent=bool(token_of(args)))
    if line is not None:
        return line
    line = f"{code.name}: {details}" + (f" ({reason})" if reason else "")
    if code == grpc.StatusCode.UNAVAILABLE:
        line += unavailable_hint(args, details)
    return line


def problem_line(args: argparse.Namespace, exc: BaseException) -> str | None:
    """A user's mistake as one line, or None for an exception that is not one (a bug)."""
    from rtmedia.clients.errors import RtmediaError

    if isinstance(exc, grpc.RpcError | RtmediaError):
        return _one_line(_status_line(args, exc))
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return _one_line(f"{where}{exc.strerror}")
    if isinstance(exc, CliError | OSError | ValueError):
        return _one_line(str(exc) or type(exc).__name__)
    return None


def run(args: argparse.Namespace) -> int:
    """Run a client command. Each error is one line `rtmedia COMMAND: PROBLEM` on stderr and a
    non-zero exit (1; 130 for Ctrl-C); with --debug (or RTMEDIA_DEBUG=1) the traceback first."""
    name = f"rtmedia {args.command}"
    debug = bool(getattr(args, "debug", False) or os.environ.get(DEBUG_ENV, "") not in ("", "0"))
    try:
        args.func(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of a pipe went away (`... -o - | head -c 100`): stop quietly
        _drop_stdout()
        print(f"{name}: standard output was closed", file=sys.stderr)
        return 1
    except Exception as exc:
        if debug:
            traceback.print_exc()
        line = problem_line(args, exc)
        if line is None:
            line = f"internal error: {type(exc).__name__}: {_one_line(str(exc))}" + (
                "" if debug else " (run with --debug for the traceback)")
        print(f"{name}: {line}", file=sys.stderr)
        return 1
    return 0


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of a closed pipe raises nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def cmd_voices(args: argparse.Namespace) -> None:
    with SpeechClient(args.target, args.timeout, from_args(args)) as client:
        reply = client.list_voices()
    if args.json:
        print(json.dumps({"voices": [
            {"name": v.name, "language": v.language, "native_sample_rate": v.native_sample_rate,
             "supported_sample_rates": list(v.supported_sample_rates)} for v in reply.voices
        ], "max_text_chars": reply.max_text_chars}))
        return
    for v in reply.voices:
        rates = ", ".join(map(str, v.supported_sample_rates))
        print(f"{v.name}  {v.language}  native {v.native_sample_rate} Hz  rates: {rates}")


def cmd_devices(args: argparse.Namespace) -> None:
    from rtmedia.clients.commands.audio_devices import DeviceError, list_devices

    try:
        devices = list_devices()
    except DeviceError as exc:
        raise CliError(str(exc)) from None
    if not devices:
        raise CliError("PortAudio sees no audio devices")
    for d in devices:
        if args.json:
            print(json.dumps(d))
            continue
        ways = [f"{kind} {n} ch{' *' if d[f'default_{kind}'] else ''}"
                for kind, n in (("input", d["input_channels"]), ("output", d["output_channels"])) if n]
        print(f"{d['index']:>3}  {d['name']}  ({d['host_api']}; {', '.join(ways)}; {d['default_sample_rate']} Hz)")


def cmd_health(args: argparse.Namespace) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with from_args(args).channel(args.target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                             timeout=args.timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise CliError(f"the server has no service {args.service!r}") from None
            raise
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(json.dumps({"service": args.service, "status": status}) if args.json else status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise SystemExit(1)


def cmd_synth(args: argparse.Namespace) -> None:
    from rtmedia.clients.audio_file import STDIO, AudioWriter, output_format

    fmt = output_format(args.output, args.format)  # an unknown extension fails before any request
    to_stdout = str(args.output) == STDIO
    text_out = sys.stderr if to_stdout else sys.stdout  # standard output carries the audio
    started = time.perf_counter()
    first_audio_ms = None
    chunks = 0
    writer: AudioWriter | None = None
    try:
        with SpeechClient(args.target, args.timeout, from_args(args)) as client:
            for reply in client.synthesize(args.text, args.voice, args.sample_rate):
                if first_audio_ms is None:
                    first_audio_ms = (time.perf_counter() - started) * 1000
                    if not args.json:
                        print(f"first audio after {first_audio_ms:.0f} ms", file=sys.stderr)
                if (reply.channels or 1) != 1:
                    raise CliError(f"the server sent {reply.channels}-channel audio; synth writes mono")
                if writer is None:
                    writer = AudioWriter(args.output, reply.sample_rate, fmt)
                writer.write(bytes(reply.audio))
                chunks += 1
                if not args.json:
                    print(f"  chunk {reply.chunk_index}: {reply.text!r}", file=sys.stderr)
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise CliError("the server sent no audio")
    where = "standard output" if to_stdout else str(args.output)
    if args.json:
        print(json.dumps({"output": str(args.output), "format": fmt, "sample_rate": writer.file_rate,
                          "channels": 1, "seconds": round(writer.seconds, 3),
                          "first_audio_ms": round(first_audio_ms or 0, 1), "chunks": chunks}), file=text_out)
    else:
        print(f"wrote {where}: {writer.seconds:.2f} s of {fmt} at {writer.file_rate} Hz in {chunks} chunks",
              file=sys.stderr)


def _audio_chunks(path: Path, chunk_ms: int, realtime: bool, raw_rate: int | None = None
                  ) -> tuple[int, Iterator[bytes]]:
    from rtmedia.clients.audio_file import read_audio

    if chunk_ms <= 0:
        raise CliError(f"--chunk-ms must be positive, got {chunk_ms}")
    audio = read_audio(path, raw_rate=raw_rate)
    if audio.sample_rate not in SERVER_RATES:
        audio = audio.at_rate(16000)
    if not len(audio.samples):
        raise CliError(f"{path}: the file holds no audio")
    samples_bytes, rate = audio.samples.astype("<i2").tobytes(), audio.sample_rate
    step = max(2, rate * chunk_ms // 1000 * 2)

    def chunks() -> Iterator[bytes]:
        started = time.perf_counter()
        for n, offset in enumerate(range(0, len(samples_bytes), step)):
            if realtime:
                time.sleep(max(0.0, started + n * chunk_ms / 1000 - time.perf_counter()))
            yield samples_bytes[offset:offset + step]

    return rate, chunks()


def cmd_transcribe(args: argparse.Namespace) -> None:
    rate, chunks = _audio_chunks(args.input, args.chunk_ms, args.realtime, args.rate)
    started = time.perf_counter()
    finals: list[str] = []
    tty = sys.stderr.isatty() and not args.json
    with SpeechClient(args.target, args.timeout, from_args(args)) as client:
        for result in client.transcribe(chunks, rate):
            t_ms = round((time.perf_counter() - started) * 1000)
            kind = "final" if result.is_final else "partial"
            if result.is_final:
                finals.append(result.text)
            if args.json:
                print(json.dumps({"type": kind, "utterance_index": result.utterance_index, "text": result.text,
                                  "delta": result.delta, "start_ms": result.start_ms, "end_ms": result.end_ms,
                                  "t_ms": t_ms}), flush=True)
            elif result.is_final:
                clear = "\r\033[K" if tty else ""
                print(f"{clear}[{result.start_ms / 1000:6.2f} - {result.end_ms / 1000:6.2f}] {result.text}", flush=True)
            elif tty:
                print(f"\r\033[K  … {result.text}", end="", file=sys.stderr, flush=True)
    text = " ".join(t for t in finals if t)
    if args.json:
        print(json.dumps({"type": "done", "text": text, "utterances": len(finals)}))
    else:
        print(f"({len(finals)} utterance{'s' if len(finals) != 1 else ''})", file=sys.stderr)
