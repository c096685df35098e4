"""Where the server puts its engines: `serve` flags -> ServerConfig -> device, precision and
CUDA-graph settings of the LM and video engines, start-up refusals, and the graph metrics.
CUDA is simulated where a test needs torch to see a GPU (nothing is put on it)."""

from __future__ import annotations

import pytest
import torch
from rtmedia.engines.lm.engine import EmbeddedLmEngine, LmEngine
from rtmedia.engines.lm.synthetic import SHAPES, SyntheticLmEngine
from rtmedia.protocol import logs
from rtmedia.server import cli
from rtmedia.server.app import RtmediaServer
from rtmedia.server.config import ServerConfig
from rtmedia.server.lanes.placement import (
    build_lm_engines,
    build_video_engine,
    graph_runner,
    placement,
)
from rtmedia.server.lanes.recognizer import build_recognizer as build_whisper_engine
from rtmedia.server.observe.metrics import Metrics

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch says one CUDA device is there (engines are only built here, never loaded)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def serve_config(*flags: str) -> ServerConfig:
    return cli.config_from_args(cli.build_parser().parse_args(["serve", *flags]))


def test_serve_flags_map_onto_config_fields() -> None:
    config = serve_config("--device", "cuda:0", "--no-cuda-graphs", "--max-graphs", "2", "--min-free-bytes", "0",
                          "--lm-batch-sizes", "1,4,16", "--synthetic-lm", "0.5b", "--video-fast-path", "fused",
                          "--lm-quantize", "none")
    assert (
        config.compute.device,
        config.compute.cuda_graphs,
        config.compute.max_graphs,
        config.compute.min_free_bytes,
    ) == ("cuda:0", False, 2, 0)
    assert config.lm.batch_sizes == [1, 4, 16] and config.lm.synthetic_lm == "0.5b"
    assert config.video.fast_path == "fused" and config.lm.quantize == "none"
    default = serve_config()
    assert (default.compute.device, default.compute.cuda_graphs, default.lm.quantize, default.lm.synthetic_lm) == ("auto", True, "auto", None)
    assert default.compute.max_graphs == 4 and default.compute.min_free_bytes == 1 << 30
    assert set(cli.SYNTHETIC_SIZES) == set(SHAPES)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--lm-batch-sizes", "1,x"])


@needs_no_cuda
def test_auto_is_the_cpu_here_with_float32_and_int8() -> None:
    where = placement(ServerConfig())
    assert where.device == torch.device("cpu") and where.lm_dtype == torch.float32 and where.lm_quantize == "int8"
    assert not where.graphs.enforce_eager and where.graphs.max_graphs == 4
    assert placement(ServerConfig.of(lm_quantize="none")).lm_quantize is None


@needs_no_cuda
def test_device_cuda_without_cuda_is_a_clear_startup_error(monkeypatch, capsys) -> None:
    with pytest.raises(ValueError, match=r"device cuda: torch sees no CUDA device.*--device cpu"):
        placement(ServerConfig.of(device="cuda"))
    monkeypatch.setattr(logs, "configure", lambda *a: None)  # leave the test run's logging alone
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # serve sets it if unset; restored after the test
    assert cli.main(["serve", "--device", "cuda", "--port", "0", "--metrics-port", "0"]) == 1
    err = capsys.readouterr().err
    assert "rtmedia serve: device cuda: torch sees no CUDA device" in err


def test_bad_settings_are_refused_by_name(fake_cuda) -> None:
    with pytest.raises(ValueError, match="lm_quantize int8 is the CPU path"):
        placement(ServerConfig.of(device="cuda", lm_quantize="int8"))
    with pytest.raises(ValueError, match="torch sees 1 CUDA device"):
        placement(ServerConfig.of(device="cuda:3"))
    with pytest.raises(ValueError, match="expected auto, cpu, cuda"):
        placement(ServerConfig.of(device="tpu"))
    with pytest.raises(ValueError, match="video_fast_path 'fast'"):
        placement(ServerConfig.of(video_fast_path="fast"))
    with pytest.raises(ValueError, match="max_graphs >= 0"):
        placement(ServerConfig.of(max_graphs=-1))
    where = placement(ServerConfig.of(device="cpu"))
    with pytest.raises(ValueError, match="synthetic_lm '9b'"):
        build_lm_engines(ServerConfig.of(synthetic_lm="9b"), where, Metrics())
    with pytest.raises(ValueError, match="--no-llm"):
        build_lm_engines(ServerConfig.of(synthetic_lm="tiny", llm=False), where, Metrics())


def test_cuda_placement_builds_bf16_graph_engines(fake_cuda, tmp_path) -> None:
    config = ServerConfig.of(lm_slots=8, lm_batch_sizes=[1, 2, 4, 32], transformers_model=str(tmp_path),
                          max_graphs=3, min_free_bytes=5)
    where = placement(config)  # auto -> cuda
    assert where.cuda and where.lm_dtype == torch.bfloat16 and where.lm_quantize is None
    engines = build_lm_engines(config, where, Metrics())
    assert isinstance(engines["llm"], EmbeddedLmEngine) and type(engines["transformers"]) is LmEngine
    for name, engine in engines.items():
        assert engine.device == torch.device("cuda") and engine.dtype == torch.bfloat16 and engine.quantize is None
        assert engine.batch_sizes == (1, 2, 4, 8) and engine.graphs.engine == name
        assert engine.graphs.config.max_graphs == 3 and engine.graphs.config.min_free_bytes == 5
        assert not engine.graphs.config.enforce_eager
    video = build_video_engine(ServerConfig.of(video_fast_path="fused"), where, Metrics())
    assert video.device == torch.device("cuda") and video.fast_path == "fused" and video.graphs.engine == "video"
    eager = placement(ServerConfig.of(cuda_graphs=False))
    assert eager.graphs.enforce_eager


def test_server_wires_synthetic_llm_and_video_on_the_cpu() -> None:
    server = RtmediaServer(ServerConfig.of(device="cpu", synthetic_lm="tiny", lm_slots=2, cuda_graphs=False,
                                        port=0, metrics_port=0))
    llm = server.scheduler.lanes["llm"].engine
    assert isinstance(llm, SyntheticLmEngine) and llm.size == "tiny"
    assert llm.device == torch.device("cpu") and llm.dtype == torch.float32 and llm.quantize == "int8"
    assert llm.graphs.config.enforce_eager
    video = server.scheduler.lanes["video"].engine
    assert video.device == torch.device("cpu") and video.graphs.config.enforce_eager


def test_graph_runner_counts_replays_and_misses_into_metrics() -> None:
    metrics = Metrics()
    runner = graph_runner("video", placement(ServerConfig.of(device="cpu")), metrics)
    out = runner.run(torch.relu, torch.tensor([-1.0, 2.0]))  # a CPU step: eager, ineligible
    assert out.tolist() == [0.0, 2.0]
    sample = metrics.registry.get_sample_value
    assert sample("rtmedia_graph_misses_total", {"engine": "video", "reason": "ineligible"}) == 1
    runner._on_replay()  # what a replay on a GPU calls
    assert sample("rtmedia_graph_replays_total", {"engine": "video"}) == 1


def test_whisper_runtime_follows_the_device(fake_cuda) -> None:
    """`asr_backend auto`: torch with a graph runner of its own cap on CUDA, CTranslate2 on a CPU."""
    metrics = Metrics()
    where = placement(ServerConfig.of(max_graphs=3, min_free_bytes=5))
    engine = build_whisper_engine(ServerConfig.of(asr_max_graphs=7), where, metrics)
    assert engine._runtime == "torch" and engine._device == "cuda" and engine._graphs.engine == "asr"
    assert engine._graphs.config.max_graphs == 7 and engine._graphs.config.min_free_bytes == 5
    assert engine._graphs.config.eager_after_failure and not where.graphs.eager_after_failure
    assert metrics.registry.get_sample_value("rtmedia_graphs", {"engine": "asr"}) == 0
    assert metrics.registry.get_sample_value("rtmedia_graph_capture_failures", {"engine": "asr"}) == 0
    assert build_whisper_engine(ServerConfig.of(asr_backend="ct2"), where, Metrics())._runtime == "ct2"
    cpu = build_whisper_engine(ServerConfig(), placement(ServerConfig.of(device="cpu")), Metrics())
    assert cpu._runtime == "ct2" and cpu._device == "cpu" and cpu._graphs is None


def test_serve_flags_choose_the_whisper_model() -> None:
    config = serve_config("--asr-model", "/models/w", "--asr-backend", "torch", "--asr-compute-type", "bfloat16",
                          "--asr-max-graphs", "9")
    assert (config.asr.model, config.asr.backend, config.asr.compute_type, config.asr.max_graphs) == \
        ("/models/w", "torch", "bfloat16", 9)
    with pytest.raises(ValueError, match="asr_backend must be one of auto, ct2, torch, got 'onnx'"):
        ServerConfig.of(asr_backend="onnx")
    with pytest.raises(ValueError, match="need asr whisper"):
        ServerConfig.of(asr="pocketsphinx", asr_model="/models/w")
    with pytest.raises(ValueError, match=r"asr_model: .*no such directory"):
        build_whisper_engine(ServerConfig.of(asr_model="/nonexistent/w"), placement(ServerConfig.of(device="cpu")), None)
