"""`rtmedia decode-video`: chunked video decode of a latent, frames written as they arrive."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from rtmedia.clients.client import DEFAULT_TARGET, FRAME_PLANS, VIDEO_DTYPES, VideoClient
from rtmedia.clients.commands.common import CliError, non_negative_int, positive_float
from rtmedia.clients.credentials import add_credential_flags, from_args


def add_video_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode-video", help="decode a video latent on the server; frames stream back chunk by chunk",
        description="Send a latent (.npy, C x T x H x W or 1 x C x T x H x W, float32/float16, in the VAE's input "
                    "space unless --normalized) and write the committed frames as they arrive: -o out.mp4 as "
                    "fragmented MP4 (playable while it grows), --raw-dir DIR as chunk_00000.npy ... (uint8 "
                    "T x H x W x 3). Shows a progress bar and the time to first frame.")
    p.add_argument("input", type=Path, help="latent .npy file")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="output .mp4 (fragmented H.264), or a directory for raw chunks (like --raw-dir)")
    p.add_argument("--raw-dir", type=Path, default=None, help="write each chunk's frames as chunk_NNNNN.npy here")
    p.add_argument("--fps", type=positive_float, default=16.0, help="frames per second of the video (16)")
    p.add_argument("--plan", choices=sorted(FRAME_PLANS), default="causal", help="frame plan (causal)")
    p.add_argument("--width", type=non_negative_int, default=0, help="crop frames to this width (default: full)")
    p.add_argument("--height", type=non_negative_int, default=0, help="crop frames to this height (default: full)")
    p.add_argument("--steps-per-chunk", type=non_negative_int, default=0, help="latent steps per chunk (causal plan; default 1)")
    p.add_argument("--normalized", action="store_true", help="the latent is normalised: apply latents_mean/std")
    p.add_argument("--one-shot", action="store_true", help="ask for the complete decode as a single chunk")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per chunk, then a summary object")
    p.add_argument("--timeout", type=positive_float, default=None, help="give up after this many seconds")
    add_credential_flags(p)
    p.set_defaults(func=cmd_decode_video)


def load_latent(path: Path) -> np.ndarray:
    if not path.is_file():
        raise CliError(f"{path}: {'is a directory, not a .npy file' if path.is_dir() else 'no such file'}")
    try:
        latent = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        raise CliError(f"{path}: not a .npy latent file") from None
    if not isinstance(latent, np.ndarray):
        raise CliError(f"{path}: not a .npy latent (an .npz archive?)")
    if latent.ndim == 5 and latent.shape[0] == 1:
        latent = latent[0]
    if latent.ndim != 4:
        raise CliError(f"{path}: expected C x T x H x W or 1 x C x T x H x W, got shape {latent.shape}")
    if latent.dtype == np.float64:
        latent = latent.astype(np.float32)
    if latent.dtype not in VIDEO_DTYPES:
        raise CliError(f"{path}: dtype {latent.dtype} is not supported; use float32 or float16")
    return latent  # VideoClient sends it little-endian


def _progress(done_frames: int, total_frames: int, chunk: int, chunks: int) -> None:
    width = 30
    filled = width * done_frames // max(total_frames, 1)
    print(f"\r\033[K[{'#' * filled}{'.' * (width - filled)}] chunk {chunk}/{chunks}, "
          f"{done_frames}/{total_frames} frames", end="", file=sys.stderr, flush=True)


def _destinations(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """Where the frames go: the MP4 file (-o out.mp4) and the raw chunks' folder (-o DIR or --raw-dir)."""
    raw_dir = args.raw_dir
    mp4_path = None
    if args.output is not None:
        if args.output.suffix.lower() == ".mp4":
            mp4_path = args.output
        elif raw_dir is None:
            raw_dir = args.output
        else:
            raise CliError(f"-o {args.output}: give an .mp4 file (raw chunks already go to --raw-dir)")
    if mp4_path is None and raw_dir is None:
        raise CliError("say where to write: -o out.mp4, -o DIR or --raw-dir DIR")
    return mp4_path, raw_dir


class _Decoding:
    """One decode's replies as they arrive: each chunk written (raw .npy, the MP4 encoded here from
    raw frames, or the server's fMP4 as is), its progress shown, and the summary at the end."""

    def __init__(self, args: argparse.Namespace, mp4_path: Path | None, raw_dir: Path | None,
                 out: BinaryIO | None) -> None:
        self.args, self.mp4_path, self.raw_dir, self.out = args, mp4_path, raw_dir, out
        self.tty = sys.stderr.isatty() and not args.json
        self.started = time.perf_counter()
        self.first_ms: float | None = None
        self.frames_done = self.chunks_done = 0
        self.writer: Any = None
        self.written: list[Path] = [mp4_path] if mp4_path else []
        self.size: tuple[int, int, float] = (0, 0, 0.0)

    def take(self, reply: Any) -> None:
        args, out = self.args, self.out
        if reply.chunk_index != self.chunks_done:
            raise CliError(f"chunk {reply.chunk_index} arrived out of order")
        t_ms = (time.perf_counter() - self.started) * 1000
        if self.first_ms is None:
            self.first_ms = t_ms
            if not args.json:
                print(f"first frame after {self.first_ms:.0f} ms", file=sys.stderr)
        if reply.frames is not None:
            assert self.raw_dir is not None
            self.written.append(self.raw_dir / f"chunk_{reply.chunk_index:05d}.npy")
            np.save(self.written[-1], reply.frames)
            if out is not None:
                if self.writer is None:
                    from rtmedia.protocol.video_mp4 import Fmp4Writer

                    self.writer = Fmp4Writer(reply.width, reply.height, reply.fps)
                out.write(self.writer.fragment(reply.frames, reply.is_final))
        elif out is not None:
            out.write(reply.data)
        if out is not None:
            out.flush()
        self.frames_done += reply.frame_count
        self.chunks_done += 1
        total_frames = reply.frame_start + reply.frame_count if reply.is_final else None
        if args.json:
            print(json.dumps({"chunk_index": reply.chunk_index, "total_chunks": reply.total_chunks,
                              "frame_start": reply.frame_start, "frames": reply.frame_count,
                              "is_final": reply.is_final, "t_ms": round(t_ms, 1)}), flush=True)
        elif self.tty:
            estimate = total_frames or round(self.frames_done * reply.total_chunks / self.chunks_done)
            _progress(self.frames_done, estimate, self.chunks_done, reply.total_chunks)
        self.size = (reply.width, reply.height, reply.fps)

    def report(self) -> None:
        if not self.chunks_done:
            raise CliError("the server sent no frames")
        total_ms = (time.perf_counter() - self.started) * 1000
        wrote = [str(p) for p in (self.mp4_path, self.raw_dir) if p is not None]
        size, first_ms = self.size, self.first_ms
        if self.args.json:
            print(json.dumps({"type": "summary", "chunks": self.chunks_done, "frames": self.frames_done,
                              "width": size[0], "height": size[1], "fps": size[2],
                              "first_frame_ms": round(first_ms or 0, 1), "total_ms": round(total_ms, 1),
                              "output": wrote}))
        else:
            if self.tty:
                print(file=sys.stderr)
            print(f"wrote {', '.join(wrote)}: {self.frames_done} frames {size[0]}x{size[1]} at {size[2]:g} fps in "
                  f"{self.chunks_done} chunks; first frame after {first_ms:.0f} ms, total {total_ms:.0f} ms",
                  file=sys.stderr)


def cmd_decode_video(args: argparse.Namespace) -> None:
    mp4_path, raw_dir = _destinations(args)
    credentials = from_args(args)
    latent = load_latent(args.input)
    # Raw frames when they are asked for (the MP4 is then encoded here); otherwise the server's fMP4.
    fmt = "numpy" if raw_dir else "fmp4"
    if raw_dir:
        raw_dir.mkdir(parents=True, exist_ok=True)
    out = open(mp4_path, "wb") if mp4_path else None
    decoding = _Decoding(args, mp4_path, raw_dir, out)
    ok = False
    try:
        with VideoClient(args.target, args.timeout, credentials) as client:
            for reply in client.decode(latent, format=fmt, fps=args.fps, plan=args.plan, width=args.width,
                                       height=args.height, normalized=args.normalized,
                                       steps_per_chunk=args.steps_per_chunk, one_shot=args.one_shot):
                decoding.take(reply)
        ok = True
    finally:
        if out is not None:
            out.close()
        if not ok:  # a failed decode: what arrived is not a valid prefix to keep (docs/protocol.md#chunk-contract)
            for path in decoding.written:
                path.unlink(missing_ok=True)
    decoding.report()
