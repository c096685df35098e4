"""The text-splitting rule of docs/protocol.md#streaming-tts and the voice catalogue."""

from __future__ import annotations

import pytest
from rtmedia.engines.tts.piper import default_voices, unsupported_rate_message, voice_from_path
from rtmedia.engines.tts.text_chunks import CHUNK_MAX_WORDS, split_text


@pytest.mark.parametrize("text,chunks", [
    ("Hello there, how are you today? Fine.", ["Hello there,", "how are you today?", "Fine."]),
    ("one two three four five six seven eight nine ten", ["one two three", "four five six seven eight nine ten"]),
    ("one two three four five six seven, eight", ["one two three", "four five six seven,", "eight"]),
    ("Wait; what: really! Yes.", ["Wait;", "what:", "really!", "Yes."]),
    ('He said "stop." Then left.', ['He said "stop."', "Then left."]),
    ("Pi is 3.14 roughly, they say", ["Pi is 3.14", "roughly,", "they say"]),
    ("  spaced   out   words  ", ["spaced out words"]),
    ("... hello", ["hello"]),
    ("", []),
    ("?! ...", []),
])
def test_split_text(text, chunks):
    assert split_text(text) == chunks


def test_first_chunk_ends_at_three_words_later_chunks_at_clauses():
    words = [f"w{i}" for i in range(20)]
    chunks = split_text(" ".join(words[:10]) + ", " + " ".join(words[10:]) + ".")
    assert chunks[0].split() == words[:3]
    assert chunks[1].split() == [*words[3:9], words[9] + ","]
    assert chunks[2].split()[-1] == "w19."


def test_long_clauses_are_cut():
    chunks = split_text("word " * 100)
    assert max(len(c.split()) for c in chunks) == CHUNK_MAX_WORDS
    assert sum(len(c.split()) for c in chunks) == 100


def test_embedded_voice_and_rate_message():
    (voice,) = default_voices()
    assert voice.name == "en_US-joe-medium" and voice.native_rate == 22050 and voice.language == "en-US"
    assert unsupported_rate_message(7, voice) == (
        "sample_rate=7 is not supported by voice en_US-joe-medium; "
        "supported rates: 8000, 16000, 22050, 24000, 44100, 48000"
    )


def test_local_voice_needs_its_config(tmp_path):
    model = tmp_path / "x.onnx"
    model.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"x\.onnx\.json"):
        voice_from_path(model)


@pytest.mark.parametrize("text", [
    "Hello there, how are you today? Fine.",
    "one two three four five six seven eight nine ten",
    "You said: the weather is nice, and the sky is blue today. Goodbye!",
])
def test_streamed_text_chunks_like_the_whole_text(text):
    from rtmedia.engines.tts.text_chunks import TextChunker

    for step in (1, 2, 3, 7):
        chunker = TextChunker()
        chunks = []
        for i in range(0, len(text), step):
            chunks += chunker.feed(text[i:i + step])
        assert chunks + chunker.flush() == split_text(text), step


def test_a_streamed_clause_ends_when_its_punctuation_arrives():
    from rtmedia.engines.tts.text_chunks import TextChunker

    chunker = TextChunker()
    assert chunker.feed("Paris, the capital of France") == ["Paris,"]
    assert chunker.feed(".") == ["the capital of France."]
    assert chunker.feed(" Pi is 3.") == [] and chunker.feed("14, roughly") == ["Pi is 3.14,"]
    assert chunker.feed(" in the U.") == [] and chunker.feed("S.") == []  # "U.S." may go on
    assert chunker.flush() == ["roughly in the U.S."]
