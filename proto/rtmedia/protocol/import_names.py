"""The checkout's top-level folders are packages only under their `rtmedia.*` names.

The repository keeps `server/`, `engines/`, `kernels/`, `clients/` and `web/` at its top level
and maps them into the `rtmedia` namespace (pyproject.toml's `package-dir`). Wherever the
checkout's root is on `sys.path` (a REPL, `python -c` or `python -m` started in it, a script
that adds it to reach `tests.support`), a bare `import kernels` would find the folder and
shadow an installed distribution of the same name: Hugging Face's `kernels`, which transformers
imports. So each folder's `__init__` calls `step_aside` first: imported under its bare name,
the folder hands the import over to whatever else on `sys.path` has that name, or fails as if
it were not there."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def step_aside(name: str, init_file: str) -> None:
    """Called by a top-level folder's `__init__` with its `__name__` and `__file__`. Under an
    `rtmedia.*` name it does nothing; under a bare name it replaces the module being imported
    in `sys.modules` with the one found on `sys.path` without the checkout's root (the import
    statement then returns that one), or raises ModuleNotFoundError."""
    if name.startswith("rtmedia."):
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        del sys.modules[name]
        raise ModuleNotFoundError(f"No module named {name!r} (the checkout's {name}/ folder is "
                                  f"rtmedia.{name}, never a top-level module)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
