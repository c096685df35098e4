"""The browser tests drive Debian's chromium through Playwright."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: the browser tests need Debian's chromium package "
                    "(`make setup` installs it: apt-get install -y chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        pytest.fail("the browser tests need Playwright for Python: pip install -e '.[dev]' (make setup)")
    return CHROMIUM
