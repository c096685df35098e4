"""Phone calls through the SIP door (baresip calling `rtmedia sip`) against the same audio over
gRPC, in one sitting.

    .venv/bin/python tests/perf/bench_sip.py [--rounds 6] [--calls 12] [--wer-calls 4] [--out results.json]

One `rtmedia serve --no-llm --responder echo` and one `rtmedia sip` in front of it; the callers
are Debian's baresip (G.711 μ-law, its jitter buffer at its minimum, 1-2 frames), each with a
WAV as its microphone. baresip writes what it encodes and what it decodes to two WAV files as
it goes (`sndfile`); a thread watching them grow timestamps every sample. Their player is a
PulseAudio null sink (clocked, as a sound card is).

- Voice-to-voice: a Piper sentence, from the last voiced sample baresip encoded for its RTP to
  the first voiced reply sample it decoded, through a door with the default codecs (G.722 too:
  its conference bridge at 16 kHz) and one with G.711 only (8 kHz); against `Converse`
  straight, the same sentence as 8 kHz μ-law at real time, from the chunk with its last voiced
  sample to the reply's first voiced sample as heard (its first delta's arrival plus that
  sample's offset: TTS audio starts quietly); rounds alternating.
- `--calls` concurrent calls (echo), three sentences each, over as many doors as they need
  (one PJSIP process holds 4 calls): voice-to-voice and response (the same less the 500 ms
  end-of-turn silence) p50/p95, the doors' playout underruns, and the door processes' CPU per
  call-second.
- Speakerphones: `--echo-calls` calls at once by PJSIP callers (tests/support/sip_caller.py)
  that send what they hear back at `--echo-gain` (-6 dB: a loud speakerphone), three sentences
  each, to a number with the door's echo cancellation (`speaker`) and to one without (the
  default): turns that were the
  agent's own echo (turns recognised beyond the three said), the replies' words the callers
  heard (WER of their recordings against the three replies), the door's CPU per call-second.
- Caller WER at 8 kHz G.711: the 46 sentences of tests/perf/asr_sentences.txt over
  `--wer-calls` calls (turns transcribed, no replies), as the session recognised them.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rtmedia.engines.audio.resample import float_to_ulaw
from rtmedia.web.telephony.sip_config import PJSIP_MAX_CALLS

from tests.perf.bench_asr import wer
from tests.perf.bench_speech import machine, report
from tests.perf.bench_twilio import CHUNK, SENTENCES, last_voiced_chunk, paced
from tests.perf.bench_twilio import pct as _pct
from tests.support.converse import Conversation
from tests.support.pulse import running_pulse
from tests.support.serve import running_server
from tests.support.sip import Baresip, running_door
from tests.support.speech import Speaker, write_wav

HERE = Path(__file__).resolve().parent
RATE = 8000
LEVEL = 164  # a voiced sample, in int16: 0.005 of full scale, as bench_twilio.py counts one
GAP_S = 6.0  # after each sentence: the echo's reply plays out before the next
SILENCE_MS = 500  # the end-of-turn silence (turn_detection.silence_duration_ms)
ENV: dict[str, dict[str, str]] = {}  # the PulseAudio server the callers play into ("pulse")
STAGGER_S = 9.0  # the concurrent calls' starts spread over this (a sentence and its gap)


def pct(values: list[float], q: float) -> float | None:
    return _pct(values, q) if values else None


class Growth:
    """When each sample of baresip's recordings was written: their sizes, polled every 2 ms."""

    def __init__(self) -> None:
        self.files: dict[Path, list[tuple[float, int]]] = {}
        self.folders: list[Path] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def watch(self, folder: Path) -> None:
        self.folders.append(folder)

    def _run(self) -> None:
        while not self.stop.wait(0.002):
            now = time.perf_counter()
            for folder in list(self.folders):
                for path in folder.glob("*.wav"):
                    size = path.stat().st_size
                    seen = self.files.setdefault(path, [])
                    if not seen or seen[-1][1] != size:
                        seen.append((now, size))

    def time_of(self, path: Path, index: int) -> float:
        """When sample `index` (from 0) of `path` was written."""
        need = 44 + 2 * (index + 1)
        return next(t for t, size in self.files[path] if size >= need)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def recordings(folder: Path) -> tuple[Path, Path]:
    enc = sorted((folder / "rec").glob("*-enc.wav"))[-1]
    return enc, enc.with_name(enc.name.replace("-enc", "-dec"))


def samples(path: Path) -> np.ndarray:
    import wave

    with wave.open(str(path)) as f:
        return np.frombuffer(f.readframes(f.getnframes()), "<i2")


def voiced_spans(x: np.ndarray, min_gap: int) -> list[tuple[int, int]]:
    """(first, last) voiced sample of each stretch of voice, stretches split by `min_gap` quiet samples."""
    idx = np.flatnonzero(np.abs(x.astype(np.int32)) > LEVEL)
    if not len(idx):
        return []
    cuts = np.flatnonzero(np.diff(idx) > min_gap)
    starts, ends = np.r_[idx[0], idx[cuts + 1]], np.r_[idx[cuts], idx[-1]]
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def call_figures(growth: Growth, folder: Path) -> list[float]:
    """Voice-to-voice of each turn of a finished call: caller's last voiced sample (encoded) to
    the first reply sample after it (decoded)."""
    enc, dec = recordings(folder)
    said = voiced_spans(samples(enc), int(1.0 * RATE))
    heard = samples(dec)
    out = []
    for _, last in said:
        t_said = growth.time_of(enc, last)
        after = [s for s, _ in voiced_spans(heard, int(0.3 * RATE)) if growth.time_of(dec, s) > t_said]
        if after:
            out.append((growth.time_of(dec, after[0]) - t_said) * 1000)
    return out


def place(phone: Baresip, uri: str, seconds: float) -> None:
    phone.command("dial", uri)
    phone.wait("CALL_ESTABLISHED", timeout=30)
    time.sleep(seconds)
    phone.command("hangup")
    phone.wait("CALL_CLOSED", timeout=30)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wav_of(folder: Path, name: str, speaker: Speaker, texts: list[str], gap_s: float) -> Path:
    parts = [speaker.silence(0.5, RATE)]
    for text in texts:
        parts += [speaker.say(text, RATE), speaker.silence(gap_s, RATE)]
    return write_wav(folder / f"{name}.wav", RATE, *parts)


def run(target: str, door, narrow, folder: Path, rounds: int, calls: int, wer_calls: int, echo_calls: int,
        echo_gain: float) -> dict:
    """`door`: the default codecs (G.722 too: a 16 kHz bridge); `narrow`: G.711 only (8 kHz)."""
    speaker = Speaker()
    growth = Growth()
    try:
        # ---- voice-to-voice: SIP (both doors) and gRPC alternating ----
        sip_v2v, narrow_v2v, grpc_v2v = [], [], []
        for n in range(rounds):
            text = SENTENCES[n % len(SENTENCES)]
            wav = wav_of(folder, f"round{n}", speaker, [text], GAP_S)
            for which, into in ((door, sip_v2v), (narrow, narrow_v2v)):
                phone_dir = folder / f"round{n}-{len(into)}-{id(which)}"
                phone = Baresip(phone_dir, wav, jitter="1-2", env=ENV["pulse"])
                growth.watch(phone_dir / "rec")
                try:
                    place(phone, which.uri, 0.5 + 4.0 + GAP_S - 1.0)
                finally:
                    phone.close()
                into += call_figures(growth, phone_dir)[:1]
            clip = float_to_ulaw(np.concatenate([speaker.silence(0.3, RATE), speaker.say(text, RATE)])
                                 .astype(np.float32) / 32768)
            grpc_v2v.append(asyncio.run(asyncio.wait_for(_grpc(target, clip), 60)))
            print(f"round {n}: sip {sip_v2v[-1:]} g711 {narrow_v2v[-1:]} grpc {grpc_v2v[-1]:.0f} ms", file=sys.stderr)
        concurrent = wer_result = echo = None
        if calls:
            concurrent = concurrent_calls(target, folder, growth, speaker, calls)
        if wer_calls:
            wer_result = dictation(door, folder, speaker, wer_calls, rounds)
        if echo_calls:
            echo = {number: speakerphones(target, door, folder, speaker, echo_calls, echo_gain, number)
                    for number in ("speaker", "rtmedia")}
    finally:
        growth.close()
    return {"rounds": rounds,
            "sip_v2v_ms": {"p50": pct(sip_v2v, 50), "p95": pct(sip_v2v, 95)},
            "grpc_v2v_ms": {"p50": pct(grpc_v2v, 50), "p95": pct(grpc_v2v, 95)},
            "sip_added_p50_ms": round(pct(sip_v2v, 50) - pct(grpc_v2v, 50), 1) if rounds else None,
            "g711_only_v2v_ms": {"p50": pct(narrow_v2v, 50), "p95": pct(narrow_v2v, 95)},
            "g711_only_added_p50_ms": round(pct(narrow_v2v, 50) - pct(grpc_v2v, 50), 1) if rounds else None,
            "concurrent": concurrent, "wer_8k_g711": wer_result, "speakerphones": echo}


def concurrent_calls(target: str, folder: Path, growth: Growth, speaker: Speaker, calls: int) -> dict:
    """`calls` at once over as many doors as they need (one PJSIP process holds PJSIP_MAX_CALLS)."""
    with contextlib.ExitStack() as stack:
        doors = [stack.enter_context(running_door(target, log=folder / f"door{n}.log"))
                 for n in range(math.ceil(calls / PJSIP_MAX_CALLS))]
        return _concurrent(doors, folder, growth, speaker, calls)


def _concurrent(doors: list, folder: Path, growth: Growth, speaker: Speaker, calls: int) -> dict:
    wav = wav_of(folder, "three", speaker, SENTENCES, GAP_S)
    seconds = len(samples(wav)) / RATE
    phones = [Baresip(folder / f"call{n}", wav, jitter="1-2", env=ENV["pulse"]) for n in range(calls)]
    cpu0, t0 = sum(cpu_seconds(d.process.pid) for d in doors), time.perf_counter()
    try:
        for phone in phones:
            growth.watch(phone.folder / "rec")
        threads = [threading.Thread(target=place, args=(p, doors[n % len(doors)].uri, seconds))
                   for n, p in enumerate(phones)]
        for th in threads:  # (spread over one turn's cycle, as callers are: not all ending turns at once)
            th.start()
            time.sleep(STAGGER_S / calls)
        for th in threads:
            th.join()
    finally:
        for phone in phones:
            phone.close()
    cpu = sum(cpu_seconds(d.process.pid) for d in doors) - cpu0
    wall = time.perf_counter() - t0
    per_call = [call_figures(growth, phone.folder) for phone in phones]
    print("per call voice-to-voice (ms):", [[round(v) for v in c] for c in per_call], file=sys.stderr)
    together = [v for c in per_call for v in c]
    last = [c for d in doors for c in d.calls()["ended"]]  # (each door is this phase's own)
    return {"calls": calls, "doors": len(doors), "replies": len(together), "expected_replies": calls * len(SENTENCES),
            "v2v_p50_ms": pct(together, 50), "v2v_p95_ms": pct(together, 95),
            "response_p50_ms": round(pct(together, 50) - SILENCE_MS, 1),
            "response_p95_ms": round(pct(together, 95) - SILENCE_MS, 1),
            "underruns": sum(c["underruns"] for c in last),
            "door_cpu_ms_per_call_second": round(cpu * 1000 / (calls * wall), 2)}


def dictation(door, folder: Path, speaker: Speaker, wer_calls: int, before: int) -> dict:
    sentences = [s.strip() for s in (HERE / "asr_sentences.txt").read_text().splitlines() if s.strip()]
    shares = [sentences[i::wer_calls] for i in range(wer_calls)]
    wer_phones = [Baresip(folder / f"wer{n}", wav_of(folder, f"wer{n}", speaker, share, 1.5), user=f"wer{n}",
                          env=ENV["pulse"]) for n, share in enumerate(shares)]
    try:
        threads = [threading.Thread(target=place, args=(p, door.uri.replace("rtmedia@", "dictation@"),
                                                        len(samples(p.folder.parent / f"wer{n}.wav")) / RATE
                                                        + 1.0))
                   for n, p in enumerate(wer_phones)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        for phone in wer_phones:
            phone.close()
    dictated = door.ended(before + wer_calls)[-wer_calls:]
    pairs = []
    for phone, share in zip(wer_phones, shares, strict=True):
        info = next(c for c in dictated if c["caller"] == phone.user)
        if len(info["transcript"]) == len(share):
            pairs += list(zip(share, info["transcript"], strict=True))
        else:  # a turn split or merged: the call's text as a whole
            pairs.append((" ".join(share), " ".join(info["transcript"])))
    return {"calls": wer_calls, "sentences": len(sentences), "wer": wer(pairs)}


def speakerphones(target: str, door, folder: Path, speaker: Speaker, calls: int, gain: float, number: str) -> dict:
    """`calls` speakerphones at once, to `number` (speaker: echo cancellation on)."""
    import soundfile
    from rtmedia.clients.client import SpeechClient

    wav = wav_of(folder, "three", speaker, SENTENCES, GAP_S)
    seconds = len(samples(wav)) / RATE + 2.0
    caller = HERE.parent / "support" / "sip_caller.py"
    before = len(door.calls()["ended"])
    uri = door.uri.replace("rtmedia@", f"{number}@")
    heard = [folder / f"{number}-heard{n}.wav" for n in range(calls)]
    cpu0, t0 = cpu_seconds(door.process.pid), time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(caller), uri, "--play", str(wav), "--echo", str(gain), "--record",
                               str(path), "--seconds", str(seconds)], stdout=subprocess.DEVNULL) for path in heard]
    for proc in procs:
        proc.wait(timeout=seconds + 60)
    cpu, wall = cpu_seconds(door.process.pid) - cpu0, time.perf_counter() - t0
    ended = door.ended(before + calls)[-calls:]
    replies = " ".join(f"you said, {s}" for s in SENTENCES)
    pairs = []
    with SpeechClient(target) as client:
        for path in heard:
            audio, rate = soundfile.read(path, dtype="int16")
            pairs.append((replies, " ".join(r.text for r in client.transcribe(audio.tobytes(), rate,
                                                                               partial_results=False) if r.is_final)))
    return {"calls": calls, "echo_gain": gain,
            "echo_turns": sum(max(0, len(c["transcript"]) - len(SENTENCES)) for c in ended),
            "replies_heard_wer": wer(pairs),
            "door_cpu_ms_per_call_second": round(cpu * 1000 / (calls * wall), 2)}


async def _grpc(target: str, clip: bytes) -> float:
    """Voice-to-voice over gRPC as the caller hears it: the reply plays from its first delta's
    arrival, so its first voiced sample is heard that much later (TTS audio starts quietly)."""
    async with grpc.aio.insecure_channel(target) as channel, Conversation(channel) as c:
        c.send("session.update", session={"input_audio_format": {"encoding": "g711_ulaw", "sample_rate": RATE},
                                          "output_sample_rate": RATE, "responder": "echo",
                                          "turn_detection": {"type": "server_vad"}})
        await c.wait_for("session.updated")
        done = asyncio.Event()

        async def send(chunk: bytes) -> None:
            c.send("input_audio_buffer.append", audio=chunk)

        sender = asyncio.ensure_future(paced([clip[i:i + CHUNK] for i in range(0, len(clip), CHUNK)], send, done))
        await c.wait_for("response.output_audio.done", timeout=30)
        done.set()
        sent = await sender
        deltas = [e for e in c.events if e["type"] == "response.output_audio.delta"]
        audio = np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in deltas), "<i2")
        first = int(np.flatnonzero(np.abs(audio.astype(np.int32)) > LEVEL)[0])
        return (deltas[0]["t"] + c.t0 + first / RATE - sent[last_voiced_chunk(clip)]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--wer-calls", type=int, default=PJSIP_MAX_CALLS)
    parser.add_argument("--echo-calls", type=int, default=PJSIP_MAX_CALLS)
    parser.add_argument("--echo-gain", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "sip.yaml").write_text(
            "numbers:\n  dictation: {turn_detection: {type: server_vad, create_response: false}}\n"
            "  speaker: {echo_cancellation: true}\n")
        (folder / "g711.yaml").write_text("codecs: [PCMU, PCMA]\n")
        with running_pulse(folder / "pulse") as pulse, \
                running_server("--no-llm", "--responder", "echo", "--log-level", "WARNING",
                            "--metrics-port", "0") as (target, _), \
                running_door(target, "--sip-config", str(folder / "sip.yaml"), log=folder / "sip.log") as door, \
                running_door(target, "--sip-config", str(folder / "g711.yaml"), log=folder / "g711.log") as narrow:
            ENV["pulse"] = pulse.env
            result = {"benchmark": "sip", "machine": machine(),
                      **run(target, door, narrow, folder, args.rounds, args.calls, args.wer_calls,
                            args.echo_calls, args.echo_gain)}
    report(result, args.out)


if __name__ == "__main__":
    main()
