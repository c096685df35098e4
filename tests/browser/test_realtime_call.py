"""OpenAI's Realtime API over WebRTC from real headless Chromium: a page that follows OpenAI's
documented browser example (an ephemeral key from `/v1/realtime/client_secrets`, an SDP offer
posted to `/v1/realtime/calls`, the `oai-events` data channel, the microphone on a track)
against `rtmedia serve --web` with tokens on, a fake microphone playing a WAV, and a reply
heard on the remote track; a control socket attached to the call sees the same events."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest

from tests.browser.conftest import launch
from tests.support.speech import wer, write_wav
from tests.support.webrtc import serve_with_web

pytestmark = pytest.mark.e2e
RATE = 48000
SENTENCE = "Please tell me about the weather today."
TOKEN = "realtime-call-test-token-0123456789"

# OpenAI's browser example (developers.openai.com, "Realtime API with WebRTC"), with the base URL
# and the key the test gives it.
PAGE = """<!doctype html><html><body><script>
window.events = [];
window.start = async (base, key) => {
  const pc = new RTCPeerConnection();
  window.pc = pc;
  const audioEl = document.createElement("audio");
  audioEl.autoplay = true;
  pc.ontrack = (e) => (audioEl.srcObject = e.streams[0]);
  const ms = await navigator.mediaDevices.getUserMedia({ audio: true });
  pc.addTrack(ms.getTracks()[0]);
  const dc = pc.createDataChannel("oai-events");
  window.dc = dc;
  dc.addEventListener("message", (e) => window.events.push(JSON.parse(e.data)));
  dc.addEventListener("open", () => dc.send(JSON.stringify({ type: "session.update", session: {
    type: "realtime", instructions: "Be brief.",
    audio: { input: { transcription: { model: "gpt-4o-transcribe" } } } } })));
  const offer = await pc.createOffer();
  await pc.setLocalDescription(offer);
  const sdpResponse = await fetch(`${base}/v1/realtime/calls`, {
    method: "POST", body: offer.sdp,
    headers: { Authorization: `Bearer ${key}`, "Content-Type": "application/sdp" },
  });
  window.location_header = sdpResponse.headers.get("Location");
  await pc.setRemoteDescription({ type: "answer", sdp: await sdpResponse.text() });
};
window.inbound = async () => {
  for (const s of (await window.pc.getStats()).values())
    if (s.type === "inbound-rtp" && s.kind === "audio") return s.totalAudioEnergy || 0;
  return 0;
};
</script></body></html>"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("realtime-call")
    tokens = directory / "tokens"
    tokens.write_text(f"{TOKEN} app\n")
    with serve_with_web(directory, "--auth-tokens", str(tokens)) as info:
        yield info


@pytest.fixture(scope="module")
def microphone_wav(tmp_path_factory, speaker):
    parts = [speaker.silence(3.0, RATE), speaker.say(SENTENCE, RATE), speaker.silence(8.0, RATE)]
    return write_wav(tmp_path_factory.mktemp("mic") / "microphone.wav", RATE, np.concatenate(parts) * 0.3)


async def wait_event(page, kind: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await page.evaluate("(k) => window.events.filter(e => e.type === k)", kind)
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {kind} within {timeout} s; the page got "
                         f"{await page.evaluate('() => window.events.map(e => e.type)')}")


@pytest.mark.serial  # what the recogniser hears rides on Chromium's real-time audio
async def test_a_browser_call_is_answered_and_heard(served, chromium, microphone_wav):
    from playwright.async_api import async_playwright

    base = served["url"]
    async with aiohttp.ClientSession() as http:
        # The application's server asks for a key for its browser (with its real token).
        async with http.post(f"{base}/v1/realtime/client_secrets", headers={"Authorization": f"Bearer {TOKEN}"},
                             json={"session": {"type": "realtime", "model": "gpt-realtime"}}) as answer:
            assert answer.status == 200, await answer.text()
            secret = await answer.json()
        assert secret["value"].startswith("ek_") and secret["expires_at"] > time.time()
        async with http.post(f"{base}/v1/realtime/calls", data="v=0", headers={
                "Authorization": "Bearer wrong-key-0123456789abcdef", "Content-Type": "application/sdp"}) as refused:
            assert refused.status == 401 and (await refused.json())["error"]["code"] == "invalid_api_key"

    async with async_playwright() as p:
        browser = await launch(p, chromium, microphone_wav)
        try:
            page = await browser.new_page()
            # The example page, served from the web front's own origin (as an app would serve it).
            await page.route(f"{base}/example", lambda route: route.fulfill(body=PAGE, content_type="text/html"))
            await page.goto(f"{base}/example")
            await page.evaluate("([b, k]) => window.start(b, k)", [base, secret["value"]])
            location = await page.evaluate("() => window.location_header")
            assert location.startswith("/v1/realtime/calls/rtc_")
            call_id = location.rsplit("/", 1)[1]
            await wait_event(page, "session.created", 15)
            await wait_event(page, "session.updated", 15)

            # The application's server attaches a control socket to the call.
            async with aiohttp.ClientSession() as http, http.ws_connect(
                    f"{base.replace('http', 'ws')}/v1/realtime?call_id={call_id}",
                    headers={"Authorization": f"Bearer {TOKEN}"}) as control:
                heard = await wait_event(page, "conversation.item.input_audio_transcription.completed", 30)
                assert wer(SENTENCE, heard["transcript"]) <= 0.5, heard
                done = await wait_event(page, "response.done", 30)
                assert done["response"]["status"] == "completed", done
                await wait_event(page, "output_audio_buffer.started", 5)
                await wait_event(page, "output_audio_buffer.stopped", 15)
                assert await page.evaluate("() => window.inbound()") > 0.001  # the reply was heard
                assert not await page.evaluate(
                    "() => window.events.filter(e => e.type === 'response.output_audio.delta').length")
                seen = []
                with pytest.raises(asyncio.TimeoutError):
                    while True:
                        seen.append(json.loads((await control.receive(timeout=2)).data)["type"])
                assert "response.done" in seen or "output_audio_buffer.stopped" in seen, seen
                await control.send_str(json.dumps({"type": "conversation.item.retrieve", "item_id": heard["item_id"]}))
                retrieved = await wait_event(page, "conversation.item.retrieved", 10)
                assert retrieved["item"]["id"] == heard["item_id"]

            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/realtime/calls/{call_id}/hangup",
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as hung:
                    assert hung.status == 200
                async with http.post(f"{base}/v1/realtime/calls/{call_id}/hangup",
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as again:
                    assert again.status == 404
        finally:
            await browser.close()
