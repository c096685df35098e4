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


SESSION_MODULE_LINES = 400  # the session is a lifecycle and its turns; its parts live in their own modules


def test_the_session_module_stays_small() -> None:
    lines = (ROOT / "server/session/session.py").read_text().count("\n")
    assert lines <= SESSION_MODULE_LINES, (
        f"server/session/session.py has {lines} lines (limit {SESSION_MODULE_LINES}): move a part of the session "
        "into a module of its own")


def test_the_session_is_no_mixin() -> None:
    """The session owns its parts; it inherits none of them (a handler has a caller one can find)."""
    import ast

    tree = ast.parse((ROOT / "server/session/session.py").read_text())
    session = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session")
    assert not session.bases, [ast.unparse(b) for b in session.bases]


# The tests' own modules keep the same limit.
def test_no_test_module_passes_the_size_limit() -> None:
    sizes = {str(path.relative_to(ROOT)): path.stat().st_size for path in sorted((ROOT / "tests").rglob("*.py"))}
    assert "tests/unit/test_module_sizes.py" in sizes
    over = {path: size for path, size in sizes.items() if size > LIMIT_BYTES}
    assert not over, f"split these test modules (limit {LIMIT_BYTES} bytes): {over}"
