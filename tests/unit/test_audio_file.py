"""Audio files on the client side (rtmedia.clients.audio_file): every container and codec in, at
any rate and channel count (test files made by tests/support/audio_files.py, PyAV's encoders on
their own path); every output format written and decoded back by PyAV directly; standard input
and output; and each mistake as an AudioFileError naming the file."""

from __future__ import annotations

import io
import sys

import av
import numpy as np
import pytest
from rtmedia.clients.audio_file import (
    EXTENSIONS,
    FORMATS,
    OPUS_RATE,
    Audio,
    AudioFileError,
    AudioWriter,
    read_audio,
    resample,
    write_audio,
)
from rtmedia.clients.commands.cli import CliError
from rtmedia.clients.loadtest.speech import audio_files, load_clips

from tests.support.audio_files import KINDS, encode, video_only

SECONDS = 1.5


def speech_like(rate: int, seconds: float = SECONDS) -> np.ndarray:
    """A voiced-speech stand-in: a 200 Hz buzz with harmonics under a syllable-rate envelope."""
    t = np.arange(int(rate * seconds)) / rate
    buzz = sum(np.sin(2 * np.pi * 200 * k * t) / k for k in (1, 2, 3))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)
    return (buzz * envelope * 6000).astype(np.int16)


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64)))
    return float(np.argmax(spectrum) * rate / len(samples))


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(samples.astype(np.float64) ** 2)))


def slack_s(codec_format: str, rate: int) -> float:
    """How much longer a decoded file may be than its samples: the codec's priming and last frame."""
    frame = {"mp3": 1152, "m4a": 1024}.get(codec_format)
    if frame is not None:
        return 2.5 * frame / rate
    return 0.03 if codec_format in ("ogg", "opus", "webm") else 1 / rate


def decoded(path_or_bytes: object) -> tuple[str, int, np.ndarray]:
    """A file decoded by PyAV itself: (codec, rate, samples of its first channel as int16)."""
    source = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else str(path_or_bytes)
    with av.open(source) as container:
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="s16", layout="mono", rate=stream.rate)
        frames = [out for f in container.decode(stream) for out in resampler.resample(f)]
        frames += resampler.resample(None)
        data = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]) if frames else np.zeros(0, np.int16)
        return stream.codec_context.name, stream.rate, data


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("rate", "channels"), [(8000, 1), (44100, 2), (48000, 1)])
def test_every_container_reads_as_mono_at_its_rate(kind, rate, channels, tmp_path) -> None:
    source = speech_like(rate)
    path = tmp_path / f"speech.{kind}"
    path.write_bytes(encode(source, rate, kind, channels))
    audio = read_audio(path)
    file_rate = KINDS[kind].codec_rate or rate
    assert audio.sample_rate == file_rate and audio.samples.dtype == np.int16 and audio.samples.ndim == 1
    assert SECONDS - 1 / rate <= audio.seconds <= SECONDS + slack_s(kind, rate), audio.seconds
    # the buzz is still there, at the level of the channels' mean (stereo's right one is 3/4 as loud)
    level = rms(source) * (7 / 8 if channels == 2 else 1)
    assert abs(rms(audio.samples) / level - 1) < 0.12
    assert abs(peak_hz(audio.samples, audio.sample_rate) - 200) < 5
    at16 = read_audio(path, 16000)
    assert at16.sample_rate == 16000 and abs(at16.seconds - audio.seconds) < 0.01
    assert abs(peak_hz(at16.samples, 16000) - 200) < 5


def test_lossless_stereo_is_the_mean_of_its_channels(tmp_path) -> None:
    left = speech_like(16000)
    right = (left.astype(np.int32) * 3 // 4).astype(np.int16)
    for kind in ("wav", "flac"):
        path = tmp_path / f"stereo.{kind}"
        path.write_bytes(encode(left, 16000, kind, channels=2))
        mean = (left.astype(np.int32) + right) / 2
        assert np.abs(read_audio(path).samples - mean).max() <= 1


@pytest.mark.parametrize("ext", [e for e in EXTENSIONS if EXTENSIONS[e] != "pcm"])
def test_writer_writes_the_format_its_extension_names(ext, tmp_path) -> None:
    rate = 22050
    source = speech_like(rate)
    path = tmp_path / f"out{ext}"
    with AudioWriter(path, rate) as writer:
        for offset in range(0, len(source), 1000):  # chunk by chunk, as synth gets them
            writer.write(source[offset:offset + 1000].tobytes())
    fmt = EXTENSIONS[ext]
    codec, file_rate, samples = decoded(path)
    assert codec == {"wav": "pcm_s16le", "mp3": "mp3float", "ogg": "opus", "opus": "opus", "flac": "flac",
                     "m4a": "aac"}[fmt]
    assert file_rate == writer.file_rate == (OPUS_RATE if fmt in ("ogg", "opus") else rate)
    assert writer.seconds == pytest.approx(SECONDS, abs=1 / rate)
    seconds = len(samples) / file_rate
    assert SECONDS - 0.01 <= seconds <= SECONDS + slack_s(fmt, rate), seconds
    assert abs(peak_hz(samples, file_rate) - 200) < 5
    if fmt in ("wav", "flac"):
        assert np.array_equal(samples, source)


def test_format_overrides_the_extension_and_rates_a_codec_lacks_are_raised(tmp_path) -> None:
    source = speech_like(22050)
    write_audio(tmp_path / "speech.bin", source.tobytes(), 22050, "mp3")
    assert decoded(tmp_path / "speech.bin")[:2] == ("mp3float", 22050)
    with AudioWriter(tmp_path / "odd.m4a", 23000) as writer:  # AAC has no 23 kHz: the next rate up
        writer.write(speech_like(23000).tobytes())
    assert writer.file_rate == 24000 and decoded(tmp_path / "odd.m4a")[1] == 24000
    write_audio(tmp_path / "raw.pcm", source.tobytes(), 22050)
    assert (tmp_path / "raw.pcm").read_bytes() == source.tobytes()


class _Stdio(io.TextIOWrapper):
    def isatty(self) -> bool:
        return False


def _stdio(data: bytes = b"") -> tuple[_Stdio, io.BytesIO]:
    buffer = io.BytesIO(data)
    return _Stdio(buffer), buffer


def test_stdout_gets_raw_pcm_or_a_streamed_container(monkeypatch) -> None:
    source = speech_like(16000)
    out, buffer = _stdio()
    monkeypatch.setattr(sys, "stdout", out)
    write_audio("-", source.tobytes(), 16000)
    assert buffer.getvalue() == source.tobytes()
    for fmt, codec in (("mp3", "mp3float"), ("m4a", "aac"), ("ogg", "opus"), ("flac", "flac"), ("wav", "pcm_s16le")):
        out, buffer = _stdio()
        monkeypatch.setattr(sys, "stdout", out)
        write_audio("-", source.tobytes(), 16000, fmt)
        got, rate, samples = decoded(buffer.getvalue())
        # a stream cannot be seeked back to note the codec's priming: an AAC stream keeps it
        assert got == codec and abs(len(samples) / rate - SECONDS) < 0.15, fmt


def test_stdin_is_raw_pcm_with_a_rate_else_a_file(monkeypatch) -> None:
    source = speech_like(22050)
    monkeypatch.setattr(sys, "stdin", _stdio(source.tobytes())[0])
    audio = read_audio("-", raw_rate=22050)
    assert audio.sample_rate == 22050 and np.array_equal(audio.samples, source)
    monkeypatch.setattr(sys, "stdin", _stdio(source.tobytes())[0])
    assert read_audio("-", 16000, raw_rate=22050).sample_rate == 16000
    monkeypatch.setattr(sys, "stdin", _stdio(encode(source, 22050, "m4a"))[0])  # MP4 needs seeking: buffered
    audio = read_audio("-")
    assert audio.sample_rate == 22050 and abs(audio.seconds - SECONDS) < 0.2
    monkeypatch.setattr(sys, "stdin", _stdio(b"")[0])
    with pytest.raises(AudioFileError, match=r"^standard input is empty$"):
        read_audio("-")
    monkeypatch.setattr(sys, "stdin", _stdio(b"\x01\x02\x03")[0])
    with pytest.raises(AudioFileError, match=r"^standard input: 3 bytes is not whole PCM16 samples$"):
        read_audio("-", raw_rate=16000)
    monkeypatch.setattr(sys, "stdin", _stdio(b"not audio at all" * 20)[0])
    with pytest.raises(AudioFileError, match=r"^standard input: not an audio file"):
        read_audio("-")


def test_each_mistake_is_one_line_naming_the_file(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("shopping list: milk, bread\n")
    (tmp_path / "video.mp4").write_bytes(video_only())
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "cut.mp3").write_bytes(encode(speech_like(16000), 16000, "mp3")[:40])
    cases = {
        "missing.wav": "missing.wav: no such file",
        ".": ": is a directory, not an audio file",
        "notes.txt": "notes.txt: not an audio file (",
        "video.mp4": "video.mp4: not an audio file (no audio stream; its streams: video)",
        "empty.wav": "empty.wav: the file is empty",
        "cut.mp3": "cut.mp3: ",
    }
    for name, message in cases.items():
        with pytest.raises(AudioFileError) as caught:
            read_audio(tmp_path / name)
        text = str(caught.value)
        assert message in text and "\n" not in text, text
    with pytest.raises(AudioFileError, match=r"out\.xyz: cannot tell the audio format from '\.xyz'; name the file "
                                             r"\.wav, \.mp3, .* or give --format"):
        AudioWriter(tmp_path / "out.xyz", 16000)
    with pytest.raises(AudioFileError, match="no such directory"):
        AudioWriter(tmp_path / "nowhere" / "out.wav", 16000)
    with pytest.raises(AudioFileError, match="it is a directory"):
        AudioWriter(tmp_path, 16000, "wav")
    with pytest.raises(AudioFileError, match=f"unknown audio format 'aiff'; the formats are: {', '.join(FORMATS)}"):
        AudioWriter(tmp_path / "out.wav", 16000, "aiff")


def test_at_rate_resamples_and_keeps_the_tone() -> None:
    t = np.arange(44100) / 44100
    tone = (np.sin(2 * np.pi * 440 * t) * 10000).astype(np.int16)
    audio = Audio(tone, 44100)
    assert audio.at_rate(44100) is audio
    down = audio.at_rate(16000)
    assert down.sample_rate == 16000 and down.samples.dtype == np.int16 and abs(len(down.samples) - 16000) <= 2
    assert abs(rms(down.samples[1000:-1000]) / (10000 / np.sqrt(2)) - 1) < 0.02
    assert abs(peak_hz(down.samples[:16000], 16000) - 440) <= 1
    assert len(resample(np.zeros(0, np.int16), 48000, 16000)) == 0


def test_loadtest_takes_every_audio_file_of_a_directory(tmp_path, capsys) -> None:
    rate = 16000
    speech = np.concatenate([np.zeros(rate // 4, np.int16), speech_like(rate, 1.0), np.zeros(rate // 4, np.int16)])
    (tmp_path / "a.mp3").write_bytes(encode(speech, rate, "mp3"))
    (tmp_path / "b.ogg").write_bytes(encode(speech, rate, "ogg", channels=2))
    (tmp_path / "c.flac").write_bytes(encode(speech, rate, "flac"))
    (tmp_path / "notes.txt").write_text("not audio")
    (tmp_path / ".hidden").write_text("ignored")
    paths = audio_files(tmp_path)
    assert [p.name for p in paths] == ["a.mp3", "b.ogg", "c.flac"]
    assert capsys.readouterr().err.strip() == (f"rtmedia loadtest: --audio {tmp_path}: skipping 1 files that are not "
                                               "audio: notes.txt (Invalid data found when processing input)")
    for clip in load_clips(paths, 24000, 20):
        assert 230 < clip.voice_start_ms < 300 and 1230 < clip.voice_end_ms < 1320, clip.name
    for path in paths:
        path.write_bytes(b"")  # nothing left to speak
    with pytest.raises(CliError, match=r"no audio files in it; not audio: a\.mp3 \(the file is empty\)"):
        audio_files(tmp_path)
