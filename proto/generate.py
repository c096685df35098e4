"""Regenerate the committed Python code for proto/rtmedia/v1/*.proto.

    python proto/generate.py            # rewrite the generated files in place
    python proto/generate.py --out DIR  # write them under DIR instead (the freshness test)

Needs grpcio-tools and mypy-protobuf (the project's `dev` extra, pinned so the
output is reproducible).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
SOURCES = sorted((PROTO_ROOT / "rtmedia" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc with the python, grpc and mypy plugins; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    plugin = shutil.which("protoc-gen-mypy", path=str(Path(sys.executable).parent))
    if plugin is None:
        raise SystemExit("protoc-gen-mypy not found next to this Python: install mypy-protobuf")
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={include}",
        f"--plugin=protoc-gen-mypy={plugin}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        *(str(p.relative_to(PROTO_ROOT)) for p in SOURCES),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in (out / "rtmedia" / "v1").iterdir() if p.suffix in (".py", ".pyi"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: proto/)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
