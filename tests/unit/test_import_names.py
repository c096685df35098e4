"""The checkout's top-level folders never shadow an installed module of the same name
(rtmedia.protocol.import_names): run from the checkout's root, where Python puts it on
`sys.path`, a bare name resolves past the folder and `rtmedia.*` still names the folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_in_checkout(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_an_installed_kernels_wins_over_the_folder_and_transformers_imports():
    done = run_in_checkout("import kernels, rtmedia.kernels\n"
                           "from kernels import CUDAProperties\n"
                           "from transformers import LlamaConfig\n"
                           "print(kernels.__file__); print(rtmedia.kernels.__file__)")
    assert done.returncode == 0, done.stderr
    bare, ours = done.stdout.split()
    assert not Path(bare).is_relative_to(ROOT / "kernels"), bare
    assert "site-packages" in bare
    assert Path(ours) == ROOT / "kernels" / "__init__.py"


def test_a_folder_with_no_namesake_is_not_importable_by_its_bare_name():
    for name in ("server", "engines", "clients", "web"):
        done = run_in_checkout(f"import {name}")
        assert done.returncode == 1
        assert done.stderr.strip().splitlines()[-1] == (
            f"ModuleNotFoundError: No module named {name!r} (the checkout's {name}/ folder is "
            f"rtmedia.{name}, never a top-level module)")
        done = run_in_checkout(f"import rtmedia.{name}, sys; assert {name!r} not in sys.modules")
        assert done.returncode == 0, done.stderr
