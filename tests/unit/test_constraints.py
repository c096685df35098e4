"""The installed dependency set is the one constraints.txt pins (what CI tested): a version that
drifts, a pinned distribution that is missing, or an installed one that is not pinned fails."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
UNPINNED = {"rtmedia", "pip", "setuptools", "wheel"}  # the project itself and the venv's installer


def pinned() -> dict[str, Requirement]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    requirements = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {canonicalize_name(r.name): r for r in requirements}


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def test_every_pin_is_exact():
    for name, requirement in pinned().items():
        assert re.fullmatch(r"==[^,*]+", str(requirement.specifier)), f"{name}: {requirement.specifier}"


def test_installed_versions_are_the_pinned_ones():
    have = installed()
    drift = {name: (str(r.specifier), have.get(name, "missing")) for name, r in pinned().items()
             if name not in have or not r.specifier.contains(have[name], prereleases=True)}
    assert drift == {}, "installed versions differ from constraints.txt (run `make setup`, or `make lock` " \
                        f"after a deliberate upgrade): {drift}"


def test_nothing_installed_is_unpinned():
    extra = sorted(set(installed()) - set(pinned()) - UNPINNED)
    assert extra == [], f"installed but not in constraints.txt (`make lock` after a deliberate install): {extra}"
