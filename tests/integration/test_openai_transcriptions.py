"""POST /v1/audio/transcriptions (rtmedia.web.openai.openai_transcription), driven by the official
`openai` SDK against the web front beside an in-process server: Piper speech in the containers
clients upload, every response format, streaming, downmixing and resampling, and each kind of
bad request in OpenAI's error shape.

The upload limit is set to 1 MiB for this module (WEB_OPTIONS), well above the bridge's own
64 KiB body limit, which the multipart reader does not apply: the multi-utterance WAV is larger
than that."""

from __future__ import annotations

import asyncio
import gc
import logging
import re

import aiohttp
import numpy as np
import openai
import pytest
from openai.types.audio import TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent
from rtmedia.v1 import speech_pb2
from rtmedia.web.openai import openai_transcription
from rtmedia.web.openai.openai_api import OpenAIConfig
from rtmedia.web.openai.openai_errors import SERVER_ERROR, OpenAIError

from tests.support.audio_files import encode, recording, video_only
from tests.support.speech import Speaker, normalise, wer
from tests.support.waits import until

LIMIT = 1024 * 1024
AUDIO_LIMIT_S = 30.0
WEB_OPTIONS = {"openai": OpenAIConfig(max_upload_bytes=LIMIT, max_audio_seconds=AUDIO_LIMIT_S)}
ONE = "Please open the window in the kitchen."
ONE_KEYS = ("window", "kitchen")
THREE = ("The weather is nice today.", "Please open the window in the kitchen.", "We will meet again next week.")
THREE_KEYS = ("nice", "today", "window", "kitchen", "meet", "week")
MAX_WER = 0.5
SLACK_S = 0.6  # how far a segment's bounds may be from where its sentence is


@pytest.fixture(scope="module")
def speaker():
    return Speaker()


@pytest.fixture(scope="module")
def one(speaker):
    return recording(speaker, [ONE], rate=24000)


@pytest.fixture(scope="module")
def three(speaker):
    return recording(speaker, THREE, rate=16000, gap_s=1.5)


@pytest.fixture(scope="module")
def three_wav(three):
    data = three.file("wav")
    assert 64 * 1024 < len(data) < LIMIT
    return data


def words_of(text: str) -> set[str]:
    return set(normalise(text).split())


def assert_heard(reference: str, text: str, keys: tuple[str, ...]) -> None:
    assert wer(reference, text) <= MAX_WER, (reference, text)
    missing = [k for k in keys if k not in words_of(text)]
    assert not missing, (missing, text)


async def transcribe(client, name: str, data: bytes, **kw):
    return await client.audio.transcriptions.create(model="whisper-1", file=(name, data), **kw)


# ---- files and formats --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mp3", "ogg", "m4a", "webm", "flac"])
async def test_a_sentence_in_each_container_transcribes(openai_client, one, kind):
    result = await transcribe(openai_client, f"a.{kind}", one.file(kind))
    assert_heard(ONE, result.text, ONE_KEYS)
    assert result.usage.type == "duration"
    assert result.usage.seconds == pytest.approx(one.seconds, abs=1)


async def test_json(openai_client, three, three_wav):
    result = await transcribe(openai_client, "three.wav", three_wav, response_format="json")
    assert_heard(three.text, result.text, THREE_KEYS)


async def test_text(openai_client, three, three_wav):
    text = await transcribe(openai_client, "three.wav", three_wav, response_format="text")
    assert isinstance(text, str) and text.endswith("\n")
    assert_heard(three.text, text, THREE_KEYS)


async def test_verbose_json_segments_and_words(openai_client, three, three_wav):
    result = await transcribe(openai_client, "three.wav", three_wav, response_format="verbose_json",
                              timestamp_granularities=["segment", "word"])
    assert result.language == "english"
    assert result.duration == pytest.approx(three.seconds, abs=0.05)
    assert_heard(three.text, result.text, THREE_KEYS)
    segments = result.segments
    assert [s.id for s in segments] == [0, 1, 2]
    assert result.text == " ".join(s.text for s in segments)
    for segment, sentence, (start, end) in zip(segments, THREE, three.spans, strict=True):
        assert segment.start < segment.end
        assert abs(segment.start - start) < SLACK_S and abs(segment.end - end) < SLACK_S, (segment, start, end)
        assert wer(sentence, segment.text) <= MAX_WER
        assert segment.tokens and all(0 <= t < 50257 for t in segment.tokens) and segment.temperature == 0
        assert 0 <= segment.no_speech_prob < 0.2  # the model's own estimate: it heard speech
        assert -0.5 < segment.avg_logprob <= 0 and segment.compression_ratio > 0
        assert segment.seek == pytest.approx(segment.start * 100, abs=100)
    assert [s.start for s in segments] == sorted(s.start for s in segments)
    words = result.words
    assert [w.word for w in words] == " ".join(s.text for s in segments).split()
    assert all(0 <= w.start <= w.end <= result.duration for w in words)
    assert [w.start for w in words] == sorted(w.start for w in words)
    assert words[0].start == segments[0].start and words[-1].end == segments[-1].end
    assert result.usage.seconds == pytest.approx(three.seconds, abs=1)


async def test_verbose_json_has_words_only_when_asked(openai_client, one):
    result = await transcribe(openai_client, "a.mp3", one.file("mp3"), response_format="verbose_json")
    assert result.words is None and len(result.segments) == 1
    result = await transcribe(openai_client, "a.mp3", one.file("mp3"), response_format="verbose_json",
                              timestamp_granularities=["word"])
    assert result.segments is None and len(result.words) >= 5


CUE = re.compile(r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d) --> (\d\d):(\d\d):(\d\d)[,.](\d\d\d)")


def cue_times(line: str, separator: str) -> tuple[float, float]:
    assert CUE.fullmatch(line) and line.count(separator) == 2, line
    h1, m1, s1, ms1, h2, m2, s2, ms2 = map(int, CUE.fullmatch(line).groups())
    return h1 * 3600 + m1 * 60 + s1 + ms1 / 1000, h2 * 3600 + m2 * 60 + s2 + ms2 / 1000


def check_cues(cues: list[tuple[float, float, str]], three) -> None:
    assert len(cues) == 3, cues
    for (start, end, text), sentence, (s_start, s_end) in zip(cues, THREE, three.spans, strict=True):
        assert start < end and abs(start - s_start) < SLACK_S and abs(end - s_end) < SLACK_S
        assert wer(sentence, text) <= MAX_WER
    assert_heard(three.text, " ".join(c[2] for c in cues), THREE_KEYS)


async def test_srt(openai_client, three, three_wav):
    body = await transcribe(openai_client, "three.wav", three_wav, response_format="srt")
    blocks = body.strip().split("\n\n")
    cues = []
    for n, block in enumerate(blocks, 1):
        number, timing, text = block.split("\n")
        assert number == str(n)
        cues.append((*cue_times(timing, ","), text))
    check_cues(cues, three)


async def test_vtt(openai_client, three, three_wav):
    body = await transcribe(openai_client, "three.wav", three_wav, response_format="vtt")
    header, *blocks = body.strip().split("\n\n")
    assert header == "WEBVTT"
    cues = []
    for block in blocks:
        timing, text = block.split("\n")
        cues.append((*cue_times(timing, "."), text))
    check_cues(cues, three)


async def test_stream_deltas_concatenate_to_the_done_text(openai_client, three):
    stream = await transcribe(openai_client, "three.mp3", three.file("mp3"), stream=True)
    events = [event async for event in stream]
    deltas, done = events[:-1], events[-1]
    assert all(isinstance(e, TranscriptionTextDeltaEvent) and e.delta for e in deltas), events
    assert isinstance(done, TranscriptionTextDoneEvent)
    assert len(deltas) >= 3  # the text came in pieces
    assert "".join(e.delta for e in deltas) == done.text
    assert done.text == done.text.strip() and "  " not in done.text
    assert_heard(three.text, done.text, THREE_KEYS)
    assert all(e.logprobs is None for e in events)  # not asked
    # One delta per utterance, as the recogniser finishes each: the same text as the json answer.
    whole = await transcribe(openai_client, "three.mp3", three.file("mp3"))
    assert done.text == whole.text


def spelled(logprobs) -> str:
    """The text the tokens of OpenAI's `logprobs` entries spell, checking each entry's shape."""
    assert all(p.logprob <= 0 and bytes(map(int, p.bytes)).decode() == p.token for p in logprobs), logprobs
    return "".join(p.token for p in logprobs).strip()


async def test_logprobs_when_included(openai_client, three, three_wav):
    result = await transcribe(openai_client, "three.wav", three_wav, include=["logprobs"])
    assert_heard(three.text, result.text, THREE_KEYS)
    assert spelled(result.logprobs) == result.text
    assert (await transcribe(openai_client, "three.wav", three_wav)).logprobs is None
    stream = await transcribe(openai_client, "three.wav", three_wav, include=["logprobs"], stream=True)
    events = [event async for event in stream]
    deltas, done = events[:-1], events[-1]
    assert [spelled(e.logprobs) for e in deltas] == [e.delta.strip() for e in deltas]
    assert [p.model_dump() for p in done.logprobs] == [p.model_dump() for e in deltas for p in e.logprobs]
    assert spelled(done.logprobs) == done.text


def failing_results(before: list[speech_pb2.TranscribeResponse]):
    async def results(self):
        for result in before:
            yield result
        raise OpenAIError(503, "the recogniser failed", SERVER_ERROR, code="engine_failed")

    return results


async def test_a_failure_after_the_stream_started_is_an_error_event(openai_client, one, monkeypatch):
    first = speech_pb2.TranscribeResponse(utterance_index=0, is_final=True, text="open the window")
    monkeypatch.setattr(openai_transcription.Recognition, "results", failing_results([first]))
    stream = await transcribe(openai_client, "a.mp3", one.file("mp3"), stream=True)
    events = []
    with pytest.raises(openai.APIError) as caught:
        async with stream:
            async for event in stream:
                events.append(event)
    assert [e.delta for e in events] == ["open the window"]
    assert caught.value.message == "the recogniser failed"
    assert caught.value.body == {"message": "the recogniser failed", "type": "server_error", "param": None,
                                 "code": "engine_failed"}
    # The SDK leaves its byte-stream generators suspended, held by the error's traceback; collect them
    # now, on this loop, rather than in whichever later test's thread the collector next runs.
    del caught
    gc.collect()
    await asyncio.sleep(0.05)


async def test_a_failure_before_the_first_event_is_an_http_error(openai_client, one, monkeypatch):
    monkeypatch.setattr(openai_transcription.Recognition, "results", failing_results([]))
    call = transcribe(openai_client, "a.mp3", one.file("mp3"), stream=True)
    exc = await expect(call, openai.InternalServerError, 503, None, "the recogniser failed")
    assert exc.code == "engine_failed"


async def test_a_client_that_leaves_ends_its_transcription(web_front, three_wav, caplog):
    form = aiohttp.FormData()
    form.add_field("model", "whisper-1")
    form.add_field("file", three_wav, filename="three.wav", content_type="audio/wav")
    url = f"http://127.0.0.1:{web_front.port}/v1/audio/transcriptions"
    with caplog.at_level(logging.INFO, logger="rtmedia.web"):
        async with aiohttp.ClientSession() as session:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5), session.post(url, data=form) as response:
                    await response.read()
        records = await until(lambda: [r for r in caplog.records if r.getMessage() == "openai transcription"],
                              timeout=2, what="the transcription's log line")
    assert [r.status for r in records] == [499]
    assert records[0].wall_ms < 1500
    assert web_front.openai.active == 0


@pytest.mark.parametrize(("kind", "rate", "channels"), [("flac", 44100, 2), ("wav", 8000, 1), ("mp3", 48000, 2)])
async def test_any_rate_and_channel_count_is_resampled_and_downmixed(openai_client, speaker, kind, rate, channels):
    spoken = recording(speaker, [ONE], rate=rate)
    data = encode(spoken.samples, rate, kind, channels)
    result = await transcribe(openai_client, f"a.{kind}", data, response_format="verbose_json")
    assert result.duration == pytest.approx(spoken.seconds, abs=0.06)  # a wrong rate would stretch it
    assert_heard(ONE, result.text, ONE_KEYS)


async def test_a_truncated_file_transcribes_as_far_as_it_decodes(openai_client, three):
    data = three.file("mp3")
    cut = data[:len(data) * 45 // 100]  # the first sentence and part of the second
    result = await transcribe(openai_client, "cut.mp3", cut, response_format="verbose_json")
    assert result.duration == pytest.approx(three.seconds * 0.45, abs=0.3)
    assert {"nice", "today"} <= words_of(result.text)
    assert "week" not in words_of(result.text)


# ---- bad requests -----------------------------------------------------------------------------------
async def expect(call, cls, status: int, param: str | None, *message_parts: str):
    with pytest.raises(cls) as caught:
        await call
    exc = caught.value
    assert exc.status_code == status
    assert exc.body["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert exc.param == param, exc.body
    for part in message_parts:
        assert part in exc.message, exc.message
    return exc


@pytest.mark.parametrize(("name", "data", "parts"), [
    ("empty.mp3", b"", ("file is empty",)),
    ("noise.mp3", bytes(range(256)) * 40, ("could not be read as audio", "Invalid data found")),
    ("header.wav", encode(Speaker.silence(0.1), 16000, "wav")[:44], ("Invalid data found",)),
    ("film.mp4", video_only(), ("no audio stream", "video")),
])
async def test_a_file_that_is_not_audio_is_a_400(openai_client, name, data, parts):
    await expect(transcribe(openai_client, name, data), openai.BadRequestError, 400, "file", *parts)


@pytest.mark.parametrize(("kind", "keep", "parts"), [
    ("m4a", 0.5, ("could not be read as audio", "Invalid data found")),  # aac in mp4: its index is at the end
    ("ogg", 0.002, ("could not be read as audio", "End of file")),
])
async def test_a_truncated_file_that_does_not_decode_is_a_400(openai_client, one, kind, keep, parts):
    data = one.file(kind)
    cut = data[:max(60, int(len(data) * keep))]
    await expect(transcribe(openai_client, f"cut.{kind}", cut), openai.BadRequestError, 400, "file", *parts)


async def test_no_file_is_a_400(openai_client):
    call = openai_client.post("/audio/transcriptions", cast_to=openai.types.audio.Transcription,
                              body={"model": "whisper-1"}, files=[("audio", ("a.wav", b"RIFF"))],
                              options={"headers": {"Content-Type": "multipart/form-data"}})
    await expect(call, openai.BadRequestError, 400, "file", "file is required")


@pytest.mark.parametrize(("kw", "cls", "status", "param", "part"), [
    ({"model": "whisper-9"}, openai.NotFoundError, 404, "model", "'whisper-9' does not exist"),
    ({"language": "fr"}, openai.BadRequestError, 400, "language",
     "language 'fr' is not served by this recogniser; it serves en (an English-only model)"),
    ({"language": "x" * 65}, openai.BadRequestError, 400, "language", "is not a language"),
    ({"response_format": "xml"}, openai.BadRequestError, 400, "response_format", "'xml' is not supported"),
    ({"temperature": "warm"}, openai.BadRequestError, 400, "temperature", "not a number"),
    ({"timestamp_granularities": ["char"]}, openai.BadRequestError, 400, "timestamp_granularities", "'char'"),
    ({"include": ["entropy"]}, openai.BadRequestError, 400, "include", "'entropy' is not one of logprobs"),
    ({"include": ["logprobs"], "response_format": "srt"}, openai.BadRequestError, 400, "include",
     "needs response_format json"),
])
async def test_bad_fields_are_refused_naming_the_field(openai_client, one, kw, cls, status, param, part):
    kw = {"model": "whisper-1", **kw}
    call = openai_client.audio.transcriptions.create(file=("a.mp3", one.file("mp3")), **kw)
    await expect(call, cls, status, param, part)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_language_the_recogniser_does_not_serve_is_the_servers_400(openai_client, one, stream):
    call = transcribe(openai_client, "a.mp3", one.file("mp3"), language="de-DE", stream=stream)
    exc = await expect(call, openai.BadRequestError, 400, "language", "'de-DE' is not served", "it serves en")
    assert exc.code == "unsupported_language"


async def test_the_model_list_names_the_recogniser_and_transcriptions_take_its_name(openai_client, one):
    names = [m.id async for m in openai_client.models.list()]
    assert names[-1] == "whisper-tiny" and {"whisper-1", "rtmedia-asr", "tts-1"} <= set(names)
    assert (await openai_client.models.retrieve("whisper-tiny")).id == "whisper-tiny"
    result = await openai_client.audio.transcriptions.create(model="whisper-tiny", file=("a.mp3", one.file("mp3")),
                                                             language="english", response_format="verbose_json")
    assert result.language == "english"
    assert_heard(ONE, result.text, ONE_KEYS)


async def test_accepted_fields_are_ignored(openai_client, one):
    result = await openai_client.audio.transcriptions.create(
        model="gpt-4o-mini-transcribe", file=("a.mp3", one.file("mp3")), language="en-US", prompt="Kitchens.",
        temperature=0.3)
    assert_heard(ONE, result.text, ONE_KEYS)


async def test_an_upload_over_the_limit_is_a_413(openai_client):
    call = transcribe(openai_client, "big.wav", bytes(LIMIT + 1))
    await expect(call, openai.APIStatusError, 413, "file", f"limit of {LIMIT} bytes")


async def test_audio_longer_than_the_limit_is_refused(openai_client):
    """A small file can hold long audio (silence compresses well): the decoded length is bounded too."""
    silence = encode(np.zeros(int(16000 * (AUDIO_LIMIT_S + 5)), np.int16), 16000, "mp3")
    assert len(silence) < LIMIT
    call = transcribe(openai_client, "long.mp3", silence)
    await expect(call, openai.BadRequestError, 400, "file", f"longer than the limit of {AUDIO_LIMIT_S:g} s")


async def test_a_chunked_upload_over_the_limit_is_a_413(web_front):
    """Without a Content-Length the reader counts the bytes as they come."""
    boundary = "rtmedia-test-boundary"

    async def body():
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
               "Content-Type: audio/wav\r\n\r\n").encode()
        for _ in range(LIMIT // 65536 + 2):
            yield bytes(65536)
        yield f"\r\n--{boundary}--\r\n".encode()

    url = f"http://127.0.0.1:{web_front.port}/v1/audio/transcriptions"
    async with aiohttp.ClientSession() as session, session.post(
            url, data=body(), headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}) as response:
        assert response.status == 413
        error = (await response.json())["error"]
    assert error["param"] == "file" and f"limit of {LIMIT} bytes" in error["message"]


async def test_a_body_that_is_not_multipart_is_a_400(openai_client):
    call = openai_client.post("/audio/transcriptions", cast_to=openai.types.audio.Transcription,
                              body={"model": "whisper-1", "file": "a.mp3"})
    await expect(call, openai.BadRequestError, 400, None, "multipart/form-data", "application/json")


# ---- the pieces ---------------------------------------------------------------------------------------
def test_subtitle_timestamps():
    from rtmedia.web.subtitles import srt, timestamp, vtt

    assert timestamp(3661.5, ",") == "01:01:01,500" and timestamp(-0.2, ".") == "00:00:00.000"
    assert srt([(0.5, 1.25, "hello  there"), (2, 3, "a --> b")]) == (
        "1\n00:00:00,500 --> 00:00:01,250\nhello there\n\n2\n00:00:02,000 --> 00:00:03,000\na -> b\n")
    assert vtt([(0.5, 1.25, "hello")]) == "WEBVTT\n\n00:00:00.500 --> 00:00:01.250\nhello\n"
    assert vtt([]) == "WEBVTT\n"
