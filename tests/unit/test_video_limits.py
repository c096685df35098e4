"""DecodeVideo request limits, finite latents and the fps range (docs/protocol.md#errors), on
parse_request with small synthetic requests: nothing is decoded."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from rtmedia.engines.video.decoder import VaeInfo
from rtmedia.protocol.video_mp4 import Fmp4Writer
from rtmedia.server import cli
from rtmedia.server.config import ServerConfig
from rtmedia.server.services.video import (
    DEFAULT_LIMITS,
    MAX_FPS,
    MIN_FPS,
    BadRequest,
    VideoLimits,
    parse_request,
)
from rtmedia.v1 import video_pb2

ROOT = Path(__file__).resolve().parents[2]
INFO = VaeInfo(latent_channels=16, spatial_ratio=8, temporal_ratio=4, latents_mean=None, latents_std=None,
               source="test")
MAX_SEND = 4 * 1024 * 1024
F32, F16, BF16 = video_pb2.TENSOR_DTYPE_FLOAT32, video_pb2.TENSOR_DTYPE_FLOAT16, video_pb2.TENSOR_DTYPE_BFLOAT16
FMP4 = video_pb2.VIDEO_FORMAT_FMP4_H264
SETTINGS = ["video_max_latent_frames", "video_max_latent_height", "video_max_latent_width", "video_max_frames",
            "video_max_frame_pixels", "video_max_total_pixels"]


def request(shape, data: bytes | None = None, dtype=F32, **fields) -> video_pb2.DecodeVideoRequest:
    itemsize = 4 if dtype == F32 else 2
    if data is None:
        data = bytes(int(np.prod(shape)) * itemsize)
    return video_pb2.DecodeVideoRequest(latent=video_pb2.Tensor(shape=shape, dtype=dtype, data=data), **fields)


def refused(req, limits: VideoLimits = DEFAULT_LIMITS) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        parse_request(req, INFO, MAX_SEND, limits)
    return err.value


def test_the_probes_payloads_are_refused_by_the_defaults():
    # 1.2 MB that decoded 1536x1536 frames (+1.08 GB), and 640 kB that held the video lane for 132 s.
    err = refused(request([16, 1, 192, 192]))
    assert err.reason == "LATENT_TOO_LARGE"
    assert str(err) == "latent.shape[2] (H, latent height) = 192 is over the limit video_max_latent_height=160"
    err = refused(request([16, 20000, 1, 1], dtype=F16))
    assert err.reason == "LATENT_TOO_LONG"
    assert str(err) == "latent.shape[1] (T, latent frames) = 20000 is over the limit video_max_latent_frames=128"


def test_the_defaults_admit_720p_clips():
    for shape in ([16, 21, 90, 160], [16, 48, 160, 90]):  # Wan 2.1's 81 frames; the 189-frame anchor, portrait
        job = parse_request(request(shape, dtype=BF16), INFO, MAX_SEND, VideoLimits())
        assert (job.width * job.height, job.plan.total_frames) == (1280 * 720, 1 + 4 * (shape[1] - 1))
    err = refused(request([16, 49, 90, 160], dtype=BF16))  # 193 frames of 720p
    assert err.reason == "VIDEO_TOO_LARGE"


# (limits, shape, extra request fields, reason, message); each request is valid at limit + 1.
OVER = [
    ({"latent_frames": 4}, [16, 5, 1, 1], {}, "LATENT_TOO_LONG",
     "latent.shape[1] (T, latent frames) = 5 is over the limit video_max_latent_frames=4"),
    ({"latent_height": 3}, [16, 1, 4, 2], {}, "LATENT_TOO_LARGE",
     "latent.shape[2] (H, latent height) = 4 is over the limit video_max_latent_height=3"),
    ({"latent_width": 3}, [16, 1, 2, 4], {}, "LATENT_TOO_LARGE",
     "latent.shape[3] (W, latent width) = 4 is over the limit video_max_latent_width=3"),
    ({"frames": 16}, [16, 5, 1, 1], {}, "VIDEO_TOO_LONG",
     "output frames (causal plan of T=5) = 17 is over the limit video_max_frames=16"),
    ({"frames": 21}, [16, 3, 1, 1], {"plan": video_pb2.FRAME_PLAN_OVERLAPPED}, "VIDEO_TOO_LONG",
     "output frames (overlapped plan of T=3) = 22 is over the limit video_max_frames=21"),
    ({"frame_pixels": 383}, [16, 1, 2, 3], {"width": 8, "height": 8}, "FRAME_TOO_MANY_PIXELS",
     "decoded frame pixels (24x16: latent 2x3 x spatial ratio 8; width/height only crop) = 384 is over the "
     "limit video_max_frame_pixels=383"),
    ({"total_pixels": 1279}, [16, 2, 2, 2], {}, "VIDEO_TOO_LARGE",
     "output pixels (5 frames x 16x16) = 1280 is over the limit video_max_total_pixels=1279"),
    ({"total_pixels": 1279}, [16, 2, 2, 2], {"one_shot": True}, "VIDEO_TOO_LARGE", "= 1280 is over the limit"),
]


@pytest.mark.parametrize(("limit", "shape", "fields", "reason", "message"), OVER)
def test_each_limit_refuses_one_over_and_admits_its_value(limit, shape, fields, reason, message):
    [(name, value)] = limit.items()
    err = refused(request(shape, **fields), VideoLimits(**limit))
    assert err.reason == reason and message in str(err)
    assert parse_request(request(shape, **fields), INFO, MAX_SEND, VideoLimits(**{name: value + 1}))


def test_shape_limits_come_before_the_bytes():
    # A shape far beyond the limits is named as such, whatever data came with it.
    err = refused(request([16, 10**12, 1, 1], data=b""))
    assert err.reason == "LATENT_TOO_LONG" and "= 1000000000000 is over" in str(err)
    assert refused(request([16, 1, 10**9, 1], data=b"")).reason == "LATENT_TOO_LARGE"


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_latents_are_refused(dtype, value):
    z = torch.zeros(16, 2, 2, 2, dtype={F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}[dtype])
    z[3, 1, 0, 1] = value
    z[7, 0, 1, 1] = value
    data = z.view(torch.uint8 if dtype == F32 else torch.int16).numpy().tobytes()
    err = refused(request([16, 2, 2, 2], data=data, dtype=dtype))
    assert err.reason == "NON_FINITE_LATENT"
    assert str(err) == "latent.data holds 2 NaN or infinite value(s) of 128; every value must be finite"
    z[3, 1, 0, 1] = z[7, 0, 1, 1] = 65504 if dtype == F16 else 1e30  # large but finite: accepted
    data = z.view(torch.uint8 if dtype == F32 else torch.int16).numpy().tobytes()
    assert parse_request(request([16, 2, 2, 2], data=data, dtype=dtype), INFO, MAX_SEND).latent.isfinite().all()


@pytest.mark.parametrize("fps", [1e-30, 0.05, MIN_FPS * 0.99, -1.0, 240.5, float("inf"), float("nan")])
@pytest.mark.parametrize("fmt", [video_pb2.VIDEO_FORMAT_RAW_RGB24, FMP4])
def test_fps_outside_the_range_is_refused(fps, fmt):
    err = refused(request([16, 2, 2, 2], fps=fps, format=fmt))
    assert err.reason == "BAD_FPS" and re.match(r"fps=\S+ must be in \[0\.1, 240\] \(0: 16\)$", str(err)), str(err)


@pytest.mark.parametrize("fps", [MIN_FPS, 1 / 3, 23.976, 30000 / 1001, MAX_FPS])
def test_fps_in_the_range_is_accepted_and_the_fmp4_writer_takes_it(fps):
    job = parse_request(request([16, 2, 2, 2], fps=fps, format=FMP4), INFO, MAX_SEND)
    writer = Fmp4Writer(job.width, job.height, job.fps)
    frames = np.zeros((5, job.height, job.width, 3), np.uint8)
    assert writer.fragment(frames[:1]) and writer.fragment(frames[1:], True)
    assert parse_request(request([16, 2, 2, 2]), INFO, MAX_SEND).fps == 16.0


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="video_max_frames must be a positive integer, got 0"):
        VideoLimits(frames=0)


def test_settings_reach_the_limits_from_config_flags_and_yaml(tmp_path):
    assert VideoLimits.from_config(ServerConfig()) == VideoLimits()
    flags = [f"--{name.replace('_', '-')}" for name in SETTINGS]
    args = cli.build_parser().parse_args(["serve", *[x for n, f in enumerate(flags) for x in (f, str(n + 7))]])
    assert VideoLimits.from_config(cli.config_from_args(args)) == VideoLimits(7, 8, 9, 10, 11, 12)
    (tmp_path / "a.yaml").write_text("server:\n  video_max_frames: 33\n  video_max_total_pixels: 44\n")
    limits = VideoLimits.from_config(ServerConfig.load(tmp_path / "a.yaml"))
    assert (limits.frames, limits.total_pixels, limits.latent_frames) == (33, 44, 128)
    assert VideoLimits.from_config(ServerConfig.load(ROOT / "deploy" / "rtmedia.yaml")) == VideoLimits()


def test_every_setting_and_reason_is_documented():
    operations = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    deploy = (ROOT / "deploy" / "rtmedia.yaml").read_text(encoding="utf-8")
    for name in SETTINGS:
        assert f"| `{name}` | `--{name.replace('_', '-')}` |" in operations, name
        assert f"  {name}: " in deploy, name
    protocol = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    for reason in ("LATENT_TOO_LONG", "LATENT_TOO_LARGE", "VIDEO_TOO_LONG", "FRAME_TOO_MANY_PIXELS",
                   "VIDEO_TOO_LARGE", "NON_FINITE_LATENT", "BAD_FPS"):
        assert f"| `{reason}` |" in protocol, reason
