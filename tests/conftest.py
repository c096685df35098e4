"""Shared fixtures."""

from __future__ import annotations

import pytest

from tests.support.speech import Speaker


@pytest.fixture(scope="session")
def speaker() -> Speaker:
    return Speaker()
