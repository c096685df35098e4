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


async def launch(playwright, chromium: Path, microphone_wav: Path):
    """Headless Chromium whose fake microphone plays `microphone_wav` (looped) and whose pages may
    play audio and take the microphone without a user's gesture."""
    return await playwright.chromium.launch(executable_path=str(chromium), headless=True, args=[
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone_wav}", "--autoplay-policy=no-user-gesture-required",
        "--no-sandbox"])
