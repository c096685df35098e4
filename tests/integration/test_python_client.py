"""The typed Python client (rtmedia.clients) against a real in-process server: every public
method of RealtimeSession, SpeechClient, AsyncSpeechClient and VideoClient, typed events and
typed errors."""

from __future__ import annotations

import asyncio
import io

import av
import numpy as np
import pytest
from rtmedia.clients import (
    AsyncSpeechClient,
    RealtimeClient,
    RealtimeSession,
    RtmediaError,
    SpeechClient,
    VideoClient,
    events,
)
from rtmedia.clients.errors import InvalidArgument, NotFound, Refused, Unavailable

from tests.integration.test_openai_realtime import earlier_sessions_closed
from tests.integration.test_realtime import utterance
from tests.support.speech import wer

RATE = 16000
SERVER_OPTIONS = {"max_sessions": 3}
MANUAL = {"input_audio_format": {"sample_rate": RATE}, "turn_detection": {"type": "manual"}}


def target(server) -> str:
    return f"127.0.0.1:{server.port}"


async def until(session: RealtimeSession, kind: type[events.ServerEvent], timeout: float = 30) -> list:
    """The events up to and including the first of `kind`."""
    seen = []
    try:
        async with asyncio.timeout(timeout):
            async for event in session.events():
                seen.append(event)
                if isinstance(event, kind):
                    return seen
    except TimeoutError:
        raise AssertionError(f"no {kind.type} in {timeout} s: {[e.to_json() for e in seen]}") from None
    raise AssertionError(f"the stream ended before {kind.type}: {[e.type for e in seen]}")


async def test_a_manual_turn_with_every_client_event(server, speaker):
    pcm, _, _ = utterance(speaker, "please tell me about the weather", RATE)
    async with RealtimeSession(target(server), **MANUAL) as session:
        assert session.id
        assert isinstance(session.created, events.SessionCreatedEvent)
        assert session.created.limits.max_sessions == 3
        updated = (await until(session, events.SessionUpdatedEvent))[-1]
        assert updated.to_json()["session"]["turn_detection"]["type"] == "manual"
        await _stream(session, pcm)  # paced: a burst beyond the inbox is discarded (input_backpressure)
        await session.commit()
        committed = (await until(session, events.InputAudioBufferCommittedEvent))[-1]
        assert committed.audio_ms == pytest.approx(len(pcm) / 2 / RATE * 1000, abs=25)
        await session.create_response()
        seen = await until(session, events.ResponseDoneEvent, timeout=60)
        audio = [e for e in seen if isinstance(e, events.ResponseOutputAudioDeltaEvent)]
        assert audio and all(e.sample_rate > 0 and e.audio for e in audio)
        done = seen[-1]
        assert done.to_json()["status"] == "completed"
        transcripts = [e for e in seen if isinstance(e, events.ConversationItemInputAudioTranscriptionCompletedEvent)]
        assert transcripts and wer("please tell me about the weather", transcripts[0].transcript) < 0.5
        # The reply's playback acknowledged, then its item truncated where the user stopped hearing it.
        await session.ack_playback(done.response_id, 100)
        acked = (await until(session, events.PlaybackAcknowledgedEvent))[-1]
        assert acked.response_id == done.response_id and acked.played_ms == 100
        item_id = audio[0].item_id
        await session.truncate(item_id, audio_end_ms=50)
        truncated = (await until(session, events.ConversationItemTruncatedEvent))[-1]
        assert (truncated.item_id, truncated.audio_end_ms) == (item_id, 50)
        # A text item, an out-of-band reply cancelled at once, float samples, a cleared buffer.
        await session.add_item({"role": "user", "text": "hello there"})
        added = (await until(session, events.ConversationItemAddedEvent))[-1]
        assert (added.item.role, added.item.text) == ("user", "hello there")
        await session.create_response(instructions="Say one word.")
        created = (await until(session, events.ResponseCreatedEvent))[-1]
        await session.cancel(created.response_id)
        ended = (await until(session, events.ResponseDoneEvent, timeout=60))[-1]
        assert ended.response_id == created.response_id
        await session.send_audio(np.zeros(RATE // 10, np.float32))
        await session.clear_audio()
        cleared = (await until(session, events.InputAudioBufferClearedEvent))[-1]
        assert cleared.to_json()["type"] == "input_audio_buffer.cleared"
        # A bad value is an error event; the session goes on.
        await session.update(voice="nobody")
        error = (await until(session, events.ErrorEvent))[-1]
        assert (error.code, error.param) == ("invalid_value", "voice")
    assert session.closed is not None and session.closed.reason == "client"
    await earlier_sessions_closed(server)
    assert not server.realtime.sessions


async def test_server_vad_turn_and_a_shared_channel(server, speaker):
    pcm, _, _ = utterance(speaker, "what time is it", RATE)
    async with RealtimeClient(target(server)) as client:
        async with client.session(input_audio_format={"sample_rate": RATE}) as session:
            sender = asyncio.create_task(_stream(session, pcm))
            seen = await until(session, events.ResponseDoneEvent, timeout=60)
            await sender
        kinds = [type(e) for e in seen]
        assert events.InputAudioBufferSpeechStartedEvent in kinds and events.InputAudioBufferSpeechStoppedEvent in kinds
        assert all(type(e) is events.EVENT_CLASSES[e.proto.WhichOneof("event")] for e in seen)
        # Leaving while another task reads: the reader sees session.closed, then the end.
        async with client.session() as session:
            reader = asyncio.create_task(_all(session))
            await asyncio.sleep(0.1)
        assert isinstance((await reader)[-1], events.SessionClosedEvent)


async def _stream(session: RealtimeSession, pcm: bytes, chunk_ms: int = 20, speed: float = 4.0) -> None:
    """`pcm` at `speed` times real time, as bytes and as int16 samples by turns."""
    step = RATE * chunk_ms // 1000 * 2
    for n, offset in enumerate(range(0, len(pcm), step)):
        chunk = pcm[offset:offset + step]
        await session.send_audio(chunk if n % 2 else np.frombuffer(chunk, "<i2"))
        await asyncio.sleep(chunk_ms / 1000 / speed)


async def _all(session: RealtimeSession) -> list:
    return [e async for e in session.events()]


async def test_refusals_and_unreachable_servers_are_typed(server):
    held = [await RealtimeSession(target(server)).__aenter__() for _ in range(3)]
    try:
        with pytest.raises(Refused) as refused:
            async with RealtimeSession(target(server)):
                pass
        assert refused.value.reason == "MAX_SESSIONS" and isinstance(refused.value, RtmediaError)
    finally:
        for session in held:
            await session.close()
    with pytest.raises(Unavailable):
        async with RealtimeSession("127.0.0.1:1", timeout=5):
            pass


async def test_speech_client_streams_at_any_rate_and_transcribes(server, speaker):
    await asyncio.to_thread(_speech_client, server, speaker)  # blocking calls: off the server's loop


def _speech_client(server, speaker) -> None:
    with SpeechClient(target(server), timeout=60) as speech:
        voices = speech.list_voices()
        voice = voices.voices[0]
        native = list(speech.synthesize("Hello there, friend.", numpy=True))
        assert native[0].sample_rate == voice.native_sample_rate and native[-1].is_final
        assert all(c.audio.dtype == np.int16 for c in native)
        # the voice samples its timing, so one synthesis's length is one draw: the native lengths
        # of three bound what a resampled one may last (a wrong rate is off by its ratio)
        lengths = [sum(c.seconds for c in native)] + [
            sum(c.seconds for c in speech.synthesize("Hello there, friend.", numpy=True)) for _ in range(2)]
        for rate in (voice.supported_sample_rates[0], 44100):  # served, then resampled here
            chunks = list(speech.synthesize("Hello there, friend.", sample_rate=rate))
            assert {c.sample_rate for c in chunks} == {rate} and all(isinstance(c.audio, bytes) for c in chunks)
            seconds = sum(c.seconds for c in chunks)
            assert 0.9 * min(lengths) <= seconds <= 1.1 * max(lengths), (seconds, lengths)
        with pytest.raises(InvalidArgument) as bad:
            list(speech.synthesize("hi", sample_rate=7))
        assert bad.value.reason == "UNSUPPORTED_SAMPLE_RATE"
        with pytest.raises(RtmediaError) as unknown:
            list(speech.synthesize("hi", voice="nobody"))
        assert unknown.value.reason and isinstance(unknown.value, NotFound | InvalidArgument)
        words = "the quick brown fox jumps over the lazy dog"
        samples = speaker.say(words, 22050)  # not a server rate: resampled here
        for audio in (samples, samples.tobytes()):
            finals = [r.text for r in speech.transcribe(audio, 22050) if r.is_final]
            assert wer(words, " ".join(finals)) < 0.35
        pcm = speaker.say(words, RATE).tobytes()
        chunks = (pcm[i:i + 3200] for i in range(0, len(pcm), 3200))
        assert wer(words, " ".join(r.text for r in speech.transcribe(chunks, RATE) if r.is_final)) < 0.35


async def test_async_speech_client(server, speaker):
    async with AsyncSpeechClient(target(server), timeout=60) as speech:
        assert (await speech.list_voices()).voices
        chunks = [c async for c in speech.synthesize("Good morning.", sample_rate=48000, numpy=True)]
        assert chunks and {c.sample_rate for c in chunks} == {48000}
        words = "good morning to you"
        finals = [r.text async for r in speech.transcribe(speaker.say(words, RATE), RATE) if r.is_final]
        assert wer(words, " ".join(finals)) < 0.5


async def test_video_client_decodes_to_numpy_and_fmp4(server):
    await asyncio.to_thread(_video_client, server)


def _video_client(server) -> None:
    latent = np.random.default_rng(0).standard_normal((16, 5, 4, 4)).astype(np.float32)
    with VideoClient(target(server), timeout=120) as video:
        chunks = list(video.decode(latent))
        frames = np.concatenate([c.frames for c in chunks])
        assert frames.shape == (17, 32, 32, 3) and frames.dtype == np.uint8 and chunks[-1].is_final
        mp4 = b"".join(c.data for c in video.decode(latent[None], format="fmp4"))
        with av.open(io.BytesIO(mp4)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 17
        with pytest.raises(ValueError, match="C x T x H x W"):
            list(video.decode(latent[0]))
        with pytest.raises(InvalidArgument) as bad:
            list(video.decode(latent, fps=-1))
        assert bad.value.reason
