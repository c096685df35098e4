"""NVIDIA's own Riva client library (`nvidia-riva-client`) against the real `rtmedia serve`:
streaming and offline recognition, batch and online synthesis, config queries, rejected options."""

from __future__ import annotations

import io
import itertools
import urllib.request
import wave

import grpc
import numpy as np
import pytest
import riva.client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from riva.client.proto import riva_asr_pb2, riva_tts_pb2
from rtmedia.engines.audio.resample import float_to_ulaw

from tests.support.serve import FEW_SPEAKERS, free_port, running_server
from tests.support.speech import Speaker, wer

pytestmark = pytest.mark.e2e
FIRST = "The quick brown fox jumps over the lazy dog."
SECOND = "Please call me back when you get home tonight."
ASR = "nvidia.riva.asr.RivaSpeechRecognition"
TTS = "nvidia.riva.tts.RivaSpeechSynthesis"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    metrics_port = free_port()
    log = tmp_path_factory.mktemp("riva") / "serve.log"
    with running_server("--no-llm", "--responder", "echo", "--metrics-port", str(metrics_port), log=log,
                        asr_decoders=FEW_SPEAKERS) as (
            target, _):
        auth = riva.client.Auth(uri=target)
        yield {"target": target, "metrics_port": metrics_port, "asr": riva.client.ASRService(auth),
               "tts": riva.client.SpeechSynthesisService(auth)}
        auth.channel.close()


@pytest.fixture(scope="module")
def two_sentences(speaker: Speaker) -> np.ndarray:
    """Two sentences 1.2 s apart, in 0.5 s of silence: int16 at 16 kHz."""
    return np.concatenate([speaker.silence(0.5), speaker.say(FIRST), speaker.silence(1.2), speaker.say(SECOND),
                           speaker.silence(0.5)])


def config(**fields) -> riva.client.RecognitionConfig:
    fields.setdefault("encoding", riva.client.AudioEncoding.LINEAR_PCM)
    fields.setdefault("sample_rate_hertz", 16000)
    fields.setdefault("language_code", "en-US")
    return riva.client.RecognitionConfig(**fields)


def stream(asr, audio: bytes, cfg, interim: bool = True, chunk: int = 3200) -> list:
    chunks = [audio[i:i + chunk] for i in range(0, len(audio), chunk)]
    streaming = riva.client.StreamingRecognitionConfig(config=cfg, interim_results=interim)
    return [result for response in asr.streaming_response_generator(chunks, streaming)
            for result in response.results]


def finals(results) -> list[str]:
    return [r.alternatives[0].transcript for r in results if r.is_final]


def test_streaming_recognition_interim_and_final_results(served, two_sentences) -> None:
    cfg = config(enable_word_time_offsets=True, enable_automatic_punctuation=True)
    results = stream(served["asr"], two_sentences.tobytes(), cfg)
    texts = finals(results)
    assert len(texts) == 2, texts  # the 1.2 s pause ends the first utterance (stop_history 800 ms)
    assert wer(f"{FIRST} {SECOND}", " ".join(texts)) < 0.4, texts
    assert all(t[0].isupper() and t.endswith(".") for t in texts)  # automatic punctuation
    # a final's language: the request's tag, which names the recogniser's language
    assert [list(r.alternatives[0].language_code) for r in results if r.is_final] == [["en-US"]] * 2
    interim = [r for r in results if not r.is_final]
    # interim results come before the first final (a partial decode per 500 ms of new speech,
    # stretched under load; a partial commits the words two decodes agree on), only with words
    assert interim and not results[0].is_final and all(r.alternatives[0].transcript for r in interim)
    # interim text of an utterance only grows until its final
    first_final = next(i for i, r in enumerate(results) if r.is_final)
    texts_before = [r.alternatives[0].transcript for r in results[:first_final]]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts_before))
    # word offsets in ms of the stream: the first sentence starts at 0.5 s, the second after it
    first, second = ([w for w in r.alternatives[0].words] for r in results if r.is_final)
    words = first + second
    assert 300 <= first[0].start_time <= 800, first[0]
    assert second[0].start_time >= first[-1].end_time + 800  # the 1.2 s pause, less endpointing slack
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and all(w.end_time > w.start_time for w in words)
    assert all(0 < w.confidence <= 1 for w in words)


def test_endpointing_config_decides_utterances(served, two_sentences) -> None:
    cfg = config()
    # a stop window longer than the pause between the sentences: one utterance
    riva.client.add_endpoint_parameters_to_config(cfg, 300, 0.2, 2000, -1, 0.95, -1.0)
    texts = finals(stream(served["asr"], two_sentences.tobytes(), cfg, interim=False))
    assert len(texts) == 1 and wer(f"{FIRST} {SECOND}", texts[0]) < 0.4, texts


def test_streaming_mulaw_8k_without_interim_results(served, speaker: Speaker) -> None:
    """G.711 bytes reach the recogniser as speech where it was put, and are heard."""
    speech = speaker.say(SECOND, 8000)
    audio = np.concatenate([speaker.silence(1.0, 8000), speech, speaker.silence(1.2, 8000)])
    cfg = config(encoding=riva.client.AudioEncoding.MULAW, sample_rate_hertz=8000, enable_word_time_offsets=True)
    results = stream(served["asr"], float_to_ulaw(audio.astype(np.float32) / 32768), cfg, interim=False,
                     chunk=800)
    assert len(results) == 1 and results[0].is_final, results
    assert wer(SECOND, results[0].alternatives[0].transcript) < 0.1, results
    assert list(results[0].alternatives[0].language_code) == ["en-US"]
    words = results[0].alternatives[0].words
    speech_end_ms = 1000 + len(speech) * 1000 // 8000
    assert abs(words[0].start_time - 1000) < 400 and abs(words[-1].end_time - speech_end_ms) < 600, words



def test_streaming_at_11025_hz(served, speaker: Speaker) -> None:
    """Half a second at 11025 Hz is not whole samples: the recogniser's pieces are cut at whole
    samples, so the VAD tick (shared by every session) decodes them."""
    audio = np.concatenate([speaker.silence(0.5, 11025), speaker.say(FIRST, 11025), speaker.silence(1.2, 11025)])
    texts = finals(stream(served["asr"], audio.tobytes(), config(sample_rate_hertz=11025), interim=False,
                          chunk=22050))
    assert len(texts) == 1 and wer(FIRST, texts[0]) < 0.5, texts

def test_english_by_tag_code_or_name_and_the_finals_language(served, speaker: Speaker) -> None:
    audio = np.concatenate([speaker.silence(0.3), speaker.say(FIRST), speaker.silence(0.5)]).tobytes()
    for language, said in (("english", "en"), ("en", "en"), ("", "en"), ("EN-us", "EN-us")):
        response = served["asr"].offline_recognize(audio, config(language_code=language))
        alternative = response.results[0].alternatives[0]
        assert wer(FIRST, alternative.transcript) < 0.4 and list(alternative.language_code) == [said], alternative


def test_offline_recognize_raw_and_wav(served, speaker: Speaker, two_sentences) -> None:
    response = served["asr"].offline_recognize(two_sentences.tobytes(), config(enable_word_time_offsets=True))
    texts = [r.alternatives[0].transcript for r in response.results]
    assert len(texts) == 2 and wer(f"{FIRST} {SECOND}", " ".join(texts)) < 0.4, texts
    assert response.results[0].alternatives[0].words
    # a WAV file as read from disk (its header gives the rate: 24 kHz here)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(np.concatenate([speaker.silence(0.3, 24000), speaker.say(FIRST, 24000)]).tobytes())
    response = served["asr"].offline_recognize(buffer.getvalue(), config(sample_rate_hertz=0))
    assert wer(FIRST, " ".join(r.alternatives[0].transcript for r in response.results)) < 0.4


def transcribe(asr, pcm: bytes, rate: int) -> str:
    pad = bytes(rate)  # 0.5 s of silence around the speech
    response = asr.offline_recognize(pad + pcm + pad, config(sample_rate_hertz=rate))
    return " ".join(r.alternatives[0].transcript for r in response.results)


def test_speech_contexts_are_the_recognisers_context(served, speaker: Speaker) -> None:
    audio = np.concatenate([speaker.silence(0.3), speaker.say("send the report to Siobhan Nakamura"),
                            speaker.silence(0.5)]).tobytes()
    plain = finals(stream(served["asr"], audio, config(), interim=False))
    boosted = config()
    riva.client.add_word_boosting_to_config(boosted, ["Siobhan Nakamura", "quarterly report"], 10.0)
    heard = finals(stream(served["asr"], audio, boosted, interim=False))
    assert "siobhan nakamura" not in " ".join(plain) and "siobhan nakamura" in " ".join(heard), (plain, heard)


def test_batch_synthesis_transcribes_back(served) -> None:
    text = "Hello there, this is a test of speech synthesis on the server."
    response = served["tts"].synthesize(text, sample_rate_hz=16000)
    seconds = len(response.audio) / 2 / 16000
    assert 2.0 < seconds < 8.0, seconds
    assert response.meta.text == text
    assert wer(text, transcribe(served["asr"], response.audio, 16000)) < 0.4
    # the client's default rate (22050) is the voice's native rate (VITS durations vary from run to run)
    native = served["tts"].synthesize(text)
    assert abs(len(native.audio) / 2 / 22050 - seconds) < 0.3


def test_online_synthesis_streams_clauses(served) -> None:
    pieces = ["Good morning, my friend. ", "The train to the city ", "leaves at nine tonight."]
    responses = list(served["tts"].synthesize_online(pieces, sample_rate_hz=16000))
    assert len(responses) >= 3  # one per clause, sent as each is synthesised
    assert next(r.meta.text for r in responses if r.meta.text) == "Good morning,"
    audio = b"".join(r.audio for r in responses)
    assert wer("".join(pieces), transcribe(served["asr"], audio, 16000)) < 0.4


def test_config_queries_health_reflection_and_metrics(served) -> None:
    asr_config = served["asr"].stub.GetRivaSpeechRecognitionConfig(riva_asr_pb2.RivaSpeechRecognitionConfigRequest())
    (model,) = asr_config.model_config
    assert model.model_name == "whisper-tiny-en-US-asr-streaming" and model.parameters["engine"] == "whisper-tiny"
    assert model.parameters["type"] == "online" and model.parameters["language_code"] == "en-US"
    assert (model.parameters["languages"], model.parameters["language_detection"]) == ("en", "false")
    tts_config = served["tts"].stub.GetRivaSynthesisConfig(riva_tts_pb2.RivaSynthesisConfigRequest())
    voices = {c.model_name: c.parameters for c in tts_config.model_config}
    assert voices["en_US-joe-medium"]["sample_rate"] == "22050"
    assert "8000" in voices["en_US-joe-medium"]["supported_sample_rates"].split(",")
    with grpc.insecure_channel(served["target"]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in (ASR, TTS):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        listed = {s.name for s in reply.list_services_response.service}
        assert {ASR, TTS} <= listed
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{served['metrics_port']}/metrics", timeout=10).read().decode()
    # Riva calls are counted like every RPC, and ran on the shared ASR and TTS lanes (nothing else used them here)
    assert metric(metrics, "grpc_server_handled_total", grpc_service=ASR, grpc_method="Recognize",
                  grpc_code="OK") >= 1
    assert metric(metrics, "grpc_server_handled_total", grpc_service=TTS, grpc_method="SynthesizeOnline",
                  grpc_code="OK") >= 1
    for lane in ("asr", "tts", "vad"):
        assert metric(metrics, "rtmedia_lane_batch_size_count", lane=lane) >= 1, lane


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _asr_rejections():
    cfg = config
    boosted = config()
    riva.client.add_word_boosting_to_config(boosted, ["fox"], -4.0)
    wordy = config()
    riva.client.add_word_boosting_to_config(wordy, ["a long phrase of names"] * 50, 2.0)
    diarized = config()
    riva.client.add_speaker_diarization_to_config(diarized, True, 2)
    eou = config()
    riva.client.add_endpoint_parameters_to_config(eou, -1, -1, -1, 240, -1, -1)
    long_start = config()
    riva.client.add_endpoint_parameters_to_config(long_start, 5000, -1, -1, -1, -1, -1)
    custom = config()
    riva.client.add_custom_configuration_to_config(custom, "beam:8")
    bad, unimplemented = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED
    return [
        ("flac", cfg(encoding=riva.client.AudioEncoding.FLAC), unimplemented, "encoding=FLAC"),
        ("oggopus", cfg(encoding=riva.client.AudioEncoding.OGGOPUS), unimplemented, "encoding=OGGOPUS"),
        ("rate", cfg(sample_rate_hertz=12345), bad, "sample_rate_hertz=12345"),
        ("no rate", cfg(sample_rate_hertz=0), bad, "sample_rate_hertz=0"),
        ("mulaw rate", cfg(encoding=riva.client.AudioEncoding.MULAW), bad, "sample_rate_hertz=16000"),
        ("language", cfg(language_code="de-DE"), bad,
         "language_code 'de-DE' is not served by this recogniser; it serves en (an English-only model)"),
        ("model", cfg(model="conformer-en-US-asr-streaming"), bad, "model="),
        ("profanity", cfg(profanity_filter=True), unimplemented, "profanity_filter"),
        ("negative boosting", boosted, unimplemented, "speech_contexts[0].boost=-4"),
        ("long contexts", wordy, bad, "speech_contexts hold 1198 characters of phrases; at most 1000"),
        ("channels", cfg(audio_channel_count=2), unimplemented, "audio_channel_count=2"),
        ("per channel", cfg(enable_separate_recognition_per_channel=True), unimplemented,
         "enable_separate_recognition_per_channel"),
        ("diarization", diarized, unimplemented, "enable_speaker_diarization"),
        ("custom", custom, bad, "custom_configuration keys are not supported by rtmedia's models: beam"),
        ("eou", eou, unimplemented, "endpointing_config.stop_history_eou"),
        ("start history", long_start, bad, "endpointing_config.start_history=5000"),
    ]


@pytest.mark.parametrize(("cfg", "code", "names"), [r[1:] for r in _asr_rejections()],
                         ids=[r[0] for r in _asr_rejections()])
def test_rejected_recognition_options(served, cfg, code, names) -> None:
    audio = bytes(3200)
    with pytest.raises(grpc.RpcError) as offline:
        served["asr"].offline_recognize(audio, cfg)
    with pytest.raises(grpc.RpcError) as streaming:
        stream(served["asr"], audio, cfg)
    for error in (offline.value, streaming.value):
        assert error.code() == code and names in error.details(), (error.code(), error.details())


def test_rejected_streaming_requests(served) -> None:
    streaming = riva.client.StreamingRecognitionConfig(config=config(), interim_results=True)
    cases = [
        ([riva_asr_pb2.StreamingRecognizeRequest(audio_content=bytes(320))], grpc.StatusCode.INVALID_ARGUMENT,
         "must carry streaming_config"),
        ([riva_asr_pb2.StreamingRecognizeRequest(streaming_config=streaming),
          riva_asr_pb2.StreamingRecognizeRequest(streaming_config=streaming)], grpc.StatusCode.INVALID_ARGUMENT,
         "request 1 carries streaming_config again"),
        ([riva_asr_pb2.StreamingRecognizeRequest(streaming_config=streaming),
          riva_asr_pb2.StreamingRecognizeRequest(audio_content=bytes(320), runtime_config={"x": "1"})],
         grpc.StatusCode.UNIMPLEMENTED, "runtime_config"),
        ([riva_asr_pb2.StreamingRecognizeRequest(streaming_config=streaming),
          riva_asr_pb2.StreamingRecognizeRequest(audio_content=bytes(321))], grpc.StatusCode.INVALID_ARGUMENT,
         "not whole 16-bit samples"),
    ]
    for requests, code, names in cases:
        with pytest.raises(grpc.RpcError) as error:
            list(served["asr"].stub.StreamingRecognize(iter(requests)))
        assert error.value.code() == code and names in error.value.details(), error.value.details()


TTS_REJECTIONS = [
    ("oggopus", {"encoding": riva.client.AudioEncoding.OGGOPUS}, grpc.StatusCode.UNIMPLEMENTED, "encoding=OGGOPUS"),
    ("rate", {"sample_rate_hz": 7}, grpc.StatusCode.INVALID_ARGUMENT,
     "sample_rate_hz: sample_rate=7 is not supported by voice en_US-joe-medium; supported rates: "
     "8000, 16000, 22050, 24000, 44100, 48000"),
    ("voice", {"voice_name": "English-US.Female-1"}, grpc.StatusCode.INVALID_ARGUMENT,
     "voice_name: voice 'English-US.Female-1' is not known"),
    ("language", {"language_code": "fr-FR"}, grpc.StatusCode.INVALID_ARGUMENT, "language_code='fr-FR'"),
    ("dictionary", {"custom_dictionary": {"tomato": "t ah m aa t ow"}}, grpc.StatusCode.UNIMPLEMENTED,
     "custom_dictionary"),
    ("custom", {"custom_configuration": {"exaggeration_factor": "1.5"}}, grpc.StatusCode.INVALID_ARGUMENT,
     "custom_configuration keys are not supported by rtmedia's models: exaggeration_factor"),
    ("word offsets", {"enable_word_time_offsets": True}, grpc.StatusCode.UNIMPLEMENTED, "enable_word_time_offsets"),
]


@pytest.mark.parametrize(("options", "code", "names"), [r[1:] for r in TTS_REJECTIONS],
                         ids=[r[0] for r in TTS_REJECTIONS])
def test_rejected_synthesis_options(served, options, code, names) -> None:
    with pytest.raises(grpc.RpcError) as batch:
        served["tts"].synthesize("Hello.", **options)
    with pytest.raises(grpc.RpcError) as online:
        list(served["tts"].synthesize_online("Hello.", **options))
    for error in (batch.value, online.value):
        assert error.code() == code and names in error.details(), (error.code(), error.details())


def test_rejected_synthesis_requests(served) -> None:
    tts = served["tts"]
    with pytest.raises(grpc.RpcError) as empty:
        tts.synthesize("   ")
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text is empty" in empty.value.details()
    zero_shot = riva_tts_pb2.SynthesizeSpeechRequest(text="Hello.", zero_shot_data=riva_tts_pb2.ZeroShotData(
        audio_prompt=bytes(3200)))
    with pytest.raises(grpc.RpcError) as cloned:
        tts.stub.Synthesize(zero_shot)
    assert cloned.value.code() == grpc.StatusCode.UNIMPLEMENTED and "zero_shot_data" in cloned.value.details()
    changed = [riva_tts_pb2.SynthesizeSpeechRequest(text="Hello, ", sample_rate_hz=16000),
               riva_tts_pb2.SynthesizeSpeechRequest(text="world.", sample_rate_hz=8000)]
    with pytest.raises(grpc.RpcError) as switched:
        list(tts.stub.SynthesizeOnline(iter(changed)))
    assert switched.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 1 changes the synthesis settings" in switched.value.details()
