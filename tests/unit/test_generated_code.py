"""The committed *_pb2.py, *_pb2_grpc.py and .pyi files are what protoc makes of proto/ now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "proto" / "rtmedia" / "v1"


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    fresh = {p.name: p.read_text() for p in (tmp_path / "rtmedia" / "v1").iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in GENERATED.iterdir()
                 if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))}
    assert set(fresh) == set(committed), "generated files differ from the committed set: run `make proto`"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale generated code in proto/rtmedia/v1: {stale}; run `make proto` and commit"


def test_every_proto_has_generated_code():
    for proto in GENERATED.glob("*.proto"):
        assert (GENERATED / f"{proto.stem}_pb2.py").is_file(), f"{proto.name} was never generated"
