"""Imports between the top-level folders flow one way (docs/architecture.md, "Folders"):
proto and kernels import nothing of rtmedia; engines -> kernels; server -> proto, engines,
kernels; clients -> proto and the pure audio helpers of engines; web -> proto, clients and
the same helpers. The console entry point is the one module that imports every door, and each
folder's `__init__` imports the bare-name guard (rtmedia.protocol.import_names). Inside each
folder, with its subfolders, the import graph has no cycle: a module that imports one that imports
it back holds half of something the two share, which belongs in a small module of its own."""

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


def imported_modules(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """Every rtmedia module the file imports, at any depth (lazy imports count). Relative imports
    are resolved against `package`, the dotted package the file lives in; without it they are left
    out. `from X import n` names X, and X.n as well when n may be a module (X is rtmedia, or
    `package` is given): the caller keeps the names that are modules."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "rtmedia" or package is not None:
                found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level and package is not None:
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("rtmedia.")]


def type_checking_lines(path: Path) -> set[int]:
    """The lines under an `if TYPE_CHECKING:` block: imports there are for annotations only and
    never run, so they make no cycle."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def folder_package(folder: str) -> str:
    """The dotted package a top-level folder maps to (proto/rtmedia holds rtmedia.v1 and rtmedia.protocol)."""
    return "rtmedia" if folder == "proto" else f"rtmedia.{folder}"


def folder_modules(source: Path, package: str) -> dict[str, tuple[Path, str]]:
    """Module name -> (its file, the package it lives in) for every module under `source`, the
    folder mapped to the dotted `package`."""
    modules = {}
    for path in sorted(source.rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        home = ".".join([package, *parts[:-1]])
        name = home if parts[-1] == "__init__" else f"{home}.{parts[-1]}"
        modules[name] = (path, home)
    return modules


def import_graph(source: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same folder it imports, TYPE_CHECKING imports left out."""
    modules = folder_modules(source, package)
    graph = {}
    for name, (path, home) in modules.items():
        skip = type_checking_lines(path)
        graph[name] = {module for line, module in imported_modules(path, home)
                       if module in modules and module != name and line not in skip}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def edges() -> list[tuple[str, str, str]]:
    """(file:line, its folder, the module it imports) for every import that crosses a rule."""
    bad = []
    for folder, source in SOURCES.items():
        for path, home in folder_modules(source, folder_package(folder)).values():
            if path == ENTRY:
                continue
            for line, module in imported_modules(path, home):
                if module.startswith(GUARD) and path.name == "__init__.py" and path.parent == source:
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


def test_no_folder_has_an_import_cycle() -> None:
    found = {folder: cycles(import_graph(source, folder_package(folder))) for folder, source in SOURCES.items()}
    found = {folder: parts for folder, parts in found.items() if parts}
    assert not found, f"move what the modules of each cycle share into a small module of its own: {found}"


def test_the_cycle_checker_sees_lazy_relative_and_not_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("def f():\n    from rtmedia.pkg.sub import b\n")
    (tmp_path / "sub" / "b.py").write_text("from .. import a\nfrom . import c\n")
    (tmp_path / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                            "if TYPE_CHECKING:\n    from ..a import f\n")
    (tmp_path / "d.py").write_text("import rtmedia.pkg.e\n")
    (tmp_path / "e.py").write_text("from .d import x\n")
    graph = import_graph(tmp_path, "rtmedia.pkg")
    assert graph["rtmedia.pkg.a"] == {"rtmedia.pkg.sub", "rtmedia.pkg.sub.b"}
    assert graph["rtmedia.pkg.sub.b"] == {"rtmedia.pkg", "rtmedia.pkg.a", "rtmedia.pkg.sub", "rtmedia.pkg.sub.c"}
    assert graph["rtmedia.pkg.sub.c"] == set()
    assert cycles(graph) == [["rtmedia.pkg.a", "rtmedia.pkg.sub.b"], ["rtmedia.pkg.d", "rtmedia.pkg.e"]]


def test_every_folder_is_checked() -> None:
    assert all(source.is_dir() and any(source.rglob("*.py")) for source in SOURCES.values())
    assert (ROOT / "proto" / "rtmedia" / "protocol" / "events.py").is_file()
