"""Riva-style history-window endpointing over VAD windows, the Riva option checks, and `--no-riva`."""

from __future__ import annotations

import grpc
import pytest
from riva.client.proto import riva_asr_pb2, riva_audio_pb2
from rtmedia.engines.asr.contract import AsrEvent
from rtmedia.server.app import RtmediaServer
from rtmedia.server.cli import build_parser
from rtmedia.server.config import ServerConfig
from rtmedia.server.hearing.endpointing import START_MARGIN_MS, HistoryEndpointer
from rtmedia.server.hearing.turns import WINDOW_MS, TurnEvent
from rtmedia.server.services.riva_asr import (
    RecognitionOptions,
    Rejected,
    plain,
    punctuate,
    result_language,
    riva_model,
)


def run(endpointer: HistoryEndpointer, probs: list[float]) -> list[tuple[int, TurnEvent]]:
    return [(i, ev) for i, p in enumerate(probs) if (ev := endpointer.push(p)) is not None]


def test_windows_and_padding_follow_the_histories() -> None:
    ep = HistoryEndpointer(start_history=300, start_threshold=0.2, stop_history=800, stop_threshold=0.98)
    assert (ep.start_windows, ep.start_needed) == (10, 2)  # 300 ms -> 10 windows of 32 ms, 20 % of them
    assert (ep.stop_windows, ep.stop_needed) == (25, 25)  # 800 ms -> 25 windows, 98 % -> all 25
    assert ep.prefix_padding_ms == 10 * WINDOW_MS + START_MARGIN_MS


def test_start_needs_the_fraction_of_voiced_windows_and_dates_from_the_first() -> None:
    ep = HistoryEndpointer(start_history=320, start_threshold=0.3, stop_history=320, stop_threshold=1.0)
    # 10-window history, 3 voiced needed: two isolated voiced windows do not start speech
    probs = [0.0] * 5 + [0.9] + [0.0] * 9 + [0.9] + [0.0] * 10
    assert run(ep, probs) == []
    ep.reset()
    probs = [0.0] * 5 + [0.9, 0.1, 0.8, 0.2, 0.7] + [0.9] * 5 + [0.0] * 10
    events = run(ep, probs)
    # the third voiced window (index 9) decides; the start is the first voiced one (index 5)
    assert events[0] == (9, TurnEvent("speech_started", 5 * WINDOW_MS))
    # 10 blank windows end it; the end is the end of the last voiced window (index 14)
    assert events[1] == (24, TurnEvent("speech_stopped", 15 * WINDOW_MS))


def test_stop_threshold_tolerates_voiced_windows_in_the_pause() -> None:
    # 5-window start history needing 3 voiced (a lone blip never starts speech); 10-window stop history
    strict = HistoryEndpointer(start_history=160, start_threshold=0.6, stop_history=320, stop_threshold=1.0)
    lenient = HistoryEndpointer(start_history=160, start_threshold=0.6, stop_history=320, stop_threshold=0.8)
    # speech, then a pause with a voiced blip every 5th window
    probs = [0.9] * 10 + ([0.0] * 4 + [0.9]) * 6
    assert [ev for _, ev in run(strict, probs)] == [TurnEvent("speech_started", 0)]
    # windows 9..18 hold 8 blank ones at window 18; the last voiced one before it is the blip at 14
    assert run(lenient, probs) == [(2, TurnEvent("speech_started", 0)),
                                   (18, TurnEvent("speech_stopped", 15 * WINDOW_MS))]


@pytest.mark.parametrize(("field", "value"), [("start_history", 5000), ("start_history", 0),
                                              ("stop_threshold", 0.0), ("stop_history", 6000),
                                              ("start_threshold", 1.5)])
def test_out_of_bounds_settings_are_named(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"endpointing_config\.{field}="):
        HistoryEndpointer(**{field: value})


MODEL = riva_model("whisper-tiny")


def test_recognition_options_defaults_and_endpointing() -> None:
    config = riva_asr_pb2.RecognitionConfig(sample_rate_hertz=44100, language_code="en-US")
    config.endpointing_config.stop_history = 1200
    options = RecognitionOptions.from_config(config, MODEL)
    assert options.sample_rate == 44100 and options.endpointing["stop_history"] == 1200
    assert options.endpointing["start_history"] == 300  # unset fields keep Riva's defaults
    config.endpointing_config.stop_threshold = 0
    with pytest.raises(Rejected) as rejected:
        RecognitionOptions.from_config(config, MODEL)
    assert rejected.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "endpointing_config.stop_threshold=0" in rejected.value.message


def test_wav_rate_must_agree_with_the_config() -> None:
    config = riva_asr_pb2.RecognitionConfig(encoding=riva_audio_pb2.LINEAR_PCM, sample_rate_hertz=16000)
    assert RecognitionOptions.from_config(config, MODEL, wav_rate=16000).sample_rate == 16000
    with pytest.raises(Rejected, match="differs from the WAV header's 24000 Hz"):
        RecognitionOptions.from_config(config, MODEL, wav_rate=24000)


def test_the_language_code_is_one_the_recogniser_serves_and_the_finals_say_theirs() -> None:
    config = riva_asr_pb2.RecognitionConfig(sample_rate_hertz=16000, language_code="fr-FR")
    with pytest.raises(Rejected) as rejected:
        RecognitionOptions.from_config(config, MODEL)  # English-only
    assert (rejected.value.code, rejected.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNSUPPORTED_LANGUAGE")
    assert rejected.value.message == ("language_code 'fr-FR' is not served by this recogniser; it serves en "
                                      "(an English-only model)")
    for code in ("en-US", "en", "english", ""):
        config.language_code = code
        assert RecognitionOptions.from_config(config, MODEL).language == ("en" if code else "")
    multi = riva_model("whisper-small", ("en", "fr"))
    assert (MODEL, multi) == ("whisper-tiny-en-US-asr-streaming", "whisper-small-multi-asr-streaming")
    config.language_code = "fr-FR"
    options = RecognitionOptions.from_config(config, multi, languages=("en", "fr"))
    assert (options.language, options.language_code) == ("fr", "fr-FR")
    assert result_language(options, AsrEvent(0, True, "bonjour", "", 0, 500, language="fr")) == ["fr-FR"]
    config.language_code = "french"  # a name: the recogniser's code
    options = RecognitionOptions.from_config(config, multi, languages=("en", "fr"))
    assert result_language(options, AsrEvent(0, True, "bonjour", "", 0, 500, language="fr")) == ["fr"]
    config.language_code = ""  # detected: the recogniser's code
    options = RecognitionOptions.from_config(config, multi, languages=("en", "fr"))
    assert result_language(options, AsrEvent(0, True, "hello", "", 0, 500, language="en")) == ["en"]
    assert result_language(options, AsrEvent(0, True, "", "", 0, 500)) == []


def test_punctuation_is_the_recognisers_else_sentence_case_and_a_period() -> None:
    assert punctuate("hello world") == "Hello world."
    assert punctuate("How many legs does a spider have?") == "How many legs does a spider have?"
    assert punctuate("") == ""
    assert plain("How many legs, does it have?") == "how many legs does it have"


def test_no_riva_flag_maps_onto_the_config() -> None:
    args = build_parser().parse_args(["serve", "--no-riva"])
    assert args.riva is False
    assert ServerConfig.load(riva=args.riva).network.riva is False
    assert ServerConfig.load(riva=build_parser().parse_args(["serve"]).riva).network.riva is True
    # health and reflection list (and start() registers) the Riva services only when on
    riva = {"nvidia.riva.asr.RivaSpeechRecognition", "nvidia.riva.tts.RivaSpeechSynthesis"}
    for on in (True, False):
        server = RtmediaServer(ServerConfig.of(riva=on, llm=False, default_responder="echo"))
        assert (riva <= set(server.services)) is on and "rtmedia.v1.SpeechService" in server.services
