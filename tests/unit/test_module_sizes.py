"""No module of the package grows past the house limit (docs: DESIGN's "split one that grows
past" it): a module that large holds more than one thing, and its name no longer says what is
in it. Generated protobuf code is not ours to split and is left out."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The folders that make up the rtmedia package (pyproject's package-dir), less the generated code.
PACKAGES = ("server", "engines", "kernels", "clients", "web", "proto/rtmedia/protocol")
LIMIT_BYTES = 40_000


def module_sizes() -> dict[str, int]:
    """Every .py module under the package folders, by its path from the checkout's root."""
    return {str(path.relative_to(ROOT)): path.stat().st_size
            for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))}


def test_no_module_passes_the_size_limit() -> None:
    sizes = module_sizes()
    assert len(sizes) > 20 and "web/bridge.py" in sizes, sorted(sizes)
    over = {path: size for path, size in sizes.items() if size > LIMIT_BYTES}
    assert not over, f"split these modules into ones named after what they hold (limit {LIMIT_BYTES} bytes): {over}"
