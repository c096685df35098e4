"""`rtmedia doctor`: an operator's self-check of this machine, one line per check.

- which device torch sees (CUDA or CPU) and the torch/Triton versions;
- each engine loads and runs one step, with the device and precision it uses (the recogniser:
  one decode);
- CUDA graphs: the graph runner captures and replays a small step and the
  replay follows new inputs (on a machine without CUDA this line says so and
  is skipped, never faked);
- each Triton kernel against its torch reference on small shapes, compiled
  on CUDA, under the Triton interpreter on a CPU; max error and pass/fail.

Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

KERNEL_TOLERANCE = 1e-5


@dataclass
class Check:
    name: str
    status: str  # pass, fail, skip
    detail: str
    max_error: float | None = None
    seconds: float = 0.0


def _timed(name: str, fn: Callable[[], tuple[str, str, float | None]]) -> Check:
    started = time.perf_counter()
    try:
        status, detail, err = fn()
    except Exception as exc:
        status, detail, err = "fail", f"{type(exc).__name__}: {exc}", None
    return Check(name, status, detail, err, round(time.perf_counter() - started, 3))


def check_device() -> tuple[str, str, float | None]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    if torch.cuda.is_available():
        where = f"CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}"
    else:
        where = f"no CUDA: CPU ({os.cpu_count()} cores)"
    return "pass", f"{where}; torch {torch.__version__}, triton {triton_version}", None


def check_lm(synthetic: str | None) -> tuple[str, str, float | None]:
    import torch
    from rtmedia.engines.lm.engine import EmbeddedLmEngine, LmEngine
    from rtmedia.server.config import ServerConfig
    from rtmedia.server.lanes.placement import placement

    where = placement(ServerConfig())  # what `rtmedia serve` picks on this machine by default
    options: dict[str, Any] = dict(slots=2, context=64, batch_sizes=(1, 2), quantize=where.lm_quantize)
    if synthetic:
        from rtmedia.engines.lm.synthetic import synthetic_llama

        engine: LmEngine = LmEngine(model=synthetic_llama(synthetic, where.lm_dtype, where.device), **options)
        source = f"synthetic {synthetic} (random weights)"
    else:
        engine = EmbeddedLmEngine(device=where.device, dtype=where.lm_dtype, **options)
        source = "embedded SmolLM2-135M-Instruct"
    engine.load()
    try:
        engine.warmup()
        slot = engine.acquire()
        assert slot is not None
        engine.prefill(slot, [1, 2, 3])
        logits = engine.decode({slot: 4})[slot]
        if not torch.isfinite(logits).all():
            return "fail", f"{source}: non-finite logits", None
        device = next(engine.model.parameters()).device
        precision = f"{engine.quantize} linears" if engine.quantize else str(engine.model.dtype).removeprefix("torch.")
        forward = "compact" if engine.compact is not None else f"transformers ({engine.compact_refused})"
        graphs = engine.graphs.stats
        mode = f"CUDA graphs for batch sizes {engine.batch_sizes} ({graphs.pinned} captured)" \
            if engine.static_decode and graphs.pinned else "eager decode"
        counts = f"graph replays {graphs.hits}, eager steps {graphs.miss_total} " \
            f"({', '.join(f'{k} {v}' for k, v in graphs.misses.items() if v) or 'none'})"
        return "pass", f"{source} on {device}, {precision}, {forward} forward, {mode}; {counts}", None
    finally:
        engine.close()


def check_video(vae: str | None) -> tuple[str, str, float | None]:
    import torch
    from rtmedia.engines.video.decoder import VideoEngine
    from rtmedia.engines.video.plan import causal_plan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = VideoEngine(vae, device=device)
    engine.load()
    assert engine.info is not None
    stream = engine.open_stream(torch.zeros(engine.info.latent_channels, 3, 2, 2), causal_plan(3), 0, 0)
    try:
        frames = [engine.decode_step(stream) for _ in stream.plan.steps]
    finally:
        engine.close_stream(stream)
    count = sum(f.shape[0] for f in frames)
    return "pass", f"Wan VAE ({engine.info.source}) on {device}, float32: {count} frames from 3 latent frames", None


def check_speech() -> tuple[str, str, float | None]:
    from rtmedia.engines.tts.piper_bf16 import bf16_unavailable
    from rtmedia.engines.vad.silero import VadEngine

    vad = VadEngine()
    vad.load()
    vad.close()
    why = bf16_unavailable()
    tts = f"float32 on onnxruntime ({why})" if why else "bfloat16 on OpenVINO"
    return "pass", f"Silero VAD (onnxruntime, CPU, float32) loads; Piper's decoder by default: {tts}", None


def check_asr() -> tuple[str, str, float | None]:
    from rtmedia.server.config import ServerConfig
    from rtmedia.server.lanes.placement import placement
    from rtmedia.server.lanes.recognizer import build_recognizer

    config = ServerConfig()  # what `rtmedia serve` picks on this machine by default
    engine = build_recognizer(config, placement(config), None)
    engine.load()
    try:
        engine.warmup()  # one decode
        engine.warmup()  # a second: a shape's graph is captured on its second call
        about = engine.describe
        where = f"{about['runtime']}, {about['device']}, {about['compute_type']}"
        graphs = engine.graph_stats
        if graphs is None:
            mode = "no CUDA graphs (CTranslate2)"
        else:
            mode = f"CUDA graphs: {graphs.graphs} captured, replays {graphs.hits}, eager steps {graphs.miss_total} " \
                f"({', '.join(f'{k} {v}' for k, v in graphs.misses.items() if v) or 'none'})"
            if graphs.capture_failures:
                return "fail", f"Whisper ({where}): a capture failed: {graphs.capture_failures[0]}", None
        return "pass", f"Whisper {about['model']} ({where}) loads and decodes, from {about['path']}; {mode}", None
    finally:
        engine.close()


def check_graphs() -> tuple[str, str, float | None]:
    import torch
    from rtmedia.engines.graphs import GraphConfig, GraphRunner

    if not torch.cuda.is_available():
        return "skip", "no CUDA on this machine: CUDA graphs cannot be captured here; engines run eagerly", None
    runner = GraphRunner("doctor", GraphConfig(min_free_bytes=0))
    weight = torch.randn(64, 64, device="cuda")

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ weight) + 1

    err = 0.0
    for seed in range(4):  # warm-up miss, capture, then replays of new inputs
        x = torch.randn(8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        err = max(err, (runner.run(step, x) - step(x)).abs().max().item())
    stats = runner.stats
    if stats.graphs != 1 or stats.hits != 3:
        return "fail", f"expected 1 graph and 3 replays, got {stats.as_dict()}", err
    status = "pass" if err == 0.0 else "fail"
    return status, f"captured 1 graph, 3 replays follow new inputs ({torch.cuda.get_device_name(0)})", err


def _kernel_check(run: Callable[[], tuple[Any, Any]], dispatcher: Any, exact: bool) -> tuple[str, str, float | None]:
    import torch
    from rtmedia.kernels.dispatch import interpreting

    mode = "interpreter on CPU" if interpreting() else "compiled on CUDA"
    dispatcher.reset()
    out, ref = run()
    if dispatcher.launches == 0:
        return "fail", f"kernel did not run: {dict(dispatcher.fallbacks)}", None
    err = (out.float() - ref.float()).abs().max().item()
    ok = torch.equal(out, ref) if exact else err <= KERNEL_TOLERANCE
    want = "bit-identical" if exact else f"max error <= {KERNEL_TOLERANCE:g}"
    return ("pass" if ok else "fail"), f"{mode}, float32, {want}", err


def check_rms_norm() -> tuple[str, str, float | None]:
    import torch
    from rtmedia.kernels.rmsnorm import rms_norm, rms_norm_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 24, 2, 6, 6, generator=g).to(device)
    gamma = torch.randn(24, 1, 1, 1, generator=g).to(device)
    return _kernel_check(lambda: (rms_norm(x, gamma, 0.0, 24**0.5, True),
                                  rms_norm_reference(x, gamma, 0.0, 24**0.5, True)), rms_norm, exact=False)


def check_assemble() -> tuple[str, str, float | None]:
    import torch
    from rtmedia.kernels.causal_conv import assemble, assemble_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 8, 1, 5, 7, generator=g).to(device)
    cache = torch.randn(1, 8, 2, 5, 7, generator=g).to(device)
    padding = (1, 1, 1, 1, 2, 0)
    return _kernel_check(lambda: (assemble(x, cache, padding), assemble_reference(x, cache, padding)),
                         assemble, exact=True)


def run_checks(engines: bool = True, synthetic_lm: str | None = None, video_vae: str | None = None) -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first loaded
    checks = [_timed("device", check_device)]
    if engines:
        checks += [_timed("engine lm", lambda: check_lm(synthetic_lm)),
                   _timed("engine video", lambda: check_video(video_vae)),
                   _timed("engine vad", check_speech),
                   _timed("engine asr", check_asr)]
    checks += [_timed("cuda graphs", check_graphs),
               _timed("kernel rms_norm_silu", check_rms_norm),
               _timed("kernel causal_conv_assemble", check_assemble)]
    return checks


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="self-check: engines, device and precision, CUDA graphs, Triton kernels",
                       description="Check this machine: which engines load (device, precision), whether CUDA "
                                   "graphs capture and replay correctly, and each Triton kernel against its "
                                   "torch reference (under the interpreter without a GPU). Exit 1 on a failure.")
    p.add_argument("--json", action="store_true", help="one JSON object with every check")
    p.add_argument("--no-engines", dest="engines", action="store_false", help="skip loading the engines")
    p.add_argument("--synthetic-lm", default=None, metavar="SIZE",
                   help="check the LM engine on a random-weight model of this shape (tiny, 0.5b, 1b, 7b) "
                        "instead of the embedded SmolLM2")
    p.add_argument("--video-vae", default=None, metavar="DIR", help="a local diffusers AutoencoderKLWan directory")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(args.engines, args.synthetic_lm, args.video_vae)
    failed = [c.name for c in checks if c.status == "fail"]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}))
    else:
        for c in checks:
            err = "" if c.max_error is None else f"  max error {c.max_error:.3g}"
            print(f"{c.status.upper():4}  {c.name:28} {c.detail}{err}  ({c.seconds:.2f} s)")
    sys.stdout.flush()
    if failed:
        print(f"rtmedia doctor: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
