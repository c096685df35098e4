"""What the server hears, on every door: Piper questions at 16 kHz, as 8 kHz μ-law (a phone
line) and as a 16 kbps mp3, through a Converse turn, `Transcribe`, Riva's streaming recognition,
`/v1/audio/transcriptions` (json, verbose_json with words, srt) and a `/v1/realtime`
transcription session. The bound (WER ≤ 0.1 over the questions) is one the default recogniser
keeps and PocketSphinx failed (8 kHz μ-law 0.78, mp3 0.83, clean 0.2 to 0.4)."""

from __future__ import annotations

import asyncio
import base64
import io

import av
import numpy as np
import pytest
from riva.client.proto import riva_asr_pb2, riva_asr_pb2_grpc, riva_audio_pb2
from rtmedia.engines.audio.resample import float_to_ulaw
from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

from tests.support.converse import Conversation
from tests.support.speech import wer

QUESTIONS = ("how many minutes does it take to boil an egg", "how many legs does a spider have",
             "what is the capital of france")
CONDITIONS = ("pcm16k", "ulaw8k", "mp3")
# Over the three questions; the mp3's a word more: tiny.en hears its "a spider" as "the spider"
# or "this fighter" depending on the silence before it, on a full 30 s window too.
BOUND = {"pcm16k": 0.1, "ulaw8k": 0.1, "mp3": 0.2}


def said(speaker, condition: str, text: str) -> tuple[bytes, int]:
    """`text` with 0.5 s of silence before and 1 s after, as (bytes, rate): PCM16 at 16 kHz,
    μ-law at 8 kHz, or the PCM16 at 16 kHz decoded from a 16 kbps mp3 of it."""
    rate = 8000 if condition == "ulaw8k" else 16000
    pcm = np.concatenate([speaker.silence(0.5, rate), speaker.say(text, rate), speaker.silence(1.0, rate)])
    if condition == "ulaw8k":
        return float_to_ulaw(pcm.astype(np.float32) / 32768), rate
    if condition == "mp3":
        pcm = decoded(mp3_file(pcm, rate))
    return pcm.astype("<i2").tobytes(), rate


def mp3_file(pcm: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=rate, layout="mono")
        stream.bit_rate = 16000
        frame = av.AudioFrame.from_ndarray(pcm.astype("<i2")[None], format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return out.getvalue()


def decoded(mp3: bytes) -> np.ndarray:
    resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
    with av.open(io.BytesIO(mp3)) as container:
        return np.concatenate([f.to_ndarray()[0] for frame in container.decode(audio=0)
                               for f in resampler.resample(frame)])


def heard_well(texts: list[str], condition: str) -> None:
    import jiwer

    from tests.support.speech import normalise

    error = jiwer.wer([normalise(q) for q in QUESTIONS], [normalise(t) or "<empty>" for t in texts])
    assert error <= BOUND[condition], list(zip(QUESTIONS, texts, strict=True))


@pytest.mark.parametrize("condition", CONDITIONS)
async def test_a_converse_turn(channel, speaker, condition):
    texts = []
    async with Conversation(channel) as c:
        if condition == "ulaw8k":
            c.send("session.update", session={"input_audio_format": {"encoding": "g711_ulaw", "sample_rate": 8000}})
        else:
            c.send("session.update", session={"input_audio_format": {"encoding": "pcm16", "sample_rate": 16000}})
        await c.wait_for("session.updated")
        for n, question in enumerate(QUESTIONS, 1):
            audio, rate = said(speaker, condition, question)
            await c.stream(audio, rate, speed=4.0, bytes_per_sample=1 if condition == "ulaw8k" else 2)
            completed = await c.wait_for("conversation.item.input_audio_transcription.completed", count=n,
                                         timeout=30)
            texts.append(completed["transcript"])
            spelled = b"".join(base64.b64decode(t["bytes"]) for t in completed["tokens"]).decode()
            assert spelled.strip() == completed["transcript"] and all(t["logprob"] <= 0 for t in completed["tokens"])
            await c.wait_for("response.done", count=n, timeout=30)
    heard_well(texts, condition)


@pytest.mark.parametrize("condition", CONDITIONS)
async def test_transcribe(server, channel, speaker, condition):
    pieces = [said(speaker, condition, q) for q in QUESTIONS]
    rate = pieces[0][1]
    encoding = common_pb2.AUDIO_ENCODING_G711_ULAW if condition == "ulaw8k" else common_pb2.AUDIO_ENCODING_PCM16
    audio = b"".join(p for p, _ in pieces)

    async def requests():
        yield speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
            audio_format=common_pb2.AudioFormat(encoding=encoding, sample_rate=rate)))
        for i in range(0, len(audio), rate // 5):
            yield speech_pb2.TranscribeRequest(audio=audio[i:i + rate // 5])

    stub = speech_pb2_grpc.SpeechServiceStub(channel)
    decodes = server.metrics.registry.get_sample_value("rtmedia_asr_decodes_total", {"kind": "final"}) or 0
    finals = [r async for r in stub.Transcribe(requests()) if r.is_final and r.text]
    heard_well([f.text for f in finals], condition)
    assert all(b"".join(t.bytes for t in f.tokens).decode().strip() == f.text for f in finals)
    assert all(0 <= f.no_speech_prob < 0.5 for f in finals)
    assert server.metrics.registry.get_sample_value("rtmedia_asr_decodes_total", {"kind": "final"}) >= decodes + 3
    assert [f.utterance_index for f in finals] == [0, 1, 2]
    assert all(f.words and f.start_ms <= f.words[0].start_ms <= f.words[-1].end_ms <= f.end_ms for f in finals)


@pytest.mark.parametrize("condition", CONDITIONS)
async def test_riva_streaming_recognition(channel, speaker, condition):
    pieces = [said(speaker, condition, q) for q in QUESTIONS]
    rate = pieces[0][1]
    audio = b"".join(p for p, _ in pieces)
    config = riva_asr_pb2.RecognitionConfig(
        encoding=riva_audio_pb2.MULAW if condition == "ulaw8k" else riva_audio_pb2.LINEAR_PCM,
        sample_rate_hertz=rate, language_code="en-US", enable_word_time_offsets=True)

    async def requests():
        yield riva_asr_pb2.StreamingRecognizeRequest(
            streaming_config=riva_asr_pb2.StreamingRecognitionConfig(config=config, interim_results=True))
        for i in range(0, len(audio), rate // 5):
            yield riva_asr_pb2.StreamingRecognizeRequest(audio_content=audio[i:i + rate // 5])

    stub = riva_asr_pb2_grpc.RivaSpeechRecognitionStub(channel)
    results = [r for response in [x async for x in stub.StreamingRecognize(requests())] for r in response.results]
    finals = [r.alternatives[0] for r in results if r.is_final]
    heard_well([f.transcript for f in finals], condition)
    # Without automatic punctuation Riva's transcripts are lowercase words.
    assert all(f.transcript == f.transcript.lower() and "?" not in f.transcript for f in finals)
    assert all(w.word.isalpha() or "'" in w.word for f in finals for w in f.words)


@pytest.mark.parametrize("condition,response_format", [("pcm16k", "json"), ("ulaw8k", "verbose_json"),
                                                       ("mp3", "srt")])
async def test_openai_transcriptions(openai_client, speaker, condition, response_format):
    rate = 8000 if condition == "ulaw8k" else 16000
    pcm = np.concatenate([np.concatenate([speaker.silence(0.5, rate), speaker.say(q, rate), speaker.silence(1.0, rate)])
                          for q in QUESTIONS])
    if condition == "mp3":
        upload = ("questions.mp3", mp3_file(pcm, rate))
    else:
        out = io.BytesIO()  # a WAV file, μ-law coded for the phone line
        with av.open(out, "w", format="wav") as container:
            stream = container.add_stream("pcm_mulaw" if condition == "ulaw8k" else "pcm_s16le", rate=rate,
                                          layout="mono")
            frame = av.AudioFrame.from_ndarray(pcm.astype("<i2")[None], format="s16", layout="mono")
            frame.sample_rate = rate
            for packet in [*stream.encode(frame), *stream.encode(None)]:
                container.mux(packet)
        upload = ("questions.wav", out.getvalue())
    extra = {"timestamp_granularities": ["word", "segment"]} if response_format == "verbose_json" else {
        "prompt": "Questions about cooking, spiders and France. " * 40}  # more than the 1000 characters kept
    answer = await openai_client.audio.transcriptions.create(
        model="whisper-1", file=upload, response_format=response_format, **extra)
    if response_format == "json":
        assert wer(" ".join(QUESTIONS), answer.text) <= BOUND[condition], answer.text
    elif response_format == "verbose_json":
        heard_well([s.text for s in answer.segments], condition)
        words = [w.word for w in answer.words]
        assert wer(" ".join(QUESTIONS), " ".join(words)) <= BOUND[condition], words
        assert all(a.end <= b.start + 0.05 for a, b in zip(answer.words, answer.words[1:], strict=False))
    else:
        cues = [block.split("\n", 2)[2] for block in answer.strip().split("\n\n")]
        heard_well(cues, condition)


@pytest.mark.parametrize("condition", CONDITIONS)
async def test_a_realtime_transcription_session(openai_client, speaker, condition):
    fmt = {"type": "audio/pcmu"} if condition == "ulaw8k" else {"type": "audio/pcm", "rate": 24000}
    async with openai_client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        include = ["item.input_audio_transcription.logprobs"] if condition == "pcm16k" else None
        await conn.session.update(session={"type": "transcription", "include": include, "audio": {"input": {
            "format": fmt, "transcription": {"model": "gpt-4o-transcribe", "language": "en"}}}})
        texts = []
        while len(texts) < len(QUESTIONS):
            event = await asyncio.wait_for(conn.recv(), 60)
            if event.type == "session.updated":
                for question in QUESTIONS:
                    audio, _ = said(speaker, condition, question)
                    step = 800 if condition == "ulaw8k" else 4800  # 100 ms (the API's PCM is 24 kHz)
                    if condition != "ulaw8k":
                        audio = upsampled(audio)
                    for i in range(0, len(audio), step):  # four times real time
                        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + step]).decode())
                        await asyncio.sleep(0.025)
            elif event.type == "conversation.item.input_audio_transcription.completed":
                texts.append(event.transcript)
                if include:
                    assert "".join(p.token for p in event.logprobs).strip() == event.transcript
                    assert all(p.logprob <= 0 and bytes(map(int, p.bytes)).decode() == p.token for p in event.logprobs)
                else:
                    assert event.logprobs is None
            elif event.type == "error":
                raise AssertionError(event.error)
    heard_well(texts, condition)


def upsampled(pcm16k: bytes) -> bytes:
    from rtmedia.engines.audio.resample import float_to_pcm16, make_resampler, pcm16_to_float

    resampler = make_resampler(16000, 24000)
    return float_to_pcm16(np.concatenate([resampler.process(pcm16_to_float(pcm16k)), resampler.flush()]))
