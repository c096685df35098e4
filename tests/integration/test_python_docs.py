"""Every example of docs/python.md, run as its own Python process against a real server (the
module's in-process one, reached through RTMEDIA_TARGET), in a folder holding the recordings
the examples read."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import av
import pytest

from tests.support.audio_files import encode
from tests.support.speech import wer

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"
EXAMPLES = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)
QUESTION = "what is the weather like today"
RECORDING = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def folder(tmp_path_factory, speaker):
    where = tmp_path_factory.mktemp("examples")
    rate = 22050
    silence = speaker.silence(0.5, rate)
    import numpy as np

    (where / "question.wav").write_bytes(encode(np.concatenate([silence, speaker.say(QUESTION, rate), silence,
                                                                speaker.silence(1.0, rate)]), rate, "wav"))
    (where / "recording.mp3").write_bytes(encode(np.concatenate([silence, speaker.say(RECORDING, rate), silence]),
                                                 rate, "mp3", channels=2))
    return where


def test_the_doc_has_its_examples():
    assert len(EXAMPLES) >= 8


@pytest.mark.parametrize("n", range(len(EXAMPLES)))
async def test_example_runs(server, folder, n):
    script = folder / f"example_{n}.py"
    script.write_text(EXAMPLES[n])
    env = {**os.environ, "RTMEDIA_TARGET": f"127.0.0.1:{server.port}"}
    process = await asyncio.create_subprocess_exec(sys.executable, str(script), cwd=folder, env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 180)
    assert process.returncode == 0, f"example {n}:\n{EXAMPLES[n]}\n{err.decode()[-3000:]}"
    text = out.decode()
    if "answer.wav" in EXAMPLES[n]:
        assert "you said:" in text and wer(QUESTION, text.split("you said:")[1].splitlines()[0]) < 0.5
        with av.open(str(folder / "answer.wav")) as answer:
            assert answer.duration and answer.duration > 0.3 * av.time_base
    if "recording.mp3" in EXAMPLES[n]:
        assert wer(RECORDING, " ".join(line.split("] ", 1)[1] for line in text.splitlines() if "] " in line)) < 0.35
    if "hello.mp3" in EXAMPLES[n]:
        with av.open(str(folder / "hello.mp3")) as mp3:
            assert mp3.streams.audio[0].rate == 44100 and mp3.duration > av.time_base
    if "clip.mp4" in EXAMPLES[n]:
        with av.open(str(folder / "clip.mp4")) as mp4:
            assert sum(1 for _ in mp4.decode(video=0)) == 17
    if "UNSUPPORTED_SAMPLE_RATE" in EXAMPLES[n]:
        assert text.strip() == "INVALID_ARGUMENT UNSUPPORTED_SAMPLE_RATE"
    if "turn ended at" in EXAMPLES[n]:
        assert "turn ended at" in text and "reply:" in text
