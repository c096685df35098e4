"""`rtmedia talk --tools` against the real `rtmedia serve` process, its `openai` responder
pointed at a stand-in chat-completions server (the one fake): the model's call runs in the
command, its output goes back, and the spoken answer uses it."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.chat_upstream import Calls, ChatUpstream, tool_results
from tests.support.serve import FEW_SPEAKERS, RTMEDIA, free_port, running_server
from tests.support.speech import write_wav

pytestmark = pytest.mark.e2e
RATE = 16000
TOOLS = '''\
def get_weather(city: str, unit: str = "c") -> dict:
    """The weather in a city now."""
    return {"city": city, "temperature": 21, "unit": unit}


def _not_offered() -> None: ...
'''


def script(body: dict) -> list:
    results = tool_results(body)
    if results:
        return [f"It is {json.loads(results[0])['temperature']} degrees."]
    return ["Let me check. ", Calls([("get_weather", {"city": "Paris"})])]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    upstream = ChatUpstream(script)
    with upstream.in_thread(), running_server("--metrics-port", str(free_port()), "--no-llm", "--responder", "echo",
                                              "--openai-url", upstream.url, "--grace", "5",
                                              asr_decoders=FEW_SPEAKERS) as (target, _):
        yield target, upstream


@pytest.fixture(scope="module")
def files(tmp_path_factory, speaker):
    root = tmp_path_factory.mktemp("tools")
    (root / "tools.py").write_text(TOOLS)
    write_wav(root / "in.wav", RATE, speaker.silence(0.5, RATE), speaker.say("What is the weather in Paris?", RATE),
              speaker.silence(1.5, RATE))
    return root


def talk(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RTMEDIA, "talk", *args, "--target", target], capture_output=True, text=True, timeout=120)


def test_a_call_runs_in_the_command_and_the_answer_uses_its_output(served, files):
    target, upstream = served
    result = talk(target, str(files / "in.wav"), "--responder", "openai", "--tools", str(files / "tools.py"), "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    summary, events = lines[-1], lines[:-1]
    assert summary["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}',
                                      "output": '{"city": "Paris", "temperature": 21, "unit": "c"}'}]
    assert "It is 21 degrees." in summary["reply_text"]
    updated = next(e for e in events if e["type"] == "session.updated")
    assert [f["name"] for f in updated["session"]["tools"]["functions"]] == ["get_weather"], "public functions only"
    assert [e["type"] for e in events].count("response.function_call_arguments.delta") >= 1
    assert upstream.bodies[0]["tools"][0]["function"]["parameters"]["required"] == ["city"]


def test_the_human_output_prints_each_call_and_its_result(served, files):
    target, _ = served
    result = talk(target, str(files / "in.wav"), "--responder", "openai", "--tools", str(files / "tools.py"))
    assert result.returncode == 0, result.stderr
    assert 'call get_weather({"city": "Paris"})' in result.stdout
    assert '-> {"city": "Paris", "temperature": 21, "unit": "c"}' in result.stdout
    assert "rtmedia: It is 21 degrees." in result.stdout


def test_a_bad_tools_file_is_one_line(served, files, tmp_path):
    target, _ = served
    for path, part in ((tmp_path / "missing.py", "no such file"), (files / "in.wav", "")):
        result = talk(target, str(files / "in.wav"), "--tools", str(path))
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "--tools" in result.stderr and part in result.stderr
