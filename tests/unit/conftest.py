"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


async def _no_session(self, settings: dict) -> None:
    self.session_id = "test-session"
    self._session_open.set()


@pytest.fixture
def sessionless(monkeypatch):
    """Browser peers of the web bridge open no gRPC session (only the HTTP front is under test)."""
    from rtmedia.web.webrtc.peer import Peer

    monkeypatch.setattr(Peer, "open_session", _no_session)
