"""Imports between the top-level folders flow one way (docs/architecture.md, "Folders"):
proto and kernels import nothing of rtmedia; engines -> kernels; server -> proto, engines,
kernels; clients -> proto and the pure audio helpers of engines; web -> proto, clients and
the same helpers. The console entry point is the one module that imports every door, and each
folder's `__init__` imports the bare-name guard (rtmedia.protocol.import_names)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# import name -> folder
FOLDERS = {"v1": "proto", "protocol": "proto", "server": "server", "engines": "engines",
           "kernels": "kernels", "clients": "clients", "web": "web"}
SOURCES = {"proto": ROOT / "proto" / "rtmedia", **{f: ROOT / f for f in FOLDERS.values() if f != "proto"}}
ALLOWED = {
    "proto": {"proto"},
    "kernels": {"kernels"},
    "engines": {"engines", "kernels"},
    "server": {"server", "proto", "engines", "kernels"},
    "clients": {"clients", "proto"},
    "web": {"web", "proto", "clients"},
}
AUDIO_HELPERS = {"rtmedia.engines.audio.resample"}  # pure numpy, no model: the clients and the web front use them
GUARD = "rtmedia.protocol.import_names"  # every folder's __init__ steps aside under a bare name
ENTRY = ROOT / "server" / "cli.py"  # the `rtmedia` console script


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute rtmedia module the file imports, at any depth (lazy imports count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "rtmedia":
                found += [(node.lineno, f"rtmedia.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("rtmedia.")]


def edges() -> list[tuple[str, str, str]]:
    """(file:line, its folder, the module it imports) for every import that crosses a rule."""
    bad = []
    for folder, source in SOURCES.items():
        for path in sorted(source.rglob("*.py")):
            if path == ENTRY:
                continue
            for line, module in imported_modules(path):
                if module == GUARD and path.name == "__init__.py" and path.parent == source:
                    continue
                target = FOLDERS.get(module.split(".")[1])
                if target is None or target in ALLOWED[folder]:
                    continue
                if folder in ("clients", "web") and any(module == h or module.startswith(h + ".")
                                                        for h in AUDIO_HELPERS):
                    continue
                bad.append((f"{path.relative_to(ROOT)}:{line}", folder, module))
    return bad


def test_imports_flow_one_way() -> None:
    assert edges() == []


def test_the_checker_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("from rtmedia import clients\n\ndef f():\n    import rtmedia.web.bridge\n"
                    "    from rtmedia.server.app import x\n    from .sibling import y\n")
    assert [m for _, m in imported_modules(path)] == ["rtmedia.clients", "rtmedia.web.bridge", "rtmedia.server.app"]


def test_every_folder_is_checked() -> None:
    assert all(source.is_dir() and any(source.rglob("*.py")) for source in SOURCES.values())
    assert (ROOT / "proto" / "rtmedia" / "protocol" / "events.py").is_file()
