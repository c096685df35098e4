"""No function of the package runs past the house limit of lines: one that long does more than
one thing, and the steps it runs through want names of their own. A function's length is from its
`def` to its last line, its docstring and any functions nested in it included. Generated protobuf
code is not ours to split and is left out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The folders that make up the rtmedia package (pyproject's package-dir), less the generated code.
PACKAGES = ("server", "engines", "kernels", "clients", "web", "proto/rtmedia/protocol")
LIMIT_LINES = 80


def function_lengths(path: Path) -> dict[str, int]:
    """`name:line` -> lines, for every function and method in the file, nested ones too."""
    lengths = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lengths[f"{node.name}:{node.lineno}"] = (node.end_lineno or node.lineno) - node.lineno + 1
    return lengths


def long_functions() -> dict[str, int]:
    """`path:name:line` -> lines, for each function of the package over the limit."""
    return {f"{path.relative_to(ROOT)}:{where}": lines
            for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
            for where, lines in function_lengths(path).items() if lines > LIMIT_LINES}


def test_no_function_passes_the_length_limit() -> None:
    over = long_functions()
    assert not over, f"split these functions into steps named after what they do (limit {LIMIT_LINES} lines): {over}"


def test_the_length_counts_the_docstring_and_nested_functions(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text('class A:\n    async def f(self):\n        """Doc,\n        two lines."""\n\n'
                    '        def g():\n            return 1\n        return g\n\n\nx = 1\n')
    assert function_lengths(path) == {"f:2": 7, "g:6": 2}
    assert any(path.name == "bridge.py" for path in (ROOT / "web").rglob("*.py"))
