"""Every user mistake with every command ends in one line and a non-zero exit, never a traceback.

Each command (voices, synth, transcribe, health, talk, decode-video, loadtest, serve) runs as a real
`rtmedia` process with each class of mistake: a missing file, a file that is not what it should be,
an unreachable server, a TLS mismatch (TLS against this plaintext server, a missing CA file), bad
option values, and the server's refusals. The one line is `rtmedia COMMAND: PROBLEM` on stderr; a
value argparse refuses keeps argparse's own form, its usage and then one `rtmedia COMMAND: error:`
line. The processes run a few at a time, all at once for the module.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from rtmedia.clients.audio_file import write_audio
from rtmedia.clients.commands import cli as client_cli

from tests.support.audio_files import video_only

RTMEDIA = str(Path(sys.executable).with_name("rtmedia"))
NETWORK = ("voices", "synth", "transcribe", "health", "talk", "decode-video", "loadtest")


@dataclass(frozen=True)
class Case:
    kind: str  # the class of mistake
    argv: tuple[str, ...]
    expect: str  # what the line must say
    env: tuple[tuple[str, str], ...] = ()  # environment variables it runs with

    @property
    def command(self) -> str:
        return self.argv[0]


@dataclass(frozen=True)
class Outcome:
    code: int
    stdout: str
    stderr: str


def cases(root: Path, target: str) -> list[Case]:
    tone = (np.sin(np.arange(16000) * 2 * np.pi * 300 / 16000) * 8000).astype(np.int16)
    write_audio(root / "speech.wav", tone.tobytes(), 16000)
    (root / "clips").mkdir()
    write_audio(root / "clips" / "tone.wav", tone.tobytes(), 16000)
    (root / "notes").mkdir()
    (root / "notes.txt").write_text("shopping list: milk, bread\n")
    (root / "notes" / "notes.txt").write_text("shopping list: milk, bread\n")
    (root / "video.mp4").write_bytes(video_only())
    (root / "empty.wav").write_bytes(b"")
    np.save(root / "latent.npy", np.zeros((16, 1, 4, 4), np.float32))
    np.save(root / "latent3.npy", np.zeros((3, 1, 4, 4), np.float32))
    wav, npy, clips = str(root / "speech.wav"), str(root / "latent.npy"), str(root / "clips")
    here = ("--target", target)
    valid = {  # each command, ready to work but for the mistake added to it
        "voices": ("voices",), "synth": ("synth", "Hello.", "-o", str(root / "out.wav")),
        "transcribe": ("transcribe", wav), "health": ("health",), "talk": ("talk", wav),
        "decode-video": ("decode-video", npy, "-o", str(root / "out.mp4")),
        "loadtest": ("loadtest", "--audio", clips, "--sessions", "1", "--duration", "2", "--connect-timeout", "3"),
    }
    out: list[Case] = []
    for name in NETWORK:
        out += [
            Case("unreachable", (*valid[name], "--target", "127.0.0.1:1"), "Connection refused"),
            Case("tls", (*valid[name], *here, "--tls"), "andshake failed"),
            Case("tls", (*valid[name], *here, "--ca", str(root / "missing-ca.pem")),
                 f"cannot read --ca {root / 'missing-ca.pem'}: No such file or directory"),
        ]
    missing = str(root / "missing.wav")
    out += [
        Case("missing", ("transcribe", missing, *here), f"{missing}: no such file"),
        Case("missing", ("talk", missing, *here), f"{missing}: no such file"),
        Case("missing", ("talk", wav, "--tools", str(root / "tools.py"), *here), "tools.py: no such file"),
        Case("missing", ("synth", "Hello.", "-o", str(root / "nowhere" / "x.wav"), *here), "no such directory"),
        Case("missing", ("talk", wav, "-o", str(root / "nowhere" / "x.mp3"), *here), "no such directory"),
        Case("missing", ("loadtest", "--audio", str(root / "nowhere"), *here), "nowhere: not a directory"),
        Case("missing", ("decode-video", str(root / "missing.npy"), "-o", "x.mp4", *here), "missing.npy: no such file"),
        Case("missing", ("serve", "--config", str(root / "missing.yaml")), "No such file or directory"),
        Case("missing", ("serve", "--port", "0", "--metrics-port", "0", "--tls-cert", str(root / "c.pem"), "--tls-key",
                         str(root / "k.pem")), "c.pem: No such file or directory"),
        Case("not audio", ("transcribe", str(root / "notes.txt"), *here), "notes.txt: not an audio file"),
        Case("not audio", ("transcribe", str(root / "video.mp4"), *here), "no audio stream; its streams: video"),
        Case("not audio", ("transcribe", str(root / "empty.wav"), *here), "empty.wav: the file is empty"),
        Case("not audio", ("transcribe", str(root), *here), "is a directory"),
        Case("not audio", ("transcribe", "-", "--rate", "16000", *here), "standard input is empty"),
        Case("not audio", ("talk", str(root / "notes.txt"), *here), "notes.txt: not an audio file"),
        Case("not audio", ("loadtest", "--audio", str(root / "notes"), *here), "no audio files in it; not audio: notes.txt"),
        Case("not audio", ("decode-video", str(root / "notes.txt"), "-o", "x.mp4", *here), "not a .npy latent file"),
        Case("not audio", ("synth", "Hello.", "-o", str(root / "out.txt"), *here), "cannot tell the audio format"),
        Case("not audio", ("talk", wav, "-o", str(root / "reply.doc"), *here), "cannot tell the audio format"),
        Case("bad value", ("voices", "--timeout", "0", *here), "argument --timeout: expected a positive number"),
        Case("bad value", ("synth", "Hello.", "-o", "x.wav", "--sample-rate", "-5"), "expected an integer of 0 or more"),
        Case("bad value", ("synth", "Hello.", "-o", "x.wav", "--format", "aiff"), "argument --format: invalid choice"),
        Case("bad value", ("transcribe", wav, "--chunk-ms", "0"), "argument --chunk-ms: expected a positive integer"),
        Case("bad value", ("transcribe", "-", "--rate", "fast"), "argument --rate: expected a positive integer"),
        Case("bad value", ("health", "--timeout", "-1"), "argument --timeout: expected a positive number"),
        Case("bad value", ("talk", wav, "--chunk-ms", "5000", *here), "--chunk-ms must be 1..1000, got 5000"),
        Case("bad value", ("talk", wav, "--mode", "telepathy"), "argument --mode: invalid choice"),
        Case("bad value", ("talk", wav, "--output-rate", "0"), "argument --output-rate: expected a positive integer"),
        Case("bad value", ("talk", wav, "--eagerness", "high", *here), "--eagerness is for --mode semantic_vad"),
        Case("bad value", ("decode-video", npy, "-o", "x.mp4", "--fps", "0"), "argument --fps: expected a positive"),
        Case("bad value", ("decode-video", npy, *here), "say where to write"),
        Case("bad value", ("loadtest", "--sessions", "0", *here), "--sessions must be at least 1, got 0"),
        Case("bad value", ("loadtest", "--chunk-ms", "5", *here), "--chunk-ms must be 10..1000, got 5"),
        Case("bad value", ("serve", "--port", "abc"), "argument --port: invalid int value: 'abc'"),
        Case("bad value", ("serve", "--otel-endpoint", "collector:4318"), "must be an http:// or https:// URL"),
        Case("bad value", ("serve", "--otel-endpoint", "http://127.0.0.1:4318"), "'http/json' is not supported",
             env=(("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),)),
        Case("refusal", ("synth", "Hello.", "-o", str(root / "out.wav"), "--voice", "nobody", *here), "UNKNOWN_VOICE"),
        Case("refusal", ("synth", "word " * 2000, "-o", str(root / "out.wav"), *here), "TEXT_TOO_LONG"),
        Case("refusal", ("synth", "", "-o", str(root / "out.wav"), *here), "EMPTY_TEXT"),
        Case("refusal", ("talk", wav, "--voice", "nobody", *here), "the server rejected the session config"),
        Case("refusal", ("health", "--service", "no.such.Service", *here), "the server has no service"),
        Case("refusal", ("decode-video", str(root / "latent3.npy"), "-o", str(root / "o.mp4"), *here),
             "BAD_LATENT_CHANNELS"),
    ]
    return out


async def _run(argv: tuple[str, ...], gate: asyncio.Semaphore, env: dict[str, str] | None = None) -> Outcome:
    async with gate:
        proc = await asyncio.create_subprocess_exec(
            RTMEDIA, *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})})
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Outcome(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


@pytest.fixture(scope="module")
async def outcomes(server, tmp_path_factory) -> list[tuple[Case, Outcome]]:
    all_cases = cases(tmp_path_factory.mktemp("mistakes"), f"127.0.0.1:{server.port}")
    gate = asyncio.Semaphore(4)
    results = await asyncio.gather(*(_run(case.argv, gate, dict(case.env)) for case in all_cases))
    return list(zip(all_cases, results, strict=True))


def problem(case: Case, outcome: Outcome) -> str | None:
    """What is wrong with how the mistake was reported, or None."""
    if "Traceback" in outcome.stdout + outcome.stderr:
        return "a traceback"
    if outcome.code == 0:
        return "exit status 0"
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    if lines and lines[0].startswith("usage: "):  # argparse's form: the usage, then its one error line
        usage, lines = lines[:-1], lines[-1:]
        if any(not (line.startswith("usage: ") or line.startswith(" ")) for line in usage):
            return f"more than argparse's usage before the error: {usage}"
        prefix = f"rtmedia {case.command}: error: "
    else:
        prefix = f"rtmedia {case.command}: "
    if len(lines) != 1:
        return f"{len(lines)} lines on stderr: {lines}"
    if not lines[0].startswith(prefix) or case.expect not in lines[0]:
        return f"the line does not say {case.expect!r}: {lines[0]!r}"
    return None


@pytest.mark.parametrize("kind", ["missing", "not audio", "unreachable", "tls", "bad value", "refusal"])
def test_each_mistake_is_one_line(outcomes, kind):
    mine = [(case, outcome) for case, outcome in outcomes if case.kind == kind]
    assert mine
    wrong = {" ".join(case.argv)[:160]: why for case, outcome in mine if (why := problem(case, outcome))}
    assert wrong == {}


def test_every_command_meets_every_network_mistake(outcomes):
    for kind in ("unreachable", "tls"):
        assert {case.command for case, _ in outcomes if case.kind == kind} == set(NETWORK)
    commands = {case.command for case, _ in outcomes}
    assert commands == {*NETWORK, "serve"}


async def test_debug_shows_the_traceback(tmp_path):
    (tmp_path / "notes.txt").write_text("not audio\n")
    gate = asyncio.Semaphore(2)
    flag, env = await asyncio.gather(
        _run(("transcribe", str(tmp_path / "notes.txt"), "--debug"), gate),
        _run(("transcribe", str(tmp_path / "notes.txt")), gate, env={"RTMEDIA_DEBUG": "1"}))
    for outcome in (flag, env):
        assert outcome.code == 1 and "Traceback (most recent call last)" in outcome.stderr
        assert "AudioFileError" in outcome.stderr
        assert outcome.stderr.strip().splitlines()[-1].startswith("rtmedia transcribe: ")


def _args(func) -> argparse.Namespace:
    return argparse.Namespace(command="voices", func=func)


def test_an_unexpected_error_is_one_line_too(capsys):
    def broken(args: argparse.Namespace) -> None:
        raise RuntimeError("the flux capacitor\nis out of flux")

    assert client_cli.run(_args(broken)) == 1
    captured = capsys.readouterr()
    assert captured.err == ("rtmedia voices: internal error: RuntimeError: the flux capacitor is out of flux "
                            "(run with --debug for the traceback)\n")
    args = _args(broken)
    args.debug = True
    assert client_cli.run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("RuntimeError: the flux capacitor is out of flux\n")


def test_ctrl_c_is_one_line_and_130(capsys):
    def interrupted(args: argparse.Namespace) -> None:
        raise KeyboardInterrupt

    assert client_cli.run(_args(interrupted)) == 130
    assert capsys.readouterr().err == "rtmedia voices: interrupted\n"
