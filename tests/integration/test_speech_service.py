"""SpeechService in-process on a real grpc.aio server with the real embedded engines."""

from __future__ import annotations

import io
import itertools
import wave

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from rtmedia.protocol.errors import error_metadata, error_reason
from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

from tests.support.speech import wer

SENTENCES = [
    "The weather today is sunny with a light breeze from the west.",
    "Please remember to buy milk, bread and eggs on your way home.",
    "Our meeting starts at nine o'clock in the large conference room.",
]
VOICE = "en_US-joe-medium"


@pytest.fixture(scope="module")
def stub(channel):
    return speech_pb2_grpc.SpeechServiceStub(channel)


async def synth(stub, text, **kw) -> list[speech_pb2.SynthesizeResponse]:
    return [r async for r in stub.Synthesize(speech_pb2.SynthesizeRequest(text=text, **kw))]


async def transcribe(stub, pcm: bytes, rate: int, chunk_ms: int = 100, vad_segmentation: bool = False, **fmt):
    step = rate * chunk_ms // 1000 * 2

    async def requests():
        audio_format = common_pb2.AudioFormat(sample_rate=rate, channels=1, **fmt)
        yield speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
            audio_format=audio_format, vad_segmentation=vad_segmentation))
        for i in range(0, len(pcm), step):
            yield speech_pb2.TranscribeRequest(audio=pcm[i:i + step])

    return [r async for r in stub.Transcribe(requests())]


async def test_health_and_reflection(server, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "rtmedia.v1.SpeechService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = [r async for r in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"rtmedia.v1.SpeechService", "rtmedia.v1.RealtimeService", "rtmedia.v1.VideoService",
            "grpc.health.v1.Health"} <= names


async def test_list_voices(stub):
    reply = await stub.ListVoices(speech_pb2.ListVoicesRequest())
    (voice,) = reply.voices
    assert voice.name == VOICE and voice.native_sample_rate == 22050 and voice.language == "en-US"
    assert list(voice.supported_sample_rates) == [8000, 16000, 22050, 24000, 44100, 48000]
    assert reply.max_text_chars == 5000


async def test_synthesize_streams_clause_chunks(stub):
    text = "Hello there, this is a streaming voice that speaks in clauses. It starts early; then it goes on."
    replies = await synth(stub, text)
    assert [r.chunk_index for r in replies] == list(range(len(replies)))
    assert replies[0].text == "Hello there,"
    assert [r.text for r in replies] == ["Hello there,", "this is a streaming voice that speaks in clauses.",
                                         "It starts early;", "then it goes on."]
    assert [r.is_final for r in replies] == [False] * (len(replies) - 1) + [True]
    assert all(r.sample_rate == 22050 and r.channels == 1 and len(r.audio) % 2 == 0 for r in replies)
    offsets = [r.audio_offset_ms for r in replies]
    assert offsets == sorted(offsets) and offsets[0] == 0
    seconds = sum(len(r.audio) for r in replies) / 2 / 22050
    assert 3.0 < seconds < 12.0


async def test_first_chunk_is_at_most_three_words(stub):
    replies = await synth(stub, "one two three four five six seven eight nine ten")
    assert replies[0].text == "one two three"
    assert replies[1].text == "four five six seven eight nine ten"


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 44100, 48000])
async def test_every_supported_rate_keeps_duration(stub, rate):
    native = await synth(stub, "Testing the output rate.")
    native_s = sum(len(r.audio) for r in native) / 2 / 22050
    replies = await synth(stub, "Testing the output rate.", sample_rate=rate)
    assert {r.sample_rate for r in replies} == {rate}
    seconds = sum(len(r.audio) for r in replies) / 2 / rate
    # Piper's noise makes durations differ slightly between runs.
    assert abs(seconds - native_s) / native_s < 0.15


async def test_wav_framing_has_one_header_with_the_output_rate(stub):
    replies = await synth(stub, "A short sentence, in a wave file.", sample_rate=16000,
                          framing=speech_pb2.AUDIO_FRAMING_WAV)
    data = b"".join(r.audio for r in replies)
    assert data[:4] == b"RIFF" and data.count(b"RIFF") == 1
    header = bytearray(data[:44])
    header[40:44] = (len(data) - 44).to_bytes(4, "little")
    header[4:8] = (len(data) - 8).to_bytes(4, "little")
    with wave.open(io.BytesIO(bytes(header) + data[44:])) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (16000, 1, 2)
        assert wav.getnframes() == (len(data) - 44) // 2


async def test_control_characters_in_the_text_are_not_spoken(stub):
    """A NUL (which espeak-ng's phonemizer refuses) or another control character is a space."""
    plain = b"".join(r.audio for r in await synth(stub, "hello there world"))
    odd = b"".join(r.audio for r in await synth(stub, "hello\x00 there\x07world\x1b"))
    assert len(odd) > len(plain) // 2, (len(odd), len(plain))

@pytest.mark.parametrize("out_rate,in_rate", [(16000, 16000), (24000, 24000), (48000, 48000)])
async def test_synthesized_speech_transcribes_back(stub, out_rate, in_rate):
    """TTS at a resampled rate, streamed back through Transcribe: WER under 35 %."""
    gap = np.zeros(int(1.2 * out_rate), np.int16).tobytes()
    pcm = gap
    for text in SENTENCES:
        replies = await synth(stub, text, sample_rate=out_rate)
        pcm += b"".join(r.audio for r in replies) + gap
    results = await transcribe(stub, pcm, in_rate)
    finals = [r for r in results if r.is_final]
    hypothesis = " ".join(r.text for r in finals)
    assert wer(" ".join(SENTENCES), hypothesis) < 0.35, hypothesis
    assert [r.utterance_index for r in finals] == sorted(r.utterance_index for r in finals)
    assert all(r.end_ms > r.start_ms for r in finals)
    partials = [r for r in results if not r.is_final]
    assert partials, "partial results are on by default"
    for prev, cur in itertools.pairwise(partials):
        if prev.utterance_index == cur.utterance_index:
            assert cur.text.startswith(prev.text), "partials are append-only"


async def test_vad_segmentation_cuts_a_recording_where_the_speech_is(stub, speaker):
    """With `vad_segmentation` the VAD cuts the utterances: one final per sentence, in order,
    its bounds (and its words') in the input's time where the sentence was put, sent faster
    than real time as a file would be."""
    rate, gap_s = 16000, 1.5
    audio, spans, at = [speaker.silence(1.0, rate)], [], 1.0
    for text in SENTENCES:
        speech = speaker.say(text, rate)
        spans.append((at, at + len(speech) / rate))
        at = spans[-1][1] + gap_s
        audio += [speech, speaker.silence(gap_s, rate)]
    results = await transcribe(stub, np.concatenate(audio).tobytes(), rate, chunk_ms=1000, vad_segmentation=True)
    finals = [r for r in results if r.is_final and r.text]
    assert len(finals) == 3, [(r.text, r.start_ms, r.end_ms) for r in finals]
    assert wer(" ".join(SENTENCES), " ".join(r.text for r in finals)) < 0.35
    for final, (start, end) in zip(finals, spans, strict=True):
        # An utterance starts with the VAD's prefix padding; its words where they were said.
        assert -700 < final.start_ms - start * 1000 < 300 and abs(final.end_ms - end * 1000) < 900, (final, start, end)
        assert final.words and abs(final.words[0].start_ms - start * 1000) < 400
        assert final.words[-1].end_ms < end * 1000 + 600
    assert [r.utterance_index for r in finals] == sorted({r.utterance_index for r in finals})
    assert any(not r.is_final for r in results), "partial results are on by default"


async def test_speed_changes_the_speaking_rate(stub):
    """`speed` goes through the voice's length scale (the phonemes' durations, not the pauses at
    the text's edges): 2.0 is much shorter, 0.5 much longer."""
    text = SENTENCES[1]
    lengths = {speed: sum(len(r.audio) for r in await synth(stub, text, speed=speed)) for speed in (0.5, 1.0, 2.0)}
    assert 0.45 < lengths[2.0] / lengths[1.0] < 0.75 and 1.5 < lengths[0.5] / lengths[1.0] < 2.4, lengths
    default = sum(len(r.audio) for r in await synth(stub, text))  # 0 means 1.0 (durations vary a little)
    assert 0.9 < default / lengths[1.0] < 1.1, (default, lengths)


@pytest.mark.parametrize("encoding", ["ulaw", "alaw"])
async def test_g711_input_is_heard_where_the_speech_is(stub, speaker, encoding):
    """G.711 bytes reach the recogniser as speech with silence around it: one utterance
    whose bounds match where the speech was put (a wrong table turns the silence into
    noise), its words heard and placed where they were said."""
    from rtmedia.engines.audio import resample

    speech = speaker.say(SENTENCES[0], 8000)
    audio = np.concatenate([speaker.silence(1.0, 8000), speech, speaker.silence(1.5, 8000)])
    encoded = getattr(resample, f"float_to_{encoding}")(audio.astype(np.float32) / 32768)
    code = {"ulaw": common_pb2.AUDIO_ENCODING_G711_ULAW, "alaw": common_pb2.AUDIO_ENCODING_G711_ALAW}[encoding]
    finals = [r for r in await transcribe(stub, encoded, 8000, encoding=code) if r.is_final]
    assert len(finals) == 1 and wer(SENTENCES[0], finals[0].text) < 0.1, finals
    speech_end_ms = 1000 + len(speech) * 1000 // 8000
    # The utterance starts with the VAD's prefix padding; its words where they were said.
    assert -700 < finals[0].start_ms - 1000 < 300 and abs(finals[0].end_ms - speech_end_ms) < 900, finals[0]
    assert abs(finals[0].words[0].start_ms - 1000) < 400 and finals[0].words[-1].end_ms < speech_end_ms + 600


async def expect_invalid(call, reason: str, message_part: str):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert message_part in info.value.details()
    assert error_reason(info.value) == reason
    return info.value


@pytest.mark.parametrize("kw,reason,message", [
    ({"text": ""}, "EMPTY_TEXT", "text is empty"),
    ({"text": "   "}, "EMPTY_TEXT", "text is empty"),
    ({"text": "x" * 5001}, "TEXT_TOO_LONG", "text has 5001 characters; the limit is 5000"),
    ({"text": "?! ..."}, "NOTHING_TO_SPEAK", "no letters or digits"),
    ({"text": "hi", "voice": "nobody"}, "UNKNOWN_VOICE", "voice 'nobody' is not known; voices: en_US-joe-medium"),
    ({"text": "hi", "sample_rate": 7}, "UNSUPPORTED_SAMPLE_RATE",
     "sample_rate=7 is not supported by voice en_US-joe-medium; "
     "supported rates: 8000, 16000, 22050, 24000, 44100, 48000"),
    ({"text": "hi", "sample_rate": -16000}, "UNSUPPORTED_SAMPLE_RATE", "sample_rate=-16000 is not supported"),
    ({"text": "hi", "framing": 9}, "BAD_FRAMING", "framing=9"),
    ({"text": "hi", "speed": 0.2}, "BAD_SPEED", "speed=0.2 is out of range: 0.25 to 4"),
    ({"text": "hi", "speed": 4.5}, "BAD_SPEED", "speed=4.5 is out of range"),
    ({"text": "hi", "speed": float("nan")}, "BAD_SPEED", "speed=nan is out of range"),
    ({"text": "hi", "speed": -1}, "BAD_SPEED", "speed=-1 is out of range"),
])
async def test_synthesize_rejects_bad_input(stub, kw, reason, message):
    await expect_invalid(synth(stub, **kw), reason, message)
    assert await synth(stub, "Still serving.")  # the server goes on


async def raw_transcribe(stub, requests):
    async def gen():
        for r in requests:
            yield r

    return [r async for r in stub.Transcribe(gen())]


def cfg(**fmt):
    return speech_pb2.TranscribeRequest(
        config=speech_pb2.TranscribeConfig(audio_format=common_pb2.AudioFormat(**fmt)))


AUDIO = speech_pb2.TranscribeRequest(audio=b"\x00\x00" * 1600)


@pytest.mark.parametrize("requests,reason,message", [
    ([], "EMPTY_STREAM", "ended before its first request"),
    ([AUDIO], "CONFIG_FIRST", "first TranscribeRequest must carry config"),
    ([cfg(sample_rate=16000), AUDIO, cfg(sample_rate=16000)], "CONFIG_TWICE", "request 2 carries config again"),
    ([cfg(sample_rate=44100)], "BAD_SAMPLE_RATE", "audio_format.sample_rate=44100 is not supported"),
    ([cfg(sample_rate=16000, encoding=common_pb2.AUDIO_ENCODING_G711_ULAW)], "BAD_SAMPLE_RATE",
     "sample_rate=16000 is not supported for AUDIO_ENCODING_G711_ULAW; supported: 8000"),
    ([cfg(sample_rate=16000, encoding=7)], "BAD_ENCODING", "encoding=7"),
    ([cfg(sample_rate=16000, channels=2)], "BAD_CHANNELS", "channels=2: only mono"),
    ([cfg(sample_rate=16000), speech_pb2.TranscribeRequest(audio=b"\x00" * 1001)], "BAD_AUDIO",
     "audio in request 1: "),
])
async def test_transcribe_rejects_bad_input(stub, requests, reason, message):
    await expect_invalid(raw_transcribe(stub, requests), reason, message)


async def test_transcribe_refuses_a_language_not_served_naming_those_that_are(stub):
    for other in ("fr-FR", "fr", "french"):
        request = speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
            audio_format=common_pb2.AudioFormat(sample_rate=16000), language=other))
        error = await expect_invalid(raw_transcribe(stub, [request]), "BAD_LANGUAGE",
                                     f"language {other!r} is not served by this recogniser; it serves en "
                                     "(an English-only model)")
        assert error_metadata(error) == {"language": other}


async def test_english_by_code_tag_or_name_is_transcribed_and_each_final_says_its_language(stub, speaker):
    pcm = np.concatenate([speaker.silence(0.5, 16000), speaker.say(SENTENCES[1], 16000),
                          speaker.silence(1.0, 16000)]).tobytes()
    for language in ("en-US", "en", "english"):
        config = speech_pb2.TranscribeConfig(audio_format=common_pb2.AudioFormat(sample_rate=16000),
                                             language=language, disable_partial_results=True)
        assert await raw_transcribe(stub, [speech_pb2.TranscribeRequest(config=config)]) == []  # no audio, no error
    results = await raw_transcribe(stub, [speech_pb2.TranscribeRequest(config=config),
                                          speech_pb2.TranscribeRequest(audio=pcm)])
    assert len(results) == 1 and results[0].language == "en" and wer(SENTENCES[1], results[0].text) < 0.2, results


async def test_describe_recognizer_names_the_model_and_its_languages(stub):
    described = await stub.DescribeRecognizer(speech_pb2.DescribeRecognizerRequest())
    assert (described.name, list(described.languages), described.multilingual) == ("whisper-tiny", ["en"], False)
    assert described.runtime in ("ct2", "torch") and described.compute_type


async def test_a_prompt_over_its_limit_is_refused_and_one_within_it_is_the_context(stub, speaker):
    config = speech_pb2.TranscribeConfig(audio_format=common_pb2.AudioFormat(sample_rate=16000), prompt="a" * 1001)
    await expect_invalid(raw_transcribe(stub, [speech_pb2.TranscribeRequest(config=config)]), "PROMPT_TOO_LONG",
                         "prompt has 1001 characters; at most 1000")
    pcm = np.concatenate([speaker.silence(0.5, 16000), speaker.say(SENTENCES[0], 16000),
                          speaker.silence(1.0, 16000)]).tobytes()
    config.prompt = "The forecast, as we spoke about it this morning."
    finals = [r for r in await raw_transcribe(stub, [speech_pb2.TranscribeRequest(config=config),
                                                     speech_pb2.TranscribeRequest(audio=pcm)]) if r.is_final]
    assert len(finals) == 1 and wer(SENTENCES[0], finals[0].text) < 0.1, finals


async def test_odd_byte_count_names_the_count(stub):
    error = await expect_invalid(
        raw_transcribe(stub, [cfg(sample_rate=16000), speech_pb2.TranscribeRequest(audio=b"\x00" * 1001)]),
        "BAD_AUDIO", "1001")
    assert "1001" in error.details()


async def test_metrics_count_rpcs(server, stub):
    await synth(stub, "Counting.")
    value = server.metrics.registry.get_sample_value(
        "grpc_server_handled_total",
        {"grpc_type": "server_stream", "grpc_service": "rtmedia.v1.SpeechService",
         "grpc_method": "Synthesize", "grpc_code": "OK"})
    assert value and value >= 1
    failed = server.metrics.registry.get_sample_value(
        "grpc_server_handled_total",
        {"grpc_type": "server_stream", "grpc_service": "rtmedia.v1.SpeechService",
         "grpc_method": "Synthesize", "grpc_code": "INVALID_ARGUMENT"})
    assert failed and failed >= 1
    assert server.metrics.registry.get_sample_value("rtmedia_lane_step_seconds_count", {"lane": "tts"}) >= 1


async def test_concurrent_synthesis_does_not_mix_streams(stub):
    import asyncio

    texts = ["First voice stream, alpha.", "Second voice stream, bravo.", "Third voice stream, charlie."]
    results = await asyncio.gather(*(synth(stub, t, sample_rate=16000) for t in texts))
    for text, replies in zip(texts, results, strict=True):
        assert " ".join(r.text for r in replies) == text
