"""VideoService.DecodeVideo: committed frame chunks stream out while the VAE decodes.

A request is checked completely before any decoding starts (bad input is
INVALID_ARGUMENT naming the problem), and bounded by the server's VideoLimits
(latent dimensions, output frames, pixels per frame and in all) so no request
buys more work or memory than the operator allows. A producer task then submits the plan's
steps one at a time to the BULK `video` lane, so realtime speech work runs
between any two steps; the assembler turns step frames into committed chunks,
which are encoded (raw RGB24 or an fMP4 fragment) off the loop and put on a
bounded per-stream queue. The handler sends what the queue holds; a slow
reader fills the queue and the producer waits (flow control). A client cancel
cancels the producer at the next step and frees the feature cache; a failed
step ends the stream with INTERNAL (RESOURCE_EXHAUSTED for out-of-memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch
from rtmedia.engines.video.decoder import VaeInfo, VideoStream
from rtmedia.engines.video.plan import Assembler, ChunkFrames, FramePlan, LatentTooShort, PlanError, make_plan
from rtmedia.protocol.errors import abort
from rtmedia.protocol.video_mp4 import Fmp4Writer
from rtmedia.server.lanes.access import EngineAccess
from rtmedia.server.lanes.faults import is_out_of_memory
from rtmedia.v1 import video_pb2, video_pb2_grpc

if TYPE_CHECKING:
    from rtmedia.server.config import ServerConfig

log = logging.getLogger(__name__)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DTYPES = {
    video_pb2.TENSOR_DTYPE_FLOAT32: (torch.float32, 4),
    video_pb2.TENSOR_DTYPE_FLOAT16: (torch.float16, 2),
    video_pb2.TENSOR_DTYPE_BFLOAT16: (torch.bfloat16, 2),
}
PLANS = {video_pb2.FRAME_PLAN_UNSPECIFIED: "causal", video_pb2.FRAME_PLAN_CAUSAL: "causal",
         video_pb2.FRAME_PLAN_OVERLAPPED: "overlapped"}
FORMATS = (video_pb2.VIDEO_FORMAT_RAW_RGB24, video_pb2.VIDEO_FORMAT_FMP4_H264)
DEFAULT_FPS = 16.0
# The fMP4 writer turns fps into a rational with a denominator of at most 1001 (below ~1/2002 fps it
# rounds to 0 and the encoder cannot open); one range for every format keeps clients simple.
MIN_FPS = 0.1
MAX_FPS = 240.0
# Latents larger than this are copied and checked for NaN/inf in a worker thread, not on the loop.
INLINE_PARSE_BYTES = 256 * 1024
# Room for a message's metadata fields under the send limit.
HEADER_ROOM = 4096
_DONE = object()


class BadRequest(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class VideoLimits:
    """Bounds on one DecodeVideo request, checked before any work is accepted; each is the
    ServerConfig setting `video_max_<field>` (docs/operations.md#configuration)."""

    latent_frames: int = 128        # latent T
    latent_height: int = 160        # latent H (x spatial ratio 8: 1280 px)
    latent_width: int = 160         # latent W
    frames: int = 512               # output frames of the plan
    frame_pixels: int = 1280 * 720  # pixels of one decoded frame (before any crop)
    total_pixels: int = 1280 * 720 * 192  # output frames x decoded frame pixels

    def __post_init__(self) -> None:
        for name in ("latent_frames", "latent_height", "latent_width", "frames", "frame_pixels", "total_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.setting(name)} must be a positive integer, got {value!r}")

    @staticmethod
    def setting(name: str) -> str:
        return f"video_max_{name}"

    @classmethod
    def from_config(cls, config: ServerConfig) -> VideoLimits:
        """The limits of a ServerConfig (its video section's `max_*` fields)."""
        return cls(**{f: getattr(config.video, f"max_{f}") for f in cls.__dataclass_fields__})


DEFAULT_LIMITS = VideoLimits()


def _over(reason: str, what: str, value: int, limits: VideoLimits, name: str) -> BadRequest:
    limit = getattr(limits, name)
    return BadRequest(reason, f"{what} = {value} is over the limit {limits.setting(name)}={limit}")


@dataclass(frozen=True)
class VideoJob:
    latent: torch.Tensor  # C x T x H x W
    normalized: bool
    plan: FramePlan
    width: int
    height: int
    fps: float
    format: int
    one_shot: bool


def parse_request(request: video_pb2.DecodeVideoRequest, info: VaeInfo | None, max_send: int,
                  limits: VideoLimits = DEFAULT_LIMITS) -> VideoJob:
    """Check everything about a request against the loaded VAE and the limits; raises BadRequest
    naming the first problem. Shape limits come before anything that costs in proportion to them."""
    assert info is not None
    tensor = request.latent
    shape = list(tensor.shape)
    if len(shape) != 4:
        raise BadRequest("BAD_LATENT_SHAPE", f"latent.shape must be C x T x H x W (rank 4), got rank {len(shape)}: "
                                             f"{shape}")
    if any(d <= 0 for d in shape):
        raise BadRequest("BAD_LATENT_SHAPE", f"latent.shape {shape} has a zero or negative dimension")
    channels, frames, lat_h, lat_w = shape
    if channels != info.latent_channels:
        raise BadRequest("BAD_LATENT_CHANNELS", f"the latent has {channels} channels; this VAE takes "
                                                f"{info.latent_channels}")
    if frames > limits.latent_frames:
        raise _over("LATENT_TOO_LONG", "latent.shape[1] (T, latent frames)", frames, limits, "latent_frames")
    if lat_h > limits.latent_height:
        raise _over("LATENT_TOO_LARGE", "latent.shape[2] (H, latent height)", lat_h, limits, "latent_height")
    if lat_w > limits.latent_width:
        raise _over("LATENT_TOO_LARGE", "latent.shape[3] (W, latent width)", lat_w, limits, "latent_width")
    full_h, full_w = lat_h * info.spatial_ratio, lat_w * info.spatial_ratio
    if full_h * full_w > limits.frame_pixels:
        raise _over("FRAME_TOO_MANY_PIXELS", f"decoded frame pixels ({full_w}x{full_h}: latent {lat_h}x{lat_w} x "
                    f"spatial ratio {info.spatial_ratio}; width/height only crop)", full_h * full_w, limits,
                    "frame_pixels")
    if tensor.dtype not in DTYPES:
        raise BadRequest("BAD_DTYPE", f"latent.dtype={tensor.dtype} is not supported; use FLOAT32, FLOAT16 or "
                                      "BFLOAT16")
    dtype, itemsize = DTYPES[tensor.dtype]
    expected = math.prod(shape) * itemsize
    if len(tensor.data) != expected:
        raise BadRequest("BAD_LATENT_BYTES", f"latent.data has {len(tensor.data)} bytes; shape {shape} as "
                                             f"{video_pb2.TensorDtype.Name(tensor.dtype)} needs {expected}")
    if request.plan not in PLANS:
        raise BadRequest("BAD_PLAN", f"plan={request.plan} is not a FramePlan value")
    if request.latent_steps_per_chunk < 0:
        raise BadRequest("BAD_STEPS_PER_CHUNK", f"latent_steps_per_chunk={request.latent_steps_per_chunk} is negative")
    try:
        plan = make_plan(PLANS[request.plan], frames, request.latent_steps_per_chunk or 1)
    except PlanError as exc:
        raise BadRequest("LATENT_TOO_SHORT" if isinstance(exc, LatentTooShort) else "BAD_PLAN", str(exc)) from None
    if plan.total_frames > limits.frames:
        raise _over("VIDEO_TOO_LONG", f"output frames ({plan.kind} plan of T={frames})", plan.total_frames,
                    limits, "frames")
    total = plan.total_frames * full_h * full_w
    if total > limits.total_pixels:
        raise _over("VIDEO_TOO_LARGE", f"output pixels ({plan.total_frames} frames x {full_w}x{full_h})",
                    total, limits, "total_pixels")
    if request.one_shot:
        plan = plan.one_shot()
    for name, value, full in (("width", request.width, full_w), ("height", request.height, full_h)):
        if value < 0:
            raise BadRequest("BAD_SIZE", f"{name}={value} is negative")
        if value > full:
            raise BadRequest("BAD_SIZE", f"{name}={value} is larger than the latent allows ({full}: "
                                         f"{full // info.spatial_ratio} latent x {info.spatial_ratio})")
    width, height = request.width or full_w, request.height or full_h
    fmt = request.format or video_pb2.VIDEO_FORMAT_RAW_RGB24
    if fmt not in FORMATS:
        raise BadRequest("BAD_FORMAT", f"format={request.format} is not a VideoFormat value")
    if fmt == video_pb2.VIDEO_FORMAT_FMP4_H264 and (width % 2 or height % 2):
        raise BadRequest("BAD_SIZE", f"fragmented MP4 (H.264) needs an even size, got {width}x{height}")
    if fmt == video_pb2.VIDEO_FORMAT_RAW_RGB24 and width * height * 3 > max_send - HEADER_ROOM:
        raise BadRequest("FRAME_TOO_LARGE", f"one {width}x{height} RGB24 frame is {width * height * 3} bytes, over "
                                            f"the {max_send}-byte message limit; ask for fMP4 or a smaller size")
    fps = request.fps or DEFAULT_FPS
    if not MIN_FPS <= fps <= MAX_FPS:  # also refuses NaN
        raise BadRequest("BAD_FPS", f"fps={request.fps:g} must be in [{MIN_FPS:g}, {MAX_FPS:g}] (0: {DEFAULT_FPS:g})")
    latent = torch.frombuffer(bytearray(tensor.data), dtype=dtype).reshape(shape)
    if not bool(torch.isfinite(latent).all()):
        bad = int((~torch.isfinite(latent)).sum())
        raise BadRequest("NON_FINITE_LATENT", f"latent.data holds {bad} NaN or infinite value(s) of "
                                              f"{latent.numel()}; every value must be finite")
    return VideoJob(latent, request.normalized, plan, width, height, fps, fmt, request.one_shot)


@dataclass(frozen=True)
class EncodedChunk:
    frames: ChunkFrames
    data: bytes


class VideoService(video_pb2_grpc.VideoServiceServicer):
    def __init__(self, access: EngineAccess, max_send_bytes: int, queue_chunks: int = 4,
                 limits: VideoLimits = DEFAULT_LIMITS) -> None:
        self.video = access.video
        self.metrics = access.metrics
        self.max_send = max_send_bytes
        self.queue_chunks = queue_chunks
        self.limits = limits

    @classmethod
    def from_config(cls, access: EngineAccess, config: ServerConfig) -> VideoService:
        """The service with a ServerConfig's send limit, queue depth and video limits."""
        return cls(access, config.network.max_send_bytes, config.video.queue_chunks, VideoLimits.from_config(config))

    async def DecodeVideo(self, request, context) -> AsyncIterator[video_pb2.DecodeVideoResponse]:
        started = time.perf_counter()
        try:
            args = (request, self.video.info, self.max_send, self.limits)
            # A large latent's copy and NaN/inf scan run off the loop.
            job = parse_request(*args) if len(request.latent.data) <= INLINE_PARSE_BYTES else \
                await asyncio.to_thread(parse_request, *args)
        except BadRequest as exc:
            await abort(context, INVALID, exc.reason, str(exc))
        self.metrics.bytes_total.labels("in").inc(len(request.latent.data))
        stream = await self.video.open(job.latent, job.plan, job.height, job.width, job.normalized)
        queue: asyncio.Queue[object] = asyncio.Queue(maxsize=self.queue_chunks)
        producer = asyncio.create_task(self._produce(job, stream, queue), name=f"video-{stream.id}")
        outcome = "cancelled"
        try:
            while (item := await queue.get()) is not _DONE:
                if isinstance(item, BaseException):
                    outcome = "failed"
                    await self._fail(context, item, stream)
                assert isinstance(item, EncodedChunk)
                if item.frames.chunk.index == 0:
                    self.metrics.video_first_chunk_seconds.observe(time.perf_counter() - started)
                for message in self._messages(item, job):
                    self.metrics.bytes_total.labels("out").inc(len(message.data))
                    yield message
                self.metrics.video_chunks_total.inc()
            outcome = "completed"
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
            self.video.close(stream)
            self.metrics.video_decodes_total.labels(outcome).inc()

    async def _fail(self, context, exc: BaseException, stream: VideoStream) -> None:
        step = f"step {stream.steps_done + 1} of {len(stream.plan.steps)}"
        if is_out_of_memory(exc):
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, "OUT_OF_MEMORY",
                        f"video decode ran out of memory at {step}; discard the chunks received")
        log.error("video decode failed", exc_info=exc, extra={"stream": stream.id, "step": step})
        await abort(context, grpc.StatusCode.INTERNAL, "DECODE_FAILED",
                    f"video decode failed at {step}: {exc}; discard the chunks received")

    async def _produce(self, job: VideoJob, stream: VideoStream, queue: asyncio.Queue[object]) -> None:
        """Decode step by step; put encoded chunks, then _DONE (or the exception) on the queue."""
        assembler = Assembler(job.plan)
        writer = None
        try:
            if job.format == video_pb2.VIDEO_FORMAT_FMP4_H264:  # opening x264 is codec work: off the loop
                writer = await asyncio.to_thread(Fmp4Writer, job.width, job.height, job.fps)
            if job.one_shot:
                outputs = await self.video.one_shot(stream)
                for chunk in await asyncio.to_thread(self._assemble, assembler, writer, outputs, True):
                    await queue.put(chunk)
            else:
                last = len(job.plan.steps) - 1
                for n in range(last + 1):
                    frames = await self.video.step(stream)
                    for chunk in await asyncio.to_thread(self._assemble, assembler, writer, [frames], n == last):
                        await queue.put(chunk)  # waits while the reader is behind
            await queue.put(_DONE)
        except Exception as exc:
            await queue.put(exc)

    @staticmethod
    def _assemble(assembler: Assembler, writer: Fmp4Writer | None, outputs: list[np.ndarray],
                  last: bool) -> list[EncodedChunk]:
        ready = [chunk for frames in outputs for chunk in assembler.push(frames)]
        if last:
            ready.append(assembler.finish())
        return [EncodedChunk(c, writer.fragment(c.frames, c.is_final) if writer else c.frames.tobytes())
                for c in ready]

    def _messages(self, item: EncodedChunk, job: VideoJob) -> list[video_pb2.DecodeVideoResponse]:
        """One chunk as messages under the send limit (docs/protocol.md#wire-format): raw RGB parts hold whole
        frames; fMP4 parts are consecutive byte ranges of the fragment, each stating the
        chunk's frame range."""
        c = item.frames
        budget = self.max_send - HEADER_ROOM
        if job.format == video_pb2.VIDEO_FORMAT_RAW_RGB24:
            frame_bytes = job.width * job.height * 3
            per_part = max(1, budget // frame_bytes)
            ranges = [(f, min(per_part, c.chunk.frame_count - f)) for f in range(0, c.chunk.frame_count, per_part)]
            pieces = [(c.chunk.frame_start + f, n, item.data[f * frame_bytes:(f + n) * frame_bytes]) for f, n in ranges]
        else:
            pieces = [(c.chunk.frame_start, c.chunk.frame_count, item.data[o:o + budget])
                      for o in range(0, len(item.data), budget)]
        return [
            video_pb2.DecodeVideoResponse(
                chunk_index=c.chunk.index, total_chunks=c.total_chunks, frame_start=c.chunk.frame_start,
                frame_count=c.chunk.frame_count, is_final=c.is_final, part=p, parts=len(pieces),
                part_frame_start=start, part_frame_count=count, width=job.width, height=job.height,
                format=job.format, data=data, fps=job.fps,
            )
            for p, (start, count, data) in enumerate(pieces)
        ]
