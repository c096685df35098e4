"""Extract one served version's openAPIV3Schema from an upstream CRD file into KIND.json here.

    python tests/support/crds/vendor.py CRD.yaml VERSION REPOSITORY TAG COMMIT PATH

`description` keys are dropped (they are most of a CRD's size and validate nothing); everything
else of the schema is kept as upstream wrote it. README.md lists the files and their sources.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        # A property may itself be named "description": drop only the annotation, which is a string.
        return {k: strip_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def vendor(crd_file: str, version: str, repository: str, tag: str, commit: str, path: str) -> Path:
    crd = yaml.safe_load(Path(crd_file).read_text(encoding="utf-8"))
    assert crd["kind"] == "CustomResourceDefinition", crd_file
    spec = crd["spec"]
    (served,) = [v for v in spec["versions"] if v["name"] == version and v.get("served")]
    out = HERE / f"{spec['names']['kind'].lower()}.json"
    out.write_text(json.dumps({
        "source": {"repository": repository, "tag": tag, "commit": commit, "path": path},
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "version": version,
        "openAPIV3Schema": strip_descriptions(served["schema"]["openAPIV3Schema"]),
    }, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    print(vendor(*sys.argv[1:7]))
