"""The browser page in real headless Chromium (Debian's `chromium`, driven by Playwright),
talking to `rtmedia serve --web` with a fake microphone that plays a synthesised WAV."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from tests.browser.conftest import launch
from tests.support.speech import wer, write_wav
from tests.support.webrtc import serve_with_web

pytestmark = pytest.mark.e2e
ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
RATE = 48000
SENTENCE = "Please tell me about the weather today."
INTERRUPTION = "Stop, that is enough."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_with_web(tmp_path_factory.mktemp("browser")) as info:
        yield info


@pytest.fixture(scope="module")
def microphone_wav(tmp_path_factory, speaker) -> tuple[Path, float]:
    """What the fake microphone says (Chromium loops it from when the page takes the microphone,
    so it starts with time to connect): a sentence that gets a full reply,
    the sentence again, and an interruption 1.3 s after it, while the second reply plays."""
    def silence(s: float) -> np.ndarray:
        return speaker.silence(s, RATE)

    parts = [silence(3.0), speaker.say(SENTENCE, RATE), silence(4.5), speaker.say(SENTENCE, RATE), silence(1.3),
             speaker.say(INTERRUPTION, RATE), silence(6.0)]
    # At a microphone's level (peaks near -12 dBFS): the page's automatic gain control would push
    # full-scale speech into clipping.
    path = write_wav(tmp_path_factory.mktemp("mic") / "microphone.wav", RATE, np.concatenate(parts) * 0.3)
    return path, sum(map(len, parts)) / RATE


async def events(page, kind: str) -> list[dict]:
    return await page.evaluate("(k) => window.rtmedia.events.filter(e => e.type === k)", kind)


async def wait_event(page, kind: str, timeout: float, count: int = 1) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await events(page, kind)
        if len(found) >= count:
            return found[count - 1]
        await asyncio.sleep(0.1)
    types = await page.evaluate("() => window.rtmedia.events.map(e => e.type)")
    raise AssertionError(f"no {kind} (#{count}) within {timeout} s; the page got {types}")


async def inbound_audio(page, wait_s: float = 5.0) -> dict:
    """The page's inbound-rtp audio statistics. Chromium makes that entry only once the first
    packets arrive: before then it counts as nothing received (after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        stats = await page.evaluate("() => window.rtmedia.inboundAudio()")
        if stats is not None or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    return stats or {"bytesReceived": 0, "packetsReceived": 0, "audioLevel": 0, "totalAudioEnergy": 0}


@pytest.mark.serial
async def test_page_talks_and_barges_in(served, chromium, microphone_wav):
    from playwright.async_api import async_playwright

    wav, wav_s = microphone_wav
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        browser = await launch(p, chromium, wav)
        try:
            page = await browser.new_page()
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            await page.goto(served["url"] + "?processing=off")
            assert await page.get_attribute("body", "data-state") == "idle"
            await page.click("[data-testid=start]")
            await page.wait_for_selector("body[data-state=connected]", timeout=15000)
            stats0 = await inbound_audio(page, wait_s=0)

            # The first turn: the user's words in the transcript, the reply's text and audio.
            done = await wait_event(page, "response.done", timeout=wav_s + 10)
            assert done["status"] == "completed", done
            users = [e["transcript"] for e in await events(page, "conversation.item.input_audio_transcription.completed")]
            assert len(users) == 1 and wer(SENTENCE, users[0]) <= 0.34, users
            user = users[0]
            shown_user = await page.inner_text("#transcript li.user")
            assert shown_user == user
            reply = await wait_event(page, "response.output_text.done", timeout=2)
            assert reply["text"].lower().startswith("you said")
            assert await page.inner_text("#transcript li.assistant") == reply["text"]
            await wait_event(page, "playback.acknowledged", timeout=5)
            await asyncio.sleep(1.0)
            stats1 = await inbound_audio(page)
            assert stats1["bytesReceived"] > stats0["bytesReceived"] + 5000, (stats0, stats1)
            assert stats1["totalAudioEnergy"] > stats0["totalAudioEnergy"], (stats0, stats1)
            latency = await page.inner_text("[data-testid=latency]")
            assert latency.endswith(" ms"), latency

            # Barge-in: the interruption clears the second reply's playback at once.
            cleared = await wait_event(page, "output_audio_buffer.cleared", timeout=wav_s)
            report = await wait_event(page, "bridge.playback.cleared", timeout=2)
            assert report["response_id"] == cleared["response_id"] and report["dropped_ms"] > 0, report
            await asyncio.sleep(0.25)  # the browser's own jitter buffer still holds a few frames
            before = await page.evaluate("() => window.rtmedia.inboundAudio()")
            await asyncio.sleep(0.4)
            after = await page.evaluate("() => window.rtmedia.inboundAudio()")
            # Silence after the clear: under a tenth of the energy the first reply had per 0.4 s.
            first = [d for d in await events(page, "response.output_audio.delta") if d["response_id"] == done["response_id"]]
            reply_s = sum(d["audio_bytes"] for d in first) / 2 / 48000
            per_s = (stats1["totalAudioEnergy"] - stats0["totalAudioEnergy"]) / reply_s
            assert after["totalAudioEnergy"] - before["totalAudioEnergy"] < 0.1 * per_s * 0.4, (before, after, per_s)
            cancelled = [e for e in await events(page, "response.done") if e["response_id"] == cleared["response_id"]]
            assert cancelled and cancelled[0]["status"] == "cancelled"
            assert await page.locator("#transcript li.assistant.cut").count() >= 1
            await page.screenshot(path=str(ARTIFACTS / "web-page.png"), full_page=True)

            await page.click("[data-testid=stop]")
            await page.wait_for_selector("body[data-state=closed]", timeout=5000)
            assert not [line for line in console if line.startswith("error")], console
        finally:
            await browser.close()

