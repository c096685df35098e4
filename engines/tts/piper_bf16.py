"""A Piper voice's decoder (engines/tts/piper_graph.py) in bfloat16 on OpenVINO's CPU plugin.

On a CPU that computes bfloat16 natively (AMX or AVX512-BF16) OpenVINO runs the decoder
several times faster than onnxruntime's float32 per latent frame on one thread. Against the
float32 decode of the same frames the audio is far closer than two float32 syntheses of the
same text are to each other (Piper samples noise): tests/perf/bench_tts_precision.py measures
both (figures in BENCHMARKS.md).

OpenVINO compiles its kernels for each input length it meets (a stall per new length), so
the decoder is compiled once per size in SIZES: `decode` cuts a stretch of frames into pieces
that fit them, each widened with the sentence's own frames, and `run` pads a piece that
reaches the sentence's end with zero frames.
Inference runs on the calling thread (one thread), so concurrent callers do not share cores
behind the scheduler's back; each takes an infer request of its own.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
from rtmedia.engines.tts.piper_graph import CONTEXT_FRAMES, PiperParts

# Latent frames the decoder is compiled for (a session's windows of 48, 96, 192 frames plus
# 2 x 10 of context fit 64, 128 and 256).
SIZES = (64, 128, 256)
# A TTS engine's `precision` (ServerConfig.tts_precision): "auto" is bf16 where bf16_unavailable() is "".
PRECISIONS = ("auto", "fp32", "bf16")


@cache
def bf16_unavailable() -> str:
    """Why the decoder cannot run in bfloat16 here, or "" when it can."""
    try:
        import openvino
    except ImportError:
        return "OpenVINO is not installed"
    if "BF16" not in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return "this CPU has no native bfloat16 (AMX or AVX512-BF16)"
    return ""


class Bf16Decoder:
    """A voice's decoder graph ("latent" [1, channels, frames] -> "audio" [1, 1, frames * hop])
    compiled in bfloat16 for each of SIZES."""

    def __init__(self, parts: PiperParts) -> None:
        import openvino

        self.hop = parts.hop
        core = openvino.Core()
        graph = core.read_model(parts.decoder)
        channels = graph.input("latent").get_partial_shape()[1].get_length()
        config = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": 1,
                  "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "ENABLE_CPU_PINNING": False}

        def compiled(size: int) -> object:
            shaped = graph.clone()
            shaped.reshape({"latent": [1, channels, size]})
            return core.compile_model(shaped, "CPU", config)

        with ThreadPoolExecutor(len(SIZES)) as pool:  # compiling is slow: the sizes in parallel
            self._compiled = dict(zip(SIZES, pool.map(compiled, SIZES), strict=True))
        self._idle: dict[int, queue.SimpleQueue] = {size: queue.SimpleQueue() for size in SIZES}

    def decode(self, latent: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Audio of frames [start, stop) of a sentence's latent [1, channels, frames], decoded
        with CONTEXT_FRAMES of context each side, in pieces of at most SIZES[-1] frames."""
        frames, hop, step = latent.shape[2], self.hop, SIZES[-1] - 2 * CONTEXT_FRAMES
        pieces = []
        for a in range(start, stop, step):
            b = min(stop, a + step)
            lo, hi = max(0, a - CONTEXT_FRAMES), min(frames, b + CONTEXT_FRAMES)
            size = next(s for s in SIZES if s >= hi - lo)
            hi = min(frames, lo + size)  # widened to the compiled size where the sentence has frames
            lo = max(0, hi - size)
            pieces.append(self.run(latent[:, :, lo:hi])[(a - lo) * hop:(b - lo) * hop])
        return np.concatenate(pieces)

    def run(self, latent: np.ndarray) -> np.ndarray:
        """Audio of `latent` [1, channels, n], n <= SIZES[-1], padded with zero frames to the
        next compiled size; the audio of all `size` frames. `decode` pads only past a sentence's
        end, where in float32 it changed the last frame of audio far less than bfloat16's own
        error (BENCHMARKS.md)."""
        frames = latent.shape[2]
        size = next((s for s in SIZES if s >= frames), 0)
        if not size:
            raise ValueError(f"{frames} latent frames: the decoder takes at most {SIZES[-1]} per call")
        if frames < size:
            latent = np.pad(latent, ((0, 0), (0, 0), (0, size - frames)))
        idle = self._idle[size]
        try:
            request = idle.get_nowait()
        except queue.Empty:
            request = self._compiled[size].create_infer_request()
        try:
            return request.infer({"latent": latent})[0].reshape(-1)  # a copy: the request's buffers are reused
        finally:
            idle.put(request)
