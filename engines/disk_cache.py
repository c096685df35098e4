"""Work a server start would repeat, kept on disk across processes: each entry is a folder
named after what made it and a hash of its input's content, written under a temporary name
and renamed into place whole, so a reader sees a complete entry or none. A cache that cannot
be written (a read-only file system) only costs the work again."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """`$RTMEDIA_CACHE`, else `~/.cache/rtmedia/models`."""
    env = os.environ.get("RTMEDIA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rtmedia" / "models"


def content_key(path: Path, version: int) -> str:
    """A file's whole content and the format `version` of what is made from it."""
    digest = hashlib.sha256(f"v{version}:".encode())
    with path.open("rb") as f:
        digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]


def cached_folder(name: str, build: Callable[[Path], None], cache_dir: Path | None = None) -> Path | None:
    """The folder `name` in the cache, made by `build(folder)` when it is not there yet; None
    when it could not be written (the caller then does the work in memory)."""
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    target = cache / name
    if target.is_dir():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=cache))
    except OSError as exc:
        log.warning("cache not writable; doing the work each start", extra={"cache": str(cache), "error": str(exc)})
        return None
    try:
        build(tmp)
        os.rename(tmp, target)  # all or nothing; another process may have won the race
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
