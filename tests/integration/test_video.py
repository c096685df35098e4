"""VideoService.DecodeVideo in-process on the embedded random-weight Wan VAE.

The module's server has a small message limit (100 kB) so chunks of larger
frames travel as several parts."""

from __future__ import annotations

import asyncio
import io

import av
import grpc
import numpy as np
import pytest
import torch
from rtmedia.engines.video.plan import check_chunks
from rtmedia.protocol.errors import error_reason
from rtmedia.v1 import video_pb2, video_pb2_grpc

from tests.integration.test_realtime import utterance
from tests.support.converse import Conversation
from tests.support.waits import until

MAX_SEND = 100_000
SERVER_OPTIONS = {"max_send_bytes": MAX_SEND}
RAW, FMP4 = video_pb2.VIDEO_FORMAT_RAW_RGB24, video_pb2.VIDEO_FORMAT_FMP4_H264
CAUSAL, OVERLAPPED = video_pb2.FRAME_PLAN_CAUSAL, video_pb2.FRAME_PLAN_OVERLAPPED


def latent(t, h, w, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((16, t, h, w)).astype(dtype)


def request(z, **fields):
    dtype = {np.dtype(np.float32): video_pb2.TENSOR_DTYPE_FLOAT32,
             np.dtype(np.float16): video_pb2.TENSOR_DTYPE_FLOAT16}[z.dtype]
    return video_pb2.DecodeVideoRequest(latent=video_pb2.Tensor(shape=z.shape, dtype=dtype, data=z.tobytes()),
                                        **fields)


async def decode(channel, req):
    """All messages of a decode, checked against the chunk contract; returns (messages, chunks)
    where chunks are (message metadata, joined data) per logical chunk."""
    stub = video_pb2_grpc.VideoServiceStub(channel)
    messages = [m async for m in stub.DecodeVideo(req)]
    chunks, parts = [], []
    for m in messages:
        assert m.ByteSize() <= MAX_SEND
        assert m.part == len(parts) and m.parts >= 1
        parts.append(m)
        if m.part + 1 == m.parts:
            head = parts[0]
            for p in parts:
                assert (p.chunk_index, p.total_chunks, p.frame_start, p.frame_count, p.is_final) == \
                    (head.chunk_index, head.total_chunks, head.frame_start, head.frame_count, head.is_final)
            if m.format == RAW:
                assert [p.part_frame_start for p in parts] == \
                    list(np.cumsum([head.frame_start] + [p.part_frame_count for p in parts])[:-1])
                assert sum(p.part_frame_count for p in parts) == head.frame_count
            chunks.append((head, b"".join(p.data for p in parts)))
            parts = []
    assert not parts, "a chunk's parts were cut short"
    check_chunks([(h.chunk_index, h.total_chunks, h.frame_start, h.frame_count, h.is_final) for h, _ in chunks])
    return messages, chunks


def frames_of(chunks):
    head = chunks[0][0]
    return np.concatenate([np.frombuffer(d, np.uint8).reshape(h.frame_count, head.height, head.width, 3)
                           for h, d in chunks])


@pytest.mark.parametrize(("t", "h", "w", "fields", "frames"), [
    (1, 2, 2, {}, 1),
    (5, 4, 4, {}, 17),
    (6, 4, 3, {"latent_steps_per_chunk": 2, "width": 20, "height": 30}, 21),
    (5, 8, 8, {"width": 64, "height": 40}, 17),  # 40x64 frames: 7.7 kB, 4-frame chunks fit one part
    (4, 8, 16, {}, 13),  # 64x128 frames: 24.6 kB, 4-frame chunks split into parts
    (3, 2, 2, {"plan": OVERLAPPED}, 22),
    (9, 2, 3, {"plan": OVERLAPPED, "width": 22}, 39),
])
async def test_chunked_equals_one_shot(channel, t, h, w, fields, frames):
    z = latent(t, h, w, seed=t * 10 + h)
    messages, chunks = await decode(channel, request(z, **fields))
    _, [(one, data)] = await decode(channel, request(z, one_shot=True, **fields))
    assert one.total_chunks == 1 and one.is_final and one.frame_count == frames
    got = frames_of(chunks)
    assert got.shape == (frames, fields.get("height") or 8 * h, fields.get("width") or 8 * w, 3)
    assert np.array_equal(got, frames_of([(one, data)])), "chunked concatenation equals the one-shot decode"
    if fields.get("plan") == OVERLAPPED:
        assert [c.frame_count for c, _ in chunks][-1] == 5
    if w == 16:
        assert any(m.parts > 1 for m in messages)


async def test_float16_and_normalized_latents(server, channel):
    z = latent(3, 2, 2, seed=5)
    _, a = await decode(channel, request(z.astype(np.float16)))
    _, b = await decode(channel, request(z.astype(np.float16).astype(np.float32)))
    assert np.array_equal(frames_of(a), frames_of(b))
    info = server.scheduler.lanes["video"].engine.info
    mean = np.array(info.latents_mean, np.float32).reshape(-1, 1, 1, 1)
    std = np.array(info.latents_std, np.float32).reshape(-1, 1, 1, 1)
    _, c = await decode(channel, request(((z - mean) / std).astype(np.float32), normalized=True))
    _, d = await decode(channel, request(z))
    diff = np.abs(frames_of(c).astype(int) - frames_of(d).astype(int))
    assert diff.max() <= 2, "normalising and de-normalising lands on the same frames (up to rounding)"


async def test_fmp4_plays_while_arriving(channel):
    z = latent(6, 4, 6, seed=3)
    _, chunks = await decode(channel, request(z, format=FMP4, fps=24))
    assert [h.frame_count for h, _ in chunks] == [1, 4, 4, 4, 4, 4]
    data = b"".join(d for _, d in chunks)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert stream.average_rate == 24
    assert len(frames) == 21 and frames[0].shape == (32, 48, 3)
    _, raw = await decode(channel, request(z))
    reference = frames_of(raw).astype(float)
    def psnr(a, b):
        return 10 * np.log10(255 ** 2 / np.mean((a - b) ** 2))

    # The same pictures through a lossy codec (noise-like ones: the VAE's weights are random),
    # frame for frame: each is closer to its own reference than to any other.
    for n, f in enumerate(frames):
        others = max(psnr(f, r) for m, r in enumerate(reference) if m != n)
        assert psnr(f, reference[n]) > max(15, others), (n, psnr(f, reference[n]), others)
    for n in range(1, len(chunks) + 1):  # every prefix of chunks is a playable file
        with av.open(io.BytesIO(b"".join(d for _, d in chunks[:n]))) as container:
            assert len(list(container.decode(video=0))) == sum(h.frame_count for h, _ in chunks[:n])


BAD = [
    ({"shape": [16, 2, 2]}, "BAD_LATENT_SHAPE", "(rank 4), got rank 3: [16, 2, 2]"),
    ({"shape": [16, 0, 2, 2]}, "BAD_LATENT_SHAPE", "zero or negative"),
    ({"shape": [8, 2, 2, 2]}, "BAD_LATENT_CHANNELS", "has 8 channels; this VAE takes 16"),
    ({"data": b"\0" * 12}, "BAD_LATENT_BYTES", "has 12 bytes; shape [16, 2, 2, 2] as TENSOR_DTYPE_FLOAT32 needs 512"),
    ({"dtype": 0}, "BAD_DTYPE", "latent.dtype=0"),
    ({"width": 17}, "BAD_SIZE", "width=17 is larger than the latent allows (16"),
    ({"height": -2}, "BAD_SIZE", "height=-2 is negative"),
    ({"plan": OVERLAPPED}, "LATENT_TOO_SHORT", "the overlapped plan needs at least 3"),
    ({"plan": 7}, "BAD_PLAN", "plan=7"),
    ({"format": 9}, "BAD_FORMAT", "format=9"),
    ({"format": FMP4, "width": 15}, "BAD_SIZE", "even size, got 15x16"),
    ({"fps": -1}, "BAD_FPS", "fps=-1"),
    ({"fps": 1e-30, "format": FMP4}, "BAD_FPS", "fps=1e-30 must be in [0.1, 240]"),
    ({"fps": float("nan")}, "BAD_FPS", "fps=nan"),
    ({"data": np.full((16, 2, 2, 2), np.nan, np.float32).tobytes()}, "NON_FINITE_LATENT",
     "holds 128 NaN or infinite value(s) of 128"),
    ({"latent_steps_per_chunk": -1}, "BAD_STEPS_PER_CHUNK", "is negative"),
]


@pytest.mark.parametrize(("change", "reason", "message"), BAD)
async def test_bad_input_is_invalid_argument(server, channel, change, reason, message):
    z = latent(2, 2, 2)
    req = request(z)
    change = dict(change)
    tensor = change.pop("shape", None), change.pop("data", None), change.pop("dtype", None)
    if tensor[0] is not None:
        del req.latent.shape[:]
        req.latent.shape.extend(tensor[0])
    if tensor[1] is not None:
        req.latent.data = tensor[1]
    if tensor[2] is not None:
        req.latent.dtype = tensor[2]
    for k, v in change.items():
        setattr(req, k, v)
    steps = server.scheduler.lanes["video"].engine.steps_run
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode(channel, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(err.value) == reason
    assert message in err.value.details()
    assert server.scheduler.lanes["video"].engine.steps_run == steps, "nothing was decoded"


async def test_frame_over_the_message_limit_is_refused(channel):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode(channel, request(latent(1, 24, 24)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(err.value) == "FRAME_TOO_LARGE" and "ask for fMP4" in err.value.details()


# The hostile probe's payloads, refused by the default limits before any work: a 1.2 MB latent that
# decoded 1536x1536 frames (+1.08 GB), and a 640 kB one that held the video lane for 132 s.
OVER_LIMITS = [
    ((16, 1, 192, 192), np.float32, {"format": FMP4}, "LATENT_TOO_LARGE",
     "latent.shape[2] (H, latent height) = 192 is over the limit video_max_latent_height=160"),
    ((16, 20000, 1, 1), np.float16, {}, "LATENT_TOO_LONG",
     "latent.shape[1] (T, latent frames) = 20000 is over the limit video_max_latent_frames=128"),
    ((16, 2, 100, 160), np.float16, {"format": FMP4}, "FRAME_TOO_MANY_PIXELS",
     "decoded frame pixels (1280x800: latent 100x160 x spatial ratio 8; width/height only crop) = 1024000"),
]


@pytest.mark.parametrize(("shape", "dtype", "fields", "reason", "message"), OVER_LIMITS)
async def test_requests_over_the_limits_are_refused_before_any_work(server, channel, shape, dtype, fields, reason,
                                                                    message):
    engine = server.scheduler.lanes["video"].engine
    steps = engine.steps_run
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode(channel, request(np.zeros(shape, dtype), **fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_reason(err.value) == reason
    assert message in err.value.details()
    assert engine.steps_run == steps and not engine.streams, "nothing was decoded"


async def test_a_large_non_finite_latent_is_refused(server, channel):
    z = latent(5, 32, 32)  # 327 kB: checked off the event loop
    z[9, 4, 31, 0] = np.inf
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode(channel, request(z, format=FMP4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_reason(err.value) == "NON_FINITE_LATENT"
    assert "holds 1 NaN or infinite value(s) of 81920" in err.value.details()


async def test_cancel_stops_at_the_next_step_and_frees_the_cache(server, channel):
    engine = server.scheduler.lanes["video"].engine
    stub = video_pb2_grpc.VideoServiceStub(channel)
    call = stub.DecodeVideo(request(latent(40, 8, 8)))
    await call.read()
    await call.read()
    assert engine.cached_streams == 1
    [stream] = engine.streams.values()
    call.cancel()
    await until(lambda: not engine.streams)
    # cached_streams only counts open streams, so look at the closed one's own cache.
    await until(lambda: stream.cache is None)
    assert engine.cached_streams == 0
    steps = engine.steps_run
    await asyncio.sleep(0.3)
    assert engine.steps_run == steps, "no step runs after the cancel"
    assert server.metrics.video_decodes_total.labels("cancelled")._value.get() >= 1


async def test_slow_reader_pauses_its_decode(server):
    engine = server.scheduler.lanes["video"].engine
    # Without BDP probing the HTTP/2 stream window stays at 64 KiB, so what the transport
    # can absorb is small and the server's own bounded queue shows.
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        call = video_pb2_grpc.VideoServiceStub(channel).DecodeVideo(request(latent(40, 8, 8)))  # 49 kB chunks
        first = await call.read()
        await asyncio.sleep(2.0)  # ~25 steps' worth of time without reading
        [stream] = engine.streams.values()
        paused_at = stream.steps_done
        await asyncio.sleep(0.5)
        assert stream.steps_done == paused_at < 12, "the decode waits for the reader"
        rest = [first]
        while (m := await call.read()) is not grpc.aio.EOF:
            rest.append(m)
    assert [m.chunk_index for m in rest] == list(range(40)) and rest[-1].is_final


async def test_failed_step_ends_only_its_stream(server, channel, monkeypatch):
    engine = server.scheduler.lanes["video"].engine
    real = engine.decode_step
    doomed: set[int] = set()

    def failing(stream):
        if stream.id in doomed and stream.steps_done == 3:
            raise RuntimeError("injected decode failure")
        return real(stream)

    monkeypatch.setattr(engine, "decode_step", failing)
    z = latent(8, 4, 4, seed=8)
    reference = frames_of((await decode(channel, request(z)))[1])
    original_open = engine.open_stream

    def open_doomed(*args, **kwargs):
        stream = original_open(*args, **kwargs)
        if not doomed:
            doomed.add(stream.id)
        return stream

    monkeypatch.setattr(engine, "open_stream", open_doomed)
    bad_call = asyncio.ensure_future(decode(channel, request(z)))
    await until(lambda: doomed)  # the first stream opened is the bad call's, not the good one's
    good_call = decode(channel, request(z))
    bad, good = await asyncio.gather(bad_call, good_call, return_exceptions=True)
    assert isinstance(bad, grpc.aio.AioRpcError), bad
    assert bad.code() == grpc.StatusCode.INTERNAL and error_reason(bad) == "DECODE_FAILED"
    assert "injected decode failure" in bad.details() and "step 4 of 8" in bad.details()
    assert np.array_equal(frames_of(good[1]), reference), "the other stream is untouched"
    await until(lambda: not engine.streams)
    assert np.array_equal(frames_of((await decode(channel, request(z)))[1]), reference), "the next decode works"


async def test_out_of_memory_is_resource_exhausted(server, channel, monkeypatch):
    engine = server.scheduler.lanes["video"].engine

    def oom(stream):
        raise torch.OutOfMemoryError("injected: tried to allocate 13 GiB")

    monkeypatch.setattr(engine, "decode_step", oom)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode(channel, request(latent(2, 2, 2)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(err.value) == "OUT_OF_MEMORY"
    monkeypatch.undo()
    await decode(channel, request(latent(2, 2, 2)))


async def test_fmp4_writer_failure_ends_the_stream(channel, monkeypatch):
    import rtmedia.server.services.video as video_service

    def broken(*args):
        raise RuntimeError("injected: no H.264 encoder")

    monkeypatch.setattr(video_service, "Fmp4Writer", broken)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(decode(channel, request(latent(2, 2, 2), format=FMP4)), 20)
    assert err.value.code() == grpc.StatusCode.INTERNAL and error_reason(err.value) == "DECODE_FAILED"
    assert "no H.264 encoder" in err.value.details()


async def response_latency(channel, pcm, rate) -> float:
    """speech_stopped -> first reply audio (docs/protocol.md#latency-definitions), seconds, for one turn."""
    async with Conversation(channel) as c:
        await c.wait_for("session.created")
        await c.stream(pcm, rate)
        stopped = await c.wait_for("input_audio_buffer.speech_stopped", timeout=20)
        audio = await c.wait_for("response.output_audio.delta", timeout=20)
        await c.wait_for("response.done", timeout=20)
    return audio["t"] - stopped["t"]


@pytest.mark.serial  # bounds a latency: other test processes on the same cores would be in it
async def test_speech_keeps_its_latency_during_a_long_decode(server, channel, speaker):
    rate = 24000
    pcm, _, _ = utterance(speaker, "Please remember to buy milk and bread.", rate, tail=0.8)
    engine = server.scheduler.lanes["video"].engine
    baseline = [await response_latency(channel, pcm, rate) for _ in range(2)]
    stop = asyncio.Event()

    async def decoding():
        while not stop.is_set():
            await decode(channel, request(latent(12, 8, 8)))

    before = engine.steps_run
    background = asyncio.create_task(decoding())
    try:
        await until(lambda: engine.steps_run > before, what="the background decode stepping")
        during = [await response_latency(channel, pcm, rate) for _ in range(2)]
        steps = engine.steps_run - before
    finally:
        stop.set()
        await background
    assert steps > 20, "the decode ran alongside the speech"
    assert max(during) <= 1.5 * max(baseline) + 0.15, (baseline, during)


async def test_health_says_serving(channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="rtmedia.v1.VideoService"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_decode_video_cli(server, channel, tmp_path):
    import json
    import sys
    from pathlib import Path

    z = latent(4, 4, 4, seed=4)
    np.save(tmp_path / "lat.npy", z[None])
    rtmedia = str(Path(sys.executable).with_name("rtmedia"))
    proc = await asyncio.create_subprocess_exec(
        rtmedia, "decode-video", str(tmp_path / "lat.npy"), "-o", str(tmp_path / "out.mp4"), "--raw-dir",
        str(tmp_path / "raw"), "--fps", "8", "--json", "--target", f"127.0.0.1:{server.port}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert [c["frames"] for c in lines[:-1]] == [1, 4, 4, 4] and lines[-2]["is_final"]
    assert lines[-1]["type"] == "summary" and lines[-1]["frames"] == 13 and lines[-1]["first_frame_ms"] > 0
    raw = np.concatenate([np.load(tmp_path / "raw" / f"chunk_{n:05d}.npy") for n in range(4)])
    _, chunks = await decode(channel, request(z))
    assert np.array_equal(raw, frames_of(chunks))
    with av.open(str(tmp_path / "out.mp4")) as container:
        assert len(list(container.decode(video=0))) == 13 and container.streams.video[0].average_rate == 8
