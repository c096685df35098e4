"""A rule the doors share is written once, in the protocol package, and imported everywhere else:
the playback acknowledgement step (`ACK_EVERY_MS`, rtmedia.protocol.playback) and the names of the
VAD turn kinds (rtmedia.protocol.turn_kinds). Read from the sources, so a copy fails here even
where no test runs the code it sits in."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The folders that make up the rtmedia package (pyproject's package-dir), less the generated code.
PACKAGES = ("server", "engines", "kernels", "clients", "web", "proto/rtmedia/protocol")
DOORS = ("server", "engines", "clients", "web")  # where the turn kinds are used, never spelled
TURN_KIND_LITERALS = {"server_vad", "semantic_vad"}


def modules(folders: tuple[str, ...]) -> dict[str, ast.Module]:
    """Every .py module under `folders`, parsed, by its path from the checkout's root."""
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text(), str(path))
            for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))}


def assigned_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
        for target in targets:
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def test_the_playback_ack_step_is_defined_only_in_the_protocol_package():
    found = modules(PACKAGES)
    assert "proto/rtmedia/protocol/playback.py" in found and "web/playout.py" in found, sorted(found)
    defining = sorted(path for path, tree in found.items() if "ACK_EVERY_MS" in assigned_names(tree))
    assert defining == ["proto/rtmedia/protocol/playback.py"]


def test_no_door_spells_a_vad_turn_kind():
    found = modules(DOORS)
    assert "server/session/config.py" in found and "clients/commands/talk.py" in found, sorted(found)
    spelled = sorted(f"{path}:{node.lineno}: {node.value!r}" for path, tree in found.items()
                     for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and node.value in TURN_KIND_LITERALS)
    assert not spelled, "import the turn kinds from rtmedia.protocol.turn_kinds:\n" + "\n".join(spelled)


def test_the_turn_kinds_module_spells_them():
    tree = ast.parse((ROOT / "proto/rtmedia/protocol/turn_kinds.py").read_text())
    literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    assert TURN_KIND_LITERALS <= literals
