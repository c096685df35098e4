"""Every package folder of the checkout is in the distribution, and nothing else is: pyproject.toml
lists each package by its import name ([tool.setuptools] packages) and maps it to its folder
([tool.setuptools.package-dir]). A folder with an `__init__.py` that the lists miss would be left
out of a wheel while the editable install of a checkout still finds it; a name whose folder is
gone would fail the build."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The top-level folders whose package folders the distribution ships, by the import name of each.
ROOTS = {"server": "rtmedia.server", "engines": "rtmedia.engines", "kernels": "rtmedia.kernels",
         "clients": "rtmedia.clients", "web": "rtmedia.web", "proto/rtmedia": "rtmedia"}


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folders() -> dict[str, str]:
    """Import name -> folder (from the checkout's root) for every folder with an `__init__.py`."""
    found = {}
    for folder, package in ROOTS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            found[".".join([package, *parts])] = str(init.parent.relative_to(ROOT))
    return found


def test_every_package_folder_is_listed_and_mapped() -> None:
    table = setuptools_table()
    folders = package_folders()
    assert len(folders) > 10 and "rtmedia.web" in folders and "rtmedia.v1" in folders, sorted(folders)
    assert sorted(table["packages"]) == sorted(folders)
    assert table["package-dir"] == folders
