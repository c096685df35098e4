"""Client commands of the `rtmedia` CLI: voices, synth, transcribe, talk (in talk.py),
loadtest (in loadtest.py)."""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from rtmedia.clients.client import DEFAULT_TARGET, SpeechClient, read_wav
from rtmedia.clients.credentials import add_credential_flags, from_args, refusal, token_of, unavailable_hint
from rtmedia.protocol.errors import error_reason
from rtmedia.v1 import speech_pb2

# Rates the server takes PCM16 at; other WAV rates are resampled to 16 kHz here.
SERVER_RATES = (8000, 16000, 24000, 48000)


class CliError(Exception):
    """An error the CLI reports as one line and a non-zero exit."""


def add_commands(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
        p.add_argument("--json", action="store_true", help="machine-readable JSON output")
        p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
        add_credential_flags(p)

    p = sub.add_parser("voices", help="list the server's voices and their output rates")
    common(p)
    p.set_defaults(func=cmd_voices)

    p = sub.add_parser("synth", help="speak text with streaming TTS and save the audio",
                       description="Stream speech for TEXT from the server and write it to a file. "
                                   "Prints when the first audio arrived and what was written.")
    p.add_argument("text", help="the text to speak")
    p.add_argument("-o", "--output", required=True, type=Path, help="output file (.wav, or raw PCM16 with --format pcm)")
    p.add_argument("--voice", default="", help="voice name (see `rtmedia voices`; default: the server's)")
    p.add_argument("--sample-rate", type=int, default=0, help="output rate in Hz (default: the voice's own)")
    p.add_argument("--format", choices=["wav", "pcm"], default="wav", help="WAV file or raw PCM16 (default wav)")
    common(p)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("transcribe", help="transcribe a WAV file with streaming ASR",
                       description="Stream a 16-bit PCM WAV file to the server and print partial and final "
                                   "transcripts as they arrive.")
    p.add_argument("input", type=Path, help="16-bit PCM WAV file (stereo is averaged to mono)")
    p.add_argument("--chunk-ms", type=int, default=100, help="audio per request (default 100 ms)")
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

    from rtmedia.clients.loadtest import add_loadtest_parser  # imported here: both import this module
    from rtmedia.clients.talk import add_talk_parser

    add_talk_parser(sub)
    from rtmedia.clients.video import add_video_parser

    add_video_parser(sub)
    add_loadtest_parser(sub)


def run(args: argparse.Namespace) -> int:
    """Run a client command; errors become one line on stderr and exit code 1."""
    try:
        args.func(args)
    except grpc.RpcError as exc:
        line = refusal(exc, token_sent=bool(token_of(args)))
        if line is None:
            reason = error_reason(exc)
            line = f"{exc.code().name}: {exc.details()}" + (f" ({reason})" if reason else "")
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                line += unavailable_hint(args, exc.details() or "")
        print(f"rtmedia {args.command}: {line}", file=sys.stderr)
        return 1
    except (CliError, OSError, ValueError) as exc:
        print(f"rtmedia {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


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
    wav = args.format == "wav"
    framing = speech_pb2.AUDIO_FRAMING_WAV if wav else speech_pb2.AUDIO_FRAMING_PCM16
    started = time.perf_counter()
    first_audio_ms = None
    chunks = data_bytes = 0
    rate = channels = 0
    with SpeechClient(args.target, args.timeout, from_args(args)) as client, open(args.output, "wb") as out:
        for reply in client.synthesize(args.text, args.voice, args.sample_rate, framing):
            if first_audio_ms is None:
                first_audio_ms = (time.perf_counter() - started) * 1000
                if not args.json:
                    print(f"first audio after {first_audio_ms:.0f} ms", file=sys.stderr)
            out.write(reply.audio)
            chunks += 1
            rate, channels = reply.sample_rate, reply.channels
            data_bytes += len(reply.audio)
            if not args.json:
                print(f"  chunk {reply.chunk_index}: {reply.text!r}", file=sys.stderr)
        if wav and data_bytes >= 44:  # the streamed header has unknown sizes: write the real ones
            data_bytes -= 44
            out.seek(4)
            out.write(struct.pack("<I", 36 + data_bytes))
            out.seek(40)
            out.write(struct.pack("<I", data_bytes))
    if not chunks:
        raise CliError("the server sent no audio")
    seconds = data_bytes / (2 * channels * rate)
    if args.json:
        print(json.dumps({"output": str(args.output), "sample_rate": rate, "channels": channels,
                          "seconds": round(seconds, 3), "first_audio_ms": round(first_audio_ms or 0, 1),
                          "chunks": chunks}))
    else:
        print(f"wrote {args.output}: {seconds:.2f} s at {rate} Hz in {chunks} chunks", file=sys.stderr)


def _audio_chunks(path: Path, chunk_ms: int, realtime: bool) -> tuple[int, Iterator[bytes]]:
    audio = read_wav(path)
    if audio.sample_rate not in SERVER_RATES:
        audio = audio.at_rate(16000)
    samples_bytes, rate = audio.samples.tobytes(), audio.sample_rate
    if chunk_ms <= 0:
        raise CliError(f"--chunk-ms must be positive, got {chunk_ms}")
    step = rate * chunk_ms // 1000 * 2

    def chunks() -> Iterator[bytes]:
        started = time.perf_counter()
        for n, offset in enumerate(range(0, len(samples_bytes), step)):
            if realtime:
                time.sleep(max(0.0, started + n * chunk_ms / 1000 - time.perf_counter()))
            yield samples_bytes[offset:offset + step]

    return rate, chunks()


def cmd_transcribe(args: argparse.Namespace) -> None:
    rate, chunks = _audio_chunks(args.input, args.chunk_ms, args.realtime)
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
