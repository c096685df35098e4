"""The server on CUDA (skipped without CUDA): the engines its settings build run in bfloat16 on the GPU,
the LM decode step is captured as CUDA graphs at warm-up and replayed (counted in
rtmedia_graph_replays_total), `cuda_graphs: false` captures nothing; and a whole server with
`--device cuda --synthetic-lm tiny` answers a response.create from replayed graphs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("rtmedia.server.lanes.placement", reason="the server's settings need PyYAML and prometheus_client")
from rtmedia.server.config import ServerConfig
from rtmedia.server.lanes.placement import build_lm_engines, build_video_engine, placement
from rtmedia.server.observe.metrics import Metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTIONS = dict(device="cuda", synthetic_lm="tiny", lm_slots=4, lm_context=128, lm_batch_sizes=[1, 2, 4])


def replays(metrics: Metrics, engine: str) -> float:
    return metrics.registry.get_sample_value("rtmedia_graph_replays_total", {"engine": engine}) or 0.0


def test_server_lm_engine_captures_and_replays_decode_graphs() -> None:
    metrics, config = Metrics(), ServerConfig.of(**OPTIONS)
    where = placement(config)
    assert where.cuda and where.lm_dtype == torch.bfloat16 and where.lm_quantize is None
    engine = build_lm_engines(config, where, metrics)["llm"]
    engine.load()
    try:
        engine.warmup()
        assert next(engine.model.parameters()).device.type == "cuda" and engine.model.dtype == torch.bfloat16
        assert engine.static_decode and engine.graphs.stats.pinned == len(engine.batch_sizes) == 3
        slot = engine.acquire()
        token = int(engine.prefill(slot, [5, 6, 7]).argmax())
        before = replays(metrics, "llm")
        for _ in range(4):
            token = int(engine.decode({slot: token})[slot].argmax())
        assert replays(metrics, "llm") == before + 4
        assert not engine.graphs.stats.capture_failures
    finally:
        engine.close()
    video = build_video_engine(config, where, metrics)
    assert video.device.type == "cuda"


def test_no_cuda_graphs_captures_nothing() -> None:
    metrics, config = Metrics(), ServerConfig.of(**OPTIONS, cuda_graphs=False)
    engine = build_lm_engines(config, placement(config), metrics)["llm"]
    engine.load()
    try:
        engine.warmup()
        assert not engine.static_decode and engine.graphs.stats.graphs == 0 and replays(metrics, "llm") == 0
    finally:
        engine.close()


async def test_server_on_cuda_answers_from_graphs() -> None:
    pytest.importorskip("rtmedia.server.app", reason="the server's own dependencies (grpc, speech engines)")
    import grpc
    from rtmedia.server.app import RtmediaServer

    from tests.support.converse import Conversation

    server = RtmediaServer(ServerConfig.of(**OPTIONS, llm=True, default_responder="llm", port=0, metrics_port=0,
                                        grace_s=1, max_sessions=8))
    await server.start()
    try:
        engine = server.scheduler.lanes["llm"].engine
        assert engine.static_decode and engine.graphs.stats.pinned == len(engine.batch_sizes)
        before = replays(server.metrics, "llm")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel, Conversation(channel) as c:
            c.send("session.update", session={"max_output_tokens": 12})
            c.send("conversation.item.create", item={"text": "Say something."})
            c.send("response.create")
            done = await c.wait_for("response.done", timeout=60)
            assert done["status"] == "completed", done
            assert c.of_type("response.output_text.done")[0]["text"].strip()
        assert replays(server.metrics, "llm") >= before + 10  # the reply's decode steps came from graphs
    finally:
        await server.stop(0)
