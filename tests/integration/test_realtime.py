"""RealtimeService.Converse in-process with the real engines and the echo responder."""

from __future__ import annotations

import asyncio
import base64
import multiprocessing
import threading

import grpc
import numpy as np
import pytest
from rtmedia.protocol.errors import error_reason
from rtmedia.server.session.interruptions import Interruption, is_backchannel

from tests.support.converse import Conversation
from tests.support.speech import normalise, transcribe, wer
from tests.support.waits import until

# the server's own pool of fast-final decoders: test_32_concurrent_sessions ends many turns at once
SERVER_OPTIONS = {"asr_decoders": 10}
RATE = 24000
SENTENCE = "Please remember to buy milk and bread on your way home."
LONG = ("The weather today is sunny with a light breeze from the west, and tomorrow it will rain "
        "in the morning, then clear up in the afternoon.")


def utterance(speaker, text: str, rate: int = RATE, lead: float = 0.6, tail: float = 1.2):
    """PCM16 bytes: silence, speech, silence; and the speech's true bounds in ms."""
    speech = speaker.say(text, rate)
    voiced = np.flatnonzero(np.abs(speech) > 0.005 * 32768)
    start_ms = lead * 1000 + voiced[0] * 1000 / rate
    end_ms = lead * 1000 + (voiced[-1] + 1) * 1000 / rate
    pcm = np.concatenate([speaker.silence(lead, rate), speech, speaker.silence(tail, rate)]).tobytes()
    return pcm, start_ms, end_ms


def reply_audio(c: Conversation, response_id: str) -> tuple[bytes, int]:
    deltas = [e for e in c.of_type("response.output_audio.delta") if e["response_id"] == response_id]
    return b"".join(base64.b64decode(e["audio"]) for e in deltas), deltas[0]["sample_rate"]


async def test_server_vad_turn(channel, speaker):
    pcm, start_ms, end_ms = utterance(speaker, SENTENCE)
    async with Conversation(channel) as c:
        created = await c.wait_for("session.created")
        assert created["session"]["turn_detection"]["type"] == "server_vad"
        assert created["limits"]["inbox_ms"] == 2000
        await c.stream(pcm, RATE, speed=2.0)
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed"
        started = c.of_type("input_audio_buffer.speech_started")
        stopped = c.of_type("input_audio_buffer.speech_stopped")
        assert len(started) == len(stopped) == 1
        assert abs(started[0]["audio_start_ms"] - start_ms) <= 100, (started, start_ms)
        assert abs(stopped[0]["audio_end_ms"] - end_ms) <= 100, (stopped, end_ms)
        completed = c.of_type("conversation.item.input_audio_transcription.completed")[0]
        assert wer(SENTENCE, completed["transcript"]) < 0.4, completed["transcript"]
        deltas = c.of_type("conversation.item.input_audio_transcription.delta")
        partial = "".join(d["delta"] for d in deltas)
        assert partial and partial == " ".join(partial.split()), "deltas concatenate into words"
        order = c.types()
        for a, b in [("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"),
                     ("input_audio_buffer.speech_stopped", "input_audio_buffer.committed"),
                     ("input_audio_buffer.committed", "response.created"),
                     ("response.created", "response.output_audio.delta"),
                     ("response.output_audio.delta", "response.output_text.done"),
                     ("response.output_audio.done", "response.done")]:
            assert order.index(a) < order.index(b), (a, b, order)
        text = c.of_type("response.output_text.done")[0]["text"]
        assert text == f"You said: {completed['transcript']}"
        audio, rate = reply_audio(c, done["response_id"])
        assert all(e["channels"] == 1 and e["sample_rate"] == 22050 for e in c.of_type("response.output_audio.delta"))
        assert done["usage"]["output_audio_ms"] == pytest.approx(len(audio) / 2 / rate * 1000, abs=2)


@pytest.mark.parametrize("early", [True, False])
async def test_a_turns_final_is_ready_when_it_ends_and_pauses_join_segments(server, channel, speaker, monkeypatch,
                                                                           early):
    """A turn with a ~350 ms quiet inside (a pause, not its end): with early finals each run of
    speech is finished by the recogniser at its pause, before speech_stopped, and the turn's
    transcript joins the two; without them one utterance ends after speech_stopped. Either way
    the deltas concatenate into words and the word timings are in the session's input."""
    first, second = "Please call me back tomorrow afternoon.", "Thanks."
    pcm = np.concatenate([speaker.silence(0.6, RATE), speaker.say(first, RATE), speaker.silence(0.2, RATE),
                          speaker.say(second, RATE), speaker.silence(1.2, RATE)]).tobytes()
    monkeypatch.setattr(server.realtime.context.limits, "early_finals", early)
    scheduler, submit = server.scheduler, server.scheduler.submit
    log: list[tuple[str, bool]] = []  # ("asr..." lane, end) per recogniser submission; ("stopped", False)

    def spy(lane, item, *args, **kwargs):
        if lane.startswith("asr"):
            log.append((lane, item.end))
        return submit(lane, item, *args, **kwargs)

    monkeypatch.setattr(scheduler, "submit", spy)
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        session = list(server.realtime.sessions.values())[-1]  # this one: the newest
        on_stopped = session._on_speech_stopped
        monkeypatch.setattr(session, "_on_speech_stopped", lambda end_ms: (log.append(("stopped", False)),
                                                                           on_stopped(end_ms)))
        await c.stream(pcm, RATE, speed=2.0)
        await c.wait_for("response.done", timeout=20)
    assert len(c.of_type("input_audio_buffer.speech_stopped")) == 1
    ends = [lane for lane, end in log if end]
    stopped = log.index(("stopped", False))
    if early:
        assert len(ends) == 2 and log[stopped - 1][1], log  # the second end came just before speech_stopped
        assert not log[stopped + 1:], "nothing is left for the recogniser once the turn ends"
    else:
        assert len(ends) == 1 and log[-1][1] and stopped < len(log) - 1, log
    completed = c.of_type("conversation.item.input_audio_transcription.completed")[0]
    assert wer(f"{first} {second}", completed["transcript"]) < 0.4, completed["transcript"]
    partial = "".join(d["delta"] for d in c.of_type("conversation.item.input_audio_transcription.delta"))
    assert partial and partial == " ".join(partial.split()), "deltas concatenate into words"
    starts = [w["start_ms"] for w in completed["words"]]
    assert starts == sorted(starts) and 300 <= starts[0] and completed["words"][-1]["end_ms"] <= len(pcm) / 2 / RATE * 1000
    second_at = 600 + len(speaker.say(first, RATE)) * 1000 // RATE + 200
    assert completed["words"][-1]["word"] != "thanks" or completed["words"][-1]["start_ms"] > second_at - 100


async def test_reply_audio_speaks_the_users_words(channel, speaker):
    pcm, _, _ = utterance(speaker, SENTENCE)
    async with Conversation(channel) as c:
        c.send("session.update", session={"output_sample_rate": 24000})
        await c.stream(pcm, RATE, speed=2.0)
        done = await c.wait_for("response.done", timeout=20)
        audio, rate = reply_audio(c, done["response_id"])
        assert rate == 24000
    heard = normalise(await transcribe(channel, audio, rate)).split()
    words = normalise(SENTENCE).split()
    assert sum(w in heard for w in words) / len(words) >= 0.6, heard


async def test_manual_mode(channel, speaker):
    pcm, _, _ = utterance(speaker, SENTENCE, tail=0.3)
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"type": "manual"}})
        await c.wait_for("session.updated")
        await c.stream(pcm, RATE, speed=4.0)
        c.send("input_audio_buffer.commit")
        committed = await c.wait_for("input_audio_buffer.committed")
        assert committed["audio_ms"] == pytest.approx(len(pcm) / 2 / RATE * 1000, abs=25)
        completed = await c.wait_for("conversation.item.input_audio_transcription.completed")
        assert completed["item_id"] == committed["item_id"]
        assert not c.of_type("response.created"), "manual mode responds only on response.create"
        c.send("response.create")
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed"
        assert not c.of_type("input_audio_buffer.speech_started")
        assert wer(SENTENCE, completed["transcript"]) < 0.4


async def test_none_mode_uses_buffered_audio(channel, speaker):
    pcm, _, _ = utterance(speaker, SENTENCE, tail=0.3)
    async with Conversation(channel) as c:
        c.send("session.update", session={"turn_detection": {"type": "none"}})
        await c.stream(pcm, RATE, speed=4.0)
        await asyncio.sleep(0.3)
        assert not c.of_type("response.created") and not c.of_type("input_audio_buffer.speech_started")
        c.send("response.create")
        await c.wait_for("input_audio_buffer.committed")
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed"
        text = c.of_type("response.output_text.done")[0]["text"]
        transcript = c.of_type("conversation.item.input_audio_transcription.completed")[0]["transcript"]
        assert text == f"You said: {transcript}" and transcript


async def test_typed_text_turn(channel):
    async with Conversation(channel) as c:
        c.send("conversation.item.create", item={"role": "user", "text": "typed words travel too"})
        c.send("response.create")
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed"
        assert c.of_type("response.output_text.done")[0]["text"] == "You said: typed words travel too"
        assert c.of_type("response.output_audio.delta")


async def test_mu_law_input(channel, speaker):
    from rtmedia.engines.audio.resample import float_to_ulaw

    speech = np.concatenate([speaker.silence(0.6, 8000), speaker.say(SENTENCE, 8000), speaker.silence(1.2, 8000)])
    ulaw = float_to_ulaw(speech.astype(np.float32) / 32768)
    async with Conversation(channel) as c:
        c.send("session.update", session={"input_audio_format": {"encoding": "g711_ulaw", "sample_rate": 8000}})
        updated = await c.wait_for("session.updated")
        assert updated["session"]["input_audio_format"] == {"encoding": "g711_ulaw", "sample_rate": 8000,
                                                            "channels": 1}
        await c.stream(ulaw, 8000, speed=2.0, bytes_per_sample=1)
        done = await c.wait_for("response.done", timeout=20)
        assert done["status"] == "completed"
        started = c.of_type("input_audio_buffer.speech_started")[0]
        assert abs(started["audio_start_ms"] - 600) < 250


async def test_barge_in(channel, speaker):
    first, _, _ = utterance(speaker, LONG, tail=0.8)
    second, second_start_ms, _ = utterance(speaker, "Stop, please wait a moment.", lead=0.2, tail=1.2)
    async with Conversation(channel) as c:
        await c.stream(first, RATE, speed=2.0)
        await c.wait_for("response.output_audio.delta", timeout=20)
        await asyncio.sleep(0.3)
        response_id = c.of_type("response.created")[0]["response_id"]
        sent_at = await c.stream(second[: len(second) // 2], RATE)  # interrupt at real-time pace
        speech_sent = sent_at + second_start_ms / 1000
        cleared = await c.wait_for("output_audio_buffer.cleared", timeout=5)
        cancelled = await c.wait_for("response.done", response_id=response_id)
        assert cleared["response_id"] == response_id and cancelled["status"] == "cancelled"
        assert cleared["t"] - speech_sent < 0.8, cleared["t"] - speech_sent
        await c.stream(second[len(second) // 2:], RATE, speed=2.0)
        second_done = await c.wait_for("response.done", count=2, timeout=20)
        assert second_done["status"] == "completed" and second_done["response_id"] != response_id
        stale = [e for e in c.events if e.get("response_id") == response_id and e["t"] > cancelled["t"]]
        assert not stale, "nothing of the cancelled epoch is sent after the cancel"


def vowel(ms: int = 800, rate: int = RATE) -> np.ndarray:
    """A sung "aah" without words (a voiced sound the VAD hears and the recogniser writes nothing
    for): a pulse train at 120 Hz through the vowel's formants, as PCM16."""
    from scipy.signal import iirpeak, lfilter

    t = np.arange(rate * ms // 1000) / rate
    phase = np.cumsum(120 * (1 + 0.02 * np.sin(2 * np.pi * 5 * t))) / rate
    pulses = (np.diff(np.floor(phase), prepend=0) > 0).astype(float)
    sound = sum(lfilter(*iirpeak(f / (rate / 2), f / bw), pulses) for f, bw in ((730, 90), (1090, 110), (2440, 170)))
    sound *= np.minimum(1, t / 0.03) * np.minimum(1, (t[-1] - t) / 0.05)
    return (sound / np.abs(sound).max() * 0.4 * 32767).astype(np.int16)


async def confirmed_reply(c: Conversation, speaker) -> str:
    """A session in confirmed mode whose long reply is playing: its response id."""
    c.send("session.update", session={"turn_detection": {"type": "server_vad", "interruption": {"mode": "confirmed"}}})
    updated = await c.wait_for("session.updated")
    assert updated["session"]["turn_detection"]["interruption"]["mode"] == "confirmed"
    first, _, _ = utterance(speaker, LONG, tail=0.8)
    await c.stream(first, RATE, speed=2.0)
    created = await c.wait_for("response.created", timeout=20)
    await c.wait_for("response.output_audio.delta", timeout=20)
    await asyncio.sleep(0.3)
    return created["response_id"]


@pytest.mark.parametrize("said", ["Yeah, okay, sure.", "Okay, got it.", "vowel"])
async def test_a_backchannel_or_a_sound_pauses_the_reply_and_it_goes_on(channel, speaker, said):
    if said == "vowel":
        voice = np.concatenate([speaker.silence(0.2, RATE), vowel(), speaker.silence(1.2, RATE)]).tobytes()
    else:
        voice, _, _ = utterance(speaker, said, lead=0.2, tail=1.2)
    async with Conversation(channel) as c:
        response_id = await confirmed_reply(c, speaker)
        await c.stream(voice, RATE)
        tentative = await c.wait_for("input_audio_buffer.speech_tentative", timeout=5)
        heard = await c.wait_for("input_audio_buffer.backchannel", timeout=5)
        assert tentative["response_id"] == heard["response_id"] == response_id
        assert heard["item_id"] == tentative["item_id"] and heard["audio_start_ms"] == tentative["audio_start_ms"]
        # what it was heard as when judged: its words up to its first pause (the sung vowel: none, or a sound)
        words = normalise(heard["transcript"]).split()
        if said == "vowel":
            assert not words or is_backchannel(words, Interruption().phrases), heard
        else:
            assert words and set(words) <= set(normalise(said).split()), heard
        done = await c.wait_for("response.done", response_id=response_id, timeout=30)
        assert done["status"] == "completed"
        deltas = [e["t"] for e in c.of_type("response.output_audio.delta") if e["response_id"] == response_id]
        assert sum(tentative["t"] < t < heard["t"] for t in deltas) <= 1  # paused (one may have been on its way)
        assert any(t > heard["t"] for t in deltas)  # and went on
        await asyncio.sleep(1.0)
        # The voice was no turn: no speech_started of its own, nothing cleared, no reply to it.
        assert len(c.of_type("input_audio_buffer.speech_started")) == 1
        assert not c.of_type("output_audio_buffer.cleared") and len(c.of_type("response.created")) == 1
        assert not [e for e in c.events if e.get("item_id") == tentative["item_id"]
                    and e["type"] not in ("input_audio_buffer.speech_tentative", "input_audio_buffer.backchannel")]


@pytest.mark.parametrize("said", ["Wait, stop.", "Stop!"])
async def test_words_that_interrupt_cancel_the_reply_as_a_barge_in_would(channel, speaker, said):
    voice, _, _ = utterance(speaker, said, lead=0.2, tail=1.2)
    async with Conversation(channel) as c:
        response_id = await confirmed_reply(c, speaker)
        await c.stream(voice, RATE)
        tentative = await c.wait_for("input_audio_buffer.speech_tentative", timeout=5)
        started = await c.wait_for("input_audio_buffer.speech_started", count=2, timeout=5)
        assert (started["item_id"], started["audio_start_ms"]) == (tentative["item_id"], tentative["audio_start_ms"])
        cleared = await c.wait_for("output_audio_buffer.cleared", timeout=5)
        cancelled = await c.wait_for("response.done", response_id=response_id)
        assert cleared["response_id"] == response_id and cancelled["status"] == "cancelled"
        assert cleared["t"] - tentative["t"] < 1.5
        completed = await c.wait_for("conversation.item.input_audio_transcription.completed", count=2, timeout=10)
        assert completed["item_id"] == tentative["item_id"] and wer(said, completed["transcript"]) == 0
        answered = await c.wait_for("response.done", count=2, timeout=20)
        assert answered["status"] == "completed" and answered["response_id"] != response_id
        assert not c.of_type("input_audio_buffer.backchannel")
        order = [e["type"] for e in c.events if e.get("item_id") == tentative["item_id"]]
        assert order.index("input_audio_buffer.speech_started") < order.index("input_audio_buffer.speech_stopped") \
            < order.index("input_audio_buffer.committed")


async def test_history_truncated_by_playback_ack(server, channel, speaker):
    first, _, _ = utterance(speaker, LONG, tail=0.8)
    interrupt, _, _ = utterance(speaker, "Wait.", lead=0.2, tail=1.0)
    async with Conversation(channel) as c:
        await c.stream(first, RATE, speed=2.0)
        created = await c.wait_for("response.created", timeout=20)
        await c.wait_for("response.output_audio.delta", count=3, timeout=20)
        c.send("playback.ack", response_id=created["response_id"], played_ms=400)
        ack = await c.wait_for("playback.acknowledged")
        assert ack["played_ms"] == 400
        await c.stream(interrupt, RATE)
        await c.wait_for("output_audio_buffer.cleared", timeout=5)
        session = next(s for s in server.realtime.sessions.values() if created["response_id"] in s.replies.responses)
        said = next(m.text for m in session.history if m.role == "assistant")
        full = f"You said: {c.of_type('conversation.item.input_audio_transcription.completed')[0]['transcript']}"
        assert said and full.startswith(said) and len(said.split()) < len(full.split()), (said, full)
        assert len(said.split()) <= 4  # 400 ms of a clause-by-clause reply is a few words at most


async def test_history_truncated_by_item_truncate(server, channel):
    async with Conversation(channel) as c:
        c.send("conversation.item.create", item={"text": "one two three four five six seven eight nine ten"})
        c.send("response.create")
        created = await c.wait_for("response.created")
        await c.wait_for("response.done", timeout=20)
        session = next(s for s in server.realtime.sessions.values() if created["response_id"] in s.replies.responses)
        response = session.replies.responses[created["response_id"]]
        c.send("conversation.item.truncate", item_id=created["item_id"], audio_end_ms=response.clauses[0][2])
        c.send("conversation.item.truncate", item_id="item_nope", audio_end_ms=10)
        error = await c.wait_for("error")
        assert error["code"] == "item_not_found" and error["param"] == "item_id"
        truncated = await c.wait_for("conversation.item.truncated")
        assert truncated == {"type": "conversation.item.truncated", "item_id": created["item_id"],
                             "content_index": 0, "audio_end_ms": response.clauses[0][2], "t": truncated["t"]}
        assert session.history[-1].text == response.clauses[0][0]
        c.send("conversation.item.retrieve", item_id=created["item_id"])
        retrieved = await c.wait_for("conversation.item.retrieved")
        assert retrieved["item"] == {"id": created["item_id"], "role": "assistant", "text": response.clauses[0][0],
                                     "audio": ""}


async def test_no_response_during_silence(channel):
    rng = np.random.default_rng(0)
    noise = (rng.standard_normal(RATE * 4) * 60).astype(np.int16).tobytes()  # about -55 dBFS
    async with Conversation(channel) as c:
        await c.stream(noise, RATE, speed=4.0)
        await asyncio.sleep(0.5)
        assert not c.of_type("input_audio_buffer.speech_started")
        assert not c.of_type("response.created")


def noise(kind: str, seconds: float, rate: int = RATE, level: float = 0.03) -> np.ndarray:
    """Room noise without speech, float: white, mains hum, or music-like chords."""
    rng = np.random.default_rng(1)
    t = np.arange(int(rate * seconds)) / rate
    if kind == "white":
        return rng.standard_normal(t.size) * level
    if kind == "hum":
        return sum(np.sin(2 * np.pi * f * t) / n for n, f in enumerate((60, 120, 180), 1)) * level * 2
    chords = [(261.6, 329.6, 392.0), (220.0, 261.6, 329.6), (174.6, 220.0, 261.6), (196.0, 246.9, 293.7)]
    notes = [chords[int(x * 2) % 4] for x in t]
    return np.array([sum(np.sin(2 * np.pi * f * x) for f in c) for c, x in zip(notes, t, strict=True)]) * level


@pytest.mark.parametrize("kind", ["near_field", "far_field"])
async def test_with_noise_reduction_speech_in_noise_is_heard_and_noise_alone_starts_nothing(channel, speaker, kind):
    # The far-field suppressor takes about a seventh of a core per second of audio: sent faster than
    # real time to a loaded machine, its input overflows the inbox (and the cut starts a turn), so it
    # gets the audio at the pace a microphone sends it.
    speed = 1.0 if kind == "far_field" else 4.0
    async with Conversation(channel) as c:
        c.send("session.update", session={"noise_reduction": {"type": kind}})
        updated = await c.wait_for("session.updated")
        assert updated["session"]["noise_reduction"]["type"] == kind
        for sound in ("white", "hum", "music"):  # (sent at once: the suppressor is open before they are read)
            await c.stream((noise(sound, 3.0) * 32767).astype(np.int16).tobytes(), RATE, speed=speed)
        speech = speaker.say(SENTENCE, RATE).astype(np.float64) / 32768
        room = noise("white", 1.0 + speech.size / RATE + 1.5) * (np.sqrt(np.mean(speech ** 2)) / 0.03 / 10 ** 0.5)
        room[RATE:RATE + speech.size] += speech  # speech at 10 dB over white noise, from 10 s on
        await c.stream((np.clip(room, -1, 1) * 32767).astype(np.int16).tobytes(), RATE, speed=min(speed, 2.0))
        completed = await c.wait_for("conversation.item.input_audio_transcription.completed", timeout=20)
        starts = [e["audio_start_ms"] for e in c.of_type("input_audio_buffer.speech_started")]
        assert not c.of_type("input_audio_buffer.cleared"), c.of_type("input_audio_buffer.cleared")
        assert starts and min(starts) >= 9500, starts  # none in the noise (the prefix padding is 300 ms)
        assert wer(SENTENCE, completed["transcript"]) <= 0.2, completed["transcript"]
        c.send("session.update", session={"noise_reduction": {"type": ""}})
        assert (await c.wait_for("session.updated", count=2))["session"]["noise_reduction"]["type"] == ""


async def test_noise_reduction_takes_a_phone_calls_8_khz_mulaw(channel, speaker):
    """G.711 at 8 kHz (a phone call's audio) is resampled for the suppressor like any input."""
    from rtmedia.engines.audio.resample import float_to_ulaw

    async with Conversation(channel) as c:
        c.send("session.update", session={"noise_reduction": {"type": "near_field"},
                                          "input_audio_format": {"encoding": "g711_ulaw", "sample_rate": 8000}})
        updated = await c.wait_for("session.updated")
        assert updated["session"]["noise_reduction"]["type"] == "near_field"
        speech = speaker.say(SENTENCE, 8000).astype(np.float32) / 32768
        call = np.concatenate([np.zeros(4000, np.float32), speech, np.zeros(12000, np.float32)])
        await c.stream(float_to_ulaw(call), 8000, speed=2.0, bytes_per_sample=1)
        completed = await c.wait_for("conversation.item.input_audio_transcription.completed", timeout=20)
        assert wer(SENTENCE, completed["transcript"]) <= 0.2, completed["transcript"]


async def test_max_sessions(server, channel):
    # sessions of earlier tests may still be closing
    await until(lambda: not server.realtime.sessions, what="earlier sessions closing")
    limit, server.realtime.max_sessions = server.realtime.max_sessions, 1
    try:
        async with Conversation(channel) as held:
            await held.wait_for("session.created")
            async with Conversation(channel) as refused:
                await refused.ended()
                assert refused.error is not None
                assert refused.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert error_reason(refused.error) == "MAX_SESSIONS"
    finally:
        server.realtime.max_sessions = limit


async def test_idle_timeout_and_max_duration(channel):
    async with Conversation(channel) as idle, Conversation(channel) as long:
        idle.send("session.update", session={"idle_timeout_s": 1})
        long.send("session.update", session={"max_session_s": 2})
        for _ in range(40):  # the long session keeps talking (silence) so it is not idle
            long.send("input_audio_buffer.append", audio=b"\x00\x00" * (RATE // 10))
            await asyncio.sleep(0.1)
            if long.of_type("session.closed"):
                break
        assert (await idle.wait_for("session.closed", timeout=5))["reason"] == "idle_timeout"
        assert (await long.wait_for("session.closed", timeout=5))["reason"] == "max_session_duration"
        await idle.ended()
        await long.ended()
        assert idle.error is None and long.error is None


async def test_abrupt_disconnects_leave_nothing_behind(server, channel, speaker):
    pcm, _, _ = utterance(speaker, "Hello there, how are you?", tail=0.1)

    async def disconnects(count: int) -> None:
        for n in range(count):
            async with Conversation(channel) as c:
                await c.wait_for("session.created")
                c.send("input_audio_buffer.append", audio=pcm[(n % 5) * 9600:(n % 5 + 1) * 9600 + 19200])
                if n % 10 == 0:
                    c.send("conversation.item.create", item={"text": "interrupted reply"})
                    c.send("response.create")
                await asyncio.sleep(0.01 * (n % 4))
            # leaving the block cancels the call: an abrupt disconnect
        await until(lambda: not server.realtime.sessions, what="the disconnected sessions closing")

    # Thread pools start threads lazily, so the first round may add some; a leak grows
    # with every session, so the second round must add nothing.
    await disconnects(100)
    await asyncio.sleep(0.3)
    tasks_before = len(asyncio.all_tasks())
    # asyncio's default executor grows lazily up to its bound: not a leak
    threads = lambda: [t.name for t in threading.enumerate() if not t.name.startswith("asyncio_")]  # noqa: E731
    threads_before = len(threads())
    children_before = len(multiprocessing.active_children())
    await disconnects(100)
    assert not server.realtime.sessions
    assert server.access.vad.attached == 0
    assert server.access.asr.open_streams == 0
    await until(lambda: len(asyncio.all_tasks()) <= tasks_before and len(threads()) <= threads_before,
                what="the sessions' tasks and threads ending", seen=lambda: (len(asyncio.all_tasks()), threads()))
    assert len(asyncio.all_tasks()) <= tasks_before
    assert len(threads()) <= threads_before, threads()
    assert len(multiprocessing.active_children()) == children_before


@pytest.mark.serial
async def test_32_concurrent_sessions(channel, speaker):
    """32 sessions open at once, each speaking one turn. Speech starts 0.6 s apart, so about
    six people speak at any moment: PocketSphinx needs ~0.1 core per speaker and this box has
    two cores, shared with everything else (more simultaneous speech is a capacity question
    for the load tester, not a correctness test)."""
    sentences = [SENTENCE, "The weather today is sunny with a light breeze.", "Our meeting starts at nine o'clock."]
    clips = [utterance(speaker, s)[0] for s in sentences]
    all_open = asyncio.Event()
    opened: list[int] = []

    async def one(n: int) -> tuple[str, dict]:
        async with Conversation(channel) as c:
            await c.wait_for("session.created")
            opened.append(n)
            if len(opened) == 32:
                all_open.set()
            await all_open.wait()
            await asyncio.sleep(n * 0.6)
            await c.stream(clips[n % 3], RATE)
            done = await c.wait_for("response.done", timeout=60)
            completed = c.of_type("conversation.item.input_audio_transcription.completed")
            transcript = completed[0]["transcript"] if completed else None
            text = c.of_type("response.output_text.done")[0]["text"] if done["status"] == "completed" else ""
            return sentences[n % 3], {"done": done, "transcript": transcript, "text": text, "types": c.types()}

    results = await asyncio.gather(*(one(n) for n in range(32)))
    for sentence, r in results:
        assert r["done"]["status"] == "completed", r
        assert r["transcript"] is not None, r["types"]
        assert r["text"] == f"You said: {r['transcript']}"
        assert wer(sentence, r["transcript"]) < 0.5, (sentence, r["transcript"])
