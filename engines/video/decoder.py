"""Video decoder engine: diffusers `AutoencoderKLWan`, one latent frame per step.

Each stream owns its causal feature cache (the list the Wan decoder threads
through its causal convolutions), so streams interleave step by step on one
VAE. A step decodes one latent frame: the first of a segment gives 1 frame,
every later one 4 (docs/protocol.md#causal-plan). `decode_full` is the reference: diffusers' own
`vae.decode` of every segment, used for one-shot requests.

On CUDA the steady-state step (every causal-conv cache entry a tensor or an
unused None, none the first chunk's "Rep" marker: from the third latent frame
of a segment on) has fixed shapes for a resolution, so
it runs through the engine's `GraphRunner` (engines/graphs.py): the cache goes
in and comes out as graph inputs/outputs, one graph per resolution, admitted
like any other shape. Earlier steps, and every step on a CPU, run eagerly.
`fast_path="fused"` installs the Triton decoder fast path (kernels/wan.py).

Without a VAE directory the engine builds a small Wan-style VAE (16 latent
channels, spatial ratio 8, temporal ratio 4, as in Wan 2.1) with seeded random
weights: the decode path and its timing are real, the pictures are not.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from rtmedia.engines.base import EngineError
from rtmedia.engines.graphs import GraphConfig, GraphRunner
from rtmedia.engines.video.plan import FramePlan, Step

log = logging.getLogger(__name__)

# The embedded stand-in: Wan 2.1's layout at a fraction of its width (base_dim 96 there).
RANDOM_VAE = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
              "temperal_downsample": [False, True, True]}
RANDOM_VAE_SEED = 20240601


@dataclass(frozen=True)
class VaeInfo:
    latent_channels: int
    spatial_ratio: int
    temporal_ratio: int
    latents_mean: tuple[float, ...] | None
    latents_std: tuple[float, ...] | None
    source: str


@dataclass
class VideoStream:
    """One decode: its latent (float32, 1 x C x T' x H x W, already padded), crop and cache."""

    id: int
    latent: torch.Tensor
    plan: FramePlan
    height: int
    width: int
    cache: list[Any] | None = None
    segment: torch.Tensor | None = None  # post_quant_conv of the current segment
    steps_done: int = 0
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class VideoStep:
    """Decode the next step of `stream`'s plan."""

    stream: VideoStream


@dataclass(frozen=True)
class VideoOneShot:
    """Decode all of `stream` with diffusers' `vae.decode`, segment by segment."""

    stream: VideoStream


class VideoEngine:
    name = "video"

    def __init__(self, vae_path: str | None = None, threads: int = 1, device: str = "cpu",
                 graphs: GraphRunner | GraphConfig | None = None, fast_path: str = "off") -> None:
        self.vae_path = vae_path
        self.graphs = graphs if isinstance(graphs, GraphRunner) else GraphRunner(self.name, graphs)
        self.fast_path = fast_path
        self.threads = threads
        self.device = torch.device(device)
        self.vae: Any = None
        self.info: VaeInfo | None = None
        self.streams: dict[int, VideoStream] = {}
        self.steps_run = 0
        self._conv_count = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------
    def load(self) -> None:
        if self.vae is not None:
            return
        from diffusers import AutoencoderKLWan

        if self.threads > 0 and torch.get_num_threads() != self.threads:
            # Process-wide: the LM engine sets the same knob (both default to one thread).
            torch.set_num_threads(self.threads)
        if self.vae_path:
            vae = AutoencoderKLWan.from_pretrained(self.vae_path, torch_dtype=torch.float32, local_files_only=True)
            source = self.vae_path
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(RANDOM_VAE_SEED)
                vae = AutoencoderKLWan(**RANDOM_VAE)
            source = "random"
            log.warning("video: no --video-vae given; using a small Wan-style VAE with seeded random weights "
                        "(real decode path and timing, meaningless pictures)")
        self.vae = vae.to(self.device).eval().requires_grad_(False)
        if self.fast_path != "off":
            from rtmedia.kernels.wan import install

            install(self.vae, self.fast_path)
        cfg = self.vae.config
        temporal = 2 ** sum(bool(x) for x in cfg.temperal_downsample)
        spatial = 2 ** (len(cfg.dim_mult) - 1) * (cfg.patch_size or 1)
        if temporal != 4:
            raise EngineError(f"video VAE {source}: temporal ratio {temporal}; the decode plans need 4")
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        self._conv_count = sum(isinstance(m, WanCausalConv3d) for m in self.vae.decoder.modules())
        mean, std = cfg.latents_mean, cfg.latents_std
        self.info = VaeInfo(cfg.z_dim, spatial, temporal, tuple(mean) if mean else None,
                            tuple(std) if std else None, source)
        log.info("video VAE loaded", extra={"source": source, "latent_channels": cfg.z_dim,
                                            "spatial_ratio": spatial, "threads": torch.get_num_threads()})

    def warmup(self) -> None:
        from rtmedia.engines.video.plan import causal_plan

        assert self.info is not None
        latent = torch.zeros(self.info.latent_channels, 2, 2, 2)
        stream = self.open_stream(latent, causal_plan(2), 0, 0)
        try:
            for _ in stream.plan.steps:
                self.decode_step(stream)
        finally:
            self.close_stream(stream)
        self.steps_run = 0

    def close(self) -> None:
        for stream in list(self.streams.values()):
            self.close_stream(stream)

    # -- streams -------------------------------------------------------------------
    def open_stream(self, latent: torch.Tensor, plan: FramePlan, height: int, width: int,
                    normalized: bool = False) -> VideoStream:
        """`latent` is C x T x H x W (any float dtype); height/width 0 mean the full size."""
        assert self.info is not None
        z = latent.to(device=self.device, dtype=torch.float32).unsqueeze(0)
        if normalized:
            if self.info.latents_mean is None or self.info.latents_std is None:
                raise EngineError("this VAE's config has no latents_mean / latents_std")
            std, mean = (torch.tensor(v, device=z.device).view(1, -1, 1, 1, 1)
                         for v in (self.info.latents_std, self.info.latents_mean))
            z = z * std + mean
        pad = plan.padded_frames - plan.latent_frames
        if pad:  # repeat the last latent frame (overlapped windows)
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        full_h, full_w = z.shape[3] * self.info.spatial_ratio, z.shape[4] * self.info.spatial_ratio
        stream = VideoStream(next(self._ids), z.contiguous(), plan, height or full_h, width or full_w)
        with self._lock:
            self.streams[stream.id] = stream
        return stream

    def close_stream(self, stream: VideoStream) -> None:
        """Free the stream's feature cache. Never waits (it is called on the event loop): a step
        running now finishes, its result is discarded, and that step frees the cache."""
        stream.closed = True
        with self._lock:
            self.streams.pop(stream.id, None)
        if stream.lock.acquire(blocking=False):
            try:
                stream.cache = stream.segment = None
            finally:
                stream.lock.release()

    @property
    def cached_streams(self) -> int:
        """Streams holding a feature cache (for tests and metrics)."""
        with self._lock:
            return sum(1 for s in self.streams.values() if s.cache is not None)

    # -- compute (worker thread) ---------------------------------------------------
    def step(self, items: Sequence[VideoStep | VideoOneShot]) -> list[Any]:
        results: list[Any] = []
        for item in items:
            try:
                if isinstance(item, VideoOneShot):
                    results.append(self.decode_full(item.stream))
                else:
                    results.append(self.decode_step(item.stream))
            except Exception as exc:
                results.append(exc)
        return results

    def decode_step(self, stream: VideoStream) -> np.ndarray:
        """Decode the stream's next latent frame: float [0, 1] frames, T x H x W x 3."""
        try:
            with stream.lock:
                return self._decode_step(stream)
        finally:
            if stream.closed:  # closed while this step held the lock: close_stream left the cache to us
                with stream.lock:
                    stream.cache = stream.segment = None

    @torch.inference_mode()
    def _decode_step(self, stream: VideoStream) -> np.ndarray:
        """`decode_step` with the stream's lock held."""
        if stream.closed:
            raise EngineError(f"video stream {stream.id} is closed")
        step: Step = stream.plan.steps[stream.steps_done]
        if step.fresh:
            stream.cache = [None] * self._conv_count
            stream.segment = self.vae.post_quant_conv(stream.latent[:, :, step.start:step.stop])
        assert stream.segment is not None and stream.cache is not None
        i = step.index - step.start
        x = stream.segment[:, :, i:i + 1]
        if not step.fresh and not any(isinstance(c, str) for c in stream.cache):
            layout = tuple(isinstance(c, torch.Tensor) for c in stream.cache)
            out, *tensors = self.graphs.run(lambda x, *c: self._steady_step(layout, x, *c), x,
                                            *(c for c in stream.cache if c is not None), tag=layout)
            it = iter(tensors)
            stream.cache = [next(it) if held else None for held in layout]
        else:
            out = self.graphs.eager(lambda x: self.vae.decoder(x, feat_cache=stream.cache, feat_idx=[0],
                                                               first_chunk=step.fresh), x)
        stream.steps_done += 1
        if stream.steps_done == len(stream.plan.steps) or stream.plan.steps[stream.steps_done].fresh:
            stream.cache = None  # the segment is done: free its cache now
            stream.segment = None
        self.steps_run += 1
        return self._frames(out, stream)

    def _steady_step(self, layout: tuple[bool, ...], x: torch.Tensor, *cache: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
        """A decode step with a settled feature cache, as a function of tensors: (frames, *new cache).
        `layout` says which cache entries hold tensors (the others stay None)."""
        it = iter(cache)
        feat = [next(it) if held else None for held in layout]
        out = self.vae.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=False)
        if tuple(isinstance(c, torch.Tensor) for c in feat) != layout:
            raise EngineError("video decoder cache layout changed in a steady step")
        return (out, *(c for c in feat if c is not None))

    @torch.inference_mode()
    def decode_full(self, stream: VideoStream) -> list[np.ndarray]:
        """diffusers' `vae.decode` of each segment: float [0, 1] frames per step, as
        `decode_step` would have given them (the one-shot reference)."""
        outputs = []
        for start, stop in stream.plan.segments:
            if stream.closed:
                raise EngineError(f"video stream {stream.id} is closed")
            frames = self._frames(self.vae.decode(stream.latent[:, :, start:stop]).sample, stream, decoded=True)
            counts = [s.frames for s in stream.plan.steps if s.start == start]
            outputs += np.split(frames, np.cumsum(counts)[:-1])
        self.steps_run += len(stream.plan.steps)
        return outputs

    def _frames(self, out: torch.Tensor, stream: VideoStream, decoded: bool = False) -> np.ndarray:
        """Decoder output -> float [0, 1] T x H x W x 3, cropped. `decoded`: `vae.decode`
        has already unpatchified and clamped it (as `_decode` does, in that order)."""
        if not decoded:
            if self.vae.config.patch_size is not None:
                from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

                out = unpatchify(out, patch_size=self.vae.config.patch_size)
            out = torch.clamp(out, min=-1.0, max=1.0)
        out = out[0, :, :, :stream.height, :stream.width]
        return ((out + 1.0) / 2.0).permute(1, 2, 3, 0).float().cpu().numpy()
