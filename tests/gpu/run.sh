#!/usr/bin/env bash
# The GPU suite in one call (see tests/gpu/README.md): JSON lines on stdout, all results in $1
# (default gpu_suite.json). Uses `python3` unless PYTHON is set; wheels carried in .whl/ are
# installed first into /tmp/site when present.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the repository itself, importable as rtmedia.* without installing it
"$PYTHON" - <<'PY'
import pathlib, site, sys
root = pathlib.Path.cwd()
target = pathlib.Path("/tmp/site/rtmedia")
target.mkdir(parents=True, exist_ok=True)
(target / "__init__.py").write_text("")
for part, folder in {"server": "server", "engines": "engines", "kernels": "kernels", "clients": "clients",
                     "web": "web", "v1": "proto/rtmedia/v1"}.items():
    link = target / part
    if not link.exists():
        link.symlink_to(root / folder)
PY
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "$PYTHON" tests/perf/gpu_suite.py --out "${1:-gpu_suite.json}"
