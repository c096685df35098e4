"""The audio commands on any audio file, as a user runs them: real `rtmedia` processes against the
module's in-process server. One spoken recording (Piper) is converted by PyAV into every container
and codec and transcribed with the same words as its WAV; `synth -o` writes every extension and
the file decodes back at the right rate and length; `synth -o -` pipes into `transcribe -`; `talk`
takes an Ogg Opus recording and writes its reply as MP3."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from pathlib import Path

import av
import pytest

from tests.support.audio_files import KINDS, encode, recording
from tests.support.speech import normalise, wer

RTMEDIA = str(Path(sys.executable).with_name("rtmedia"))
SENTENCE = "Please remember to buy milk and bread on your way home."
VOICE_RATE = 22050  # the embedded Piper voice's own rate
PARALLEL = asyncio.Semaphore(4)


async def rtmedia(*args: str, stdin: bytes | None = None) -> tuple[int, bytes, str]:
    """`rtmedia ARGS` as a process (the server runs on this loop, so never block it)."""
    async with PARALLEL:
        proc = await asyncio.create_subprocess_exec(
            RTMEDIA, *args, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(stdin), 120)
    assert proc.returncode is not None
    return proc.returncode, out, err.decode()


async def shell(line: str) -> tuple[int, bytes, str]:
    async with PARALLEL:
        proc = await asyncio.create_subprocess_shell(
            f"set -o pipefail; {line}", executable="/bin/bash", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out, err.decode()


def transcript(stdout: bytes) -> str:
    """The text of `transcribe --json`'s last ("done") line."""
    done = json.loads(stdout.decode().splitlines()[-1])
    assert done["type"] == "done"
    return str(done["text"])


def probe(path: Path) -> tuple[str, int, float]:
    """(codec, rate, seconds) of a file, decoded by PyAV itself."""
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return stream.codec_context.name, stream.rate, samples / stream.rate


@pytest.fixture(scope="module")
def files(speaker, tmp_path_factory) -> dict[str, Path]:
    """The recording as each kind of file: mono at 16 kHz, and a stereo 44.1 kHz MP3 and FLAC. (LAME's
    default for 16 kHz mono is a 24 kbit/s MP3, which the recogniser mishears: 64 kbit/s is asked for.)"""
    folder = tmp_path_factory.mktemp("spoken")
    spoken16, spoken44 = recording(speaker, [SENTENCE], rate=16000), recording(speaker, [SENTENCE], rate=44100)
    paths = {}
    for kind in KINDS:
        paths[kind] = folder / f"spoken.{kind}"
        paths[kind].write_bytes(encode(spoken16.samples, 16000, kind, bit_rate=64_000 if kind == "mp3" else None))
    for kind in ("mp3", "flac"):
        paths[f"{kind}-stereo-44k"] = folder / f"spoken-stereo-44k.{kind}"
        paths[f"{kind}-stereo-44k"].write_bytes(spoken44.file(kind, channels=2))
    return paths


async def test_every_container_is_transcribed_with_the_wav_words(server, files):
    target = ("--target", f"127.0.0.1:{server.port}")
    runs = await asyncio.gather(*(rtmedia("transcribe", str(path), "--json", *target) for path in files.values()))
    texts = {}
    for name, (code, out, err) in zip(files, runs, strict=True):
        assert code == 0, (name, err)
        texts[name] = normalise(transcript(out))
    assert wer(SENTENCE, texts["wav"]) <= 0.2, texts["wav"]
    assert {name: text for name, text in texts.items() if text != texts["wav"]} == {}, texts["wav"]
    code, out, err = await rtmedia("transcribe", "-", "--json", *target, stdin=files["m4a"].read_bytes())
    assert code == 0 and normalise(transcript(out)) == texts["wav"], err


async def test_synth_writes_every_extension(server, tmp_path):
    target = ("--target", f"127.0.0.1:{server.port}")
    outputs = {ext: tmp_path / f"hello.{ext}" for ext in ("wav", "mp3", "ogg", "opus", "flac", "m4a")}
    jobs = [rtmedia("synth", SENTENCE, "-o", str(path), "--json", *target) for path in outputs.values()]
    jobs.append(rtmedia("synth", SENTENCE, "-o", str(tmp_path / "hello.audio"), "--format", "mp3",
                        "--sample-rate", "16000", "--json", *target))
    runs = await asyncio.gather(*jobs)
    for code, _, err in runs:
        assert code == 0 and not err.strip(), err
    reports = [json.loads(out) for _, out, _ in runs]
    expected = {"wav": "pcm_s16le", "mp3": "mp3float", "ogg": "opus", "opus": "opus", "flac": "flac", "m4a": "aac"}
    for (ext, path), report in zip(outputs.items(), reports, strict=False):
        codec, rate, length = probe(path)
        assert codec == expected[ext] and rate == report["sample_rate"] == (48000 if codec == "opus" else VOICE_RATE)
        # the speech written (the server's voice varies a little run to run), within the codec's padding
        seconds = report["seconds"]
        assert report["format"] == ext and 2 < seconds < 5
        assert seconds - 0.01 <= length <= seconds + 0.12, (ext, length, seconds)
    codec, rate, length = probe(tmp_path / "hello.audio")
    assert (codec, rate, reports[-1]["sample_rate"]) == ("mp3float", 16000, 16000)
    assert reports[-1]["seconds"] - 0.01 <= length <= reports[-1]["seconds"] + 0.15


async def test_pipes(server, tmp_path):
    """synth -o - | transcribe - --rate, and a coded stream through a pipe; stdout holds only audio."""
    target = f"--target 127.0.0.1:{server.port}"
    synth = f"{shlex.quote(RTMEDIA)} synth {shlex.quote(SENTENCE)} {target}"
    transcribe = f"{shlex.quote(RTMEDIA)} transcribe - --json {target}"
    raw, coded, pcm = await asyncio.gather(
        shell(f"{synth} -o - | {transcribe} --rate {VOICE_RATE}"),
        shell(f"{synth} -o - --format mp3 | {transcribe}"),
        rtmedia("synth", SENTENCE, "-o", "-", "--json", *target.split()))
    for code, out, err in (raw, coded):
        assert code == 0, err
        # raw PCM starts with the first word at its first sample, which the endpointer may clip; the
        # seam after the first chunk's three words may cost a word (BENCHMARKS.md: first chunk)
        assert wer(SENTENCE, transcript(out)) <= 0.3, transcript(out)
    code, out, err = pcm
    assert code == 0 and len(out) % 2 == 0
    report = json.loads(err.strip().splitlines()[-1])  # --json goes to stderr when stdout is the audio
    assert report["seconds"] == pytest.approx(len(out) / 2 / VOICE_RATE, abs=0.001)


async def test_talk_takes_any_file_and_writes_any_format(server, files, tmp_path):
    reply = tmp_path / "reply.mp3"
    code, out, err = await rtmedia("talk", str(files["opus"]), "-o", str(reply), "--json", "--target",
                                   f"127.0.0.1:{server.port}")
    assert code == 0, err
    summary = json.loads(out.decode().splitlines()[-1])
    assert wer(SENTENCE, " ".join(summary["transcripts"])) <= 0.2 and summary["output"] == str(reply)
    codec, rate, seconds = probe(reply)
    assert (codec, rate) == ("mp3float", summary["reply_sample_rate"])
    assert abs(seconds - summary["reply_audio_s"]) < 0.12
