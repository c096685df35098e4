"""Where the engines run: device, precision and CUDA-graph settings, from the server config.

`placement(config)` checks the settings once, at start-up, and refuses the
ones that cannot work with a message that names the setting: `device cuda`
on a machine where torch sees no CUDA device, int8 LM layers (a CPU path) on
CUDA, an unknown video fast path or synthetic LM size. The engines are then
built from the result:

| device | LM engines (`llm`, `transformers`) | video engine |
| --- | --- | --- |
| cpu | float32, int8 linear layers unless `lm_quantize none`; eager | float32, eager |
| cuda | bfloat16; the decode step captured as CUDA graphs at warm-up for each padded batch size (`lm_batch_sizes`) | float32; steady-state decode steps admitted as graphs (`max_graphs`, `min_free_bytes`); `video_fast_path fused`: Triton decoder kernels |

Whisper (built by name in server/lanes/recognizer.py) runs on CTranslate2 (int8) on a CPU and on
torch (float16) on CUDA, its encoder and decoder step admitted as graphs up to `asr_max_graphs`
(`asr_backend`, `asr_compute_type` and `asr_model` choose otherwise).

`cuda_graphs: false` (`--no-cuda-graphs`) runs everything eagerly. Each
engine's graph runner counts its replays and its misses by reason into
`rtmedia_graph_replays_total{engine}` / `rtmedia_graph_misses_total{engine,reason}`
(docs/architecture.md#cuda-graph-runner, docs/operations.md#metrics); on a CPU every call is an `ineligible` miss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from rtmedia.engines.graphs import MISS_REASONS, GraphConfig, GraphRunner
from rtmedia.engines.lm.engine import EmbeddedLmEngine, LmEngine
from rtmedia.engines.video.decoder import VideoEngine
from rtmedia.server.config import ServerConfig
from rtmedia.server.observe.metrics import Metrics

log = logging.getLogger(__name__)

VIDEO_FAST_PATHS = ("off", "fused")
LM_QUANTIZE = ("auto", "int8", "none")


@dataclass(frozen=True)
class Placement:
    device: torch.device
    lm_dtype: torch.dtype
    lm_quantize: str | None  # "int8" or None (the model's dtype)
    graphs: GraphConfig

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> dict[str, Any]:
        return {"device": str(self.device), "lm_dtype": str(self.lm_dtype).removeprefix("torch."),
                "lm_quantize": self.lm_quantize or "none", "cuda_graphs": not self.graphs.enforce_eager,
                "max_graphs": self.graphs.max_graphs, "min_free_bytes": self.graphs.min_free_bytes}


def resolve_device(setting: str) -> torch.device:
    """`auto` (CUDA when torch sees a GPU, else the CPU), `cpu`, `cuda` or `cuda:N`; ValueError when CUDA
    is asked for and torch sees none."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {setting!r}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device {setting}: torch sees no CUDA device here (torch {torch.__version__}, "
                             f"{build}); use --device cpu or --device auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {setting}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def placement(config: ServerConfig) -> Placement:
    """The device, LM precision and graph settings the engines use; ValueError names a bad setting."""
    device = resolve_device(config.compute.device)
    if config.lm.quantize not in LM_QUANTIZE:
        raise ValueError(f"lm_quantize {config.lm.quantize!r}: expected one of {', '.join(LM_QUANTIZE)}")
    if device.type == "cuda" and config.lm.quantize == "int8":
        raise ValueError(f"lm_quantize int8 is the CPU path (per-row int8 matmuls) and cannot run on {device}; "
                         "on CUDA the LM runs in bfloat16: use --lm-quantize auto (or none), or --device cpu")
    if config.video.fast_path not in VIDEO_FAST_PATHS:
        raise ValueError(f"video_fast_path {config.video.fast_path!r}: expected one of {', '.join(VIDEO_FAST_PATHS)}")
    if not config.lm.batch_sizes or min(config.lm.batch_sizes) < 1:
        raise ValueError(f"lm_batch_sizes {config.lm.batch_sizes!r}: expected positive batch sizes")
    quantize = "int8" if device.type == "cpu" and config.lm.quantize != "none" else None
    graphs = GraphConfig(max_graphs=config.compute.max_graphs, min_free_bytes=config.compute.min_free_bytes,
                         enforce_eager=not config.compute.cuda_graphs)
    return Placement(device, torch.bfloat16 if device.type == "cuda" else torch.float32, quantize, graphs)


def graph_runner(engine: str, where: Placement, metrics: Metrics | None) -> GraphRunner:
    """A graph runner whose replays and misses count into the metrics (docs/operations.md#metrics) under `engine`."""
    if metrics is None:
        return GraphRunner(engine, where.graphs)
    replays = metrics.graph_replays.labels(engine)
    misses = {reason: metrics.graph_misses.labels(engine, reason) for reason in MISS_REASONS}
    runner = GraphRunner(engine, where.graphs, on_replay=replays.inc, on_miss=lambda reason: misses[reason].inc())
    metrics.graphs.labels(engine).set_function(lambda: runner.stats.graphs)
    metrics.graph_capture_failures.labels(engine).set_function(lambda: len(runner.stats.capture_failures))
    return runner


def build_lm_engines(config: ServerConfig, where: Placement, metrics: Metrics) -> dict[str, LmEngine]:
    """The LM engine of each LM lane: `llm` (the embedded SmolLM2, or a synthetic model) and
    `transformers` (a local directory), on the placement's device and precision."""
    if config.lm.synthetic_lm and not config.lm.llm:
        raise ValueError("synthetic_lm builds the llm lane; it cannot be combined with llm: false (--no-llm)")

    def options(lane: str) -> dict[str, Any]:
        return dict(slots=config.lm.slots, context=config.lm.context, threads=config.lm.threads,
                    batch_sizes=tuple(config.lm.batch_sizes), dtype=where.lm_dtype, device=where.device,
                    quantize=where.lm_quantize, graphs=graph_runner(lane, where, metrics))

    engines: dict[str, LmEngine] = {}
    if config.lm.synthetic_lm:
        from rtmedia.engines.lm.synthetic import SHAPES, SyntheticLmEngine, describe

        if config.lm.synthetic_lm not in SHAPES:
            raise ValueError(f"synthetic_lm {config.lm.synthetic_lm!r}: expected one of {', '.join(SHAPES)}")
        log.warning("the llm lane runs on a %s: replies are gibberish; for capacity runs only",
                    describe(config.lm.synthetic_lm))
        engines["llm"] = SyntheticLmEngine(config.lm.synthetic_lm, **options("llm"))
    elif config.lm.llm:
        engines["llm"] = EmbeddedLmEngine(**options("llm"))
    if config.lm.transformers_model:
        engines["transformers"] = LmEngine(config.lm.transformers_model, **options("transformers"))
    return engines


def build_video_engine(config: ServerConfig, where: Placement, metrics: Metrics) -> VideoEngine:
    """The Wan VAE decoder (float32, its one precision) on the placement's device."""
    if config.video.fast_path == "fused" and not where.cuda:
        log.warning("video_fast_path fused on the CPU: the Triton kernels fall back to their torch "
                    "references (each fallback is recorded); it pays off on CUDA only")
    return VideoEngine(config.video.vae, threads=config.video.threads, device=str(where.device),
                       graphs=graph_runner("video", where, metrics), fast_path=config.video.fast_path)
