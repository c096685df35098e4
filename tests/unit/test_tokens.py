"""The token file (rtmedia.protocol.tokens) and per-token session quotas (server/security/auth.py)."""

from __future__ import annotations

import pytest
from rtmedia.protocol.tokens import TokenTable, bearer, parse_tokens
from rtmedia.server.security.auth import Quotas

A = "a" * 16
B = "b-token.0123456789+/="


def test_token_file_lines_names_and_limits():
    tokens = parse_tokens(f"# comment\n\n{A}\n{B} bob max_sessions=2 sessions_per_minute=30  # trailing\n", "f")
    assert [(t.name, t.max_sessions, t.sessions_per_minute) for t in tokens] == [("token-3", None, None),
                                                                                  ("bob", 2, 30)]


@pytest.mark.parametrize("text, words", [
    ("short", "line 1: a token is at least 16 characters"),
    (f"{A}\n{A} again", "line 2: the same token is listed twice"),
    (f"{A} x\n{B} x", "line 2: the name 'x' is used twice"),
    (f"{A} x max_sessions=0", "max_sessions=N and sessions_per_minute=N, N >= 1"),
    (f"{A} x other=3", "the limits are"),
    (f"{A} x y", "is not a name"),
    ("bad token with spaces", "line 1"),
])
def test_bad_token_files_name_the_line_never_the_token(text, words):
    with pytest.raises(ValueError, match=words) as bad:
        parse_tokens(text, "tokens.txt")
    assert "tokens.txt" in str(bad.value) and A not in str(bad.value)


def test_table_from_file_env_and_reload(tmp_path):
    assert not TokenTable.load(env={}).enabled
    from_env = TokenTable.load(env={"RTMEDIA_AUTH_TOKENS": f"{A},{B} bob"})
    assert from_env.match(B).name == "bob" and from_env.match(A).name == "token-1"
    path = tmp_path / "tokens"
    path.write_text(f"{A} alice\n")
    table = TokenTable.load(str(path))
    assert table.match(A).name == "alice" and table.match(B) is None and table.match(None) is None
    path.write_text(f"{B} bob\n")
    again = table.reloaded()
    assert again.match(B).name == "bob" and again.match(A) is None
    with pytest.raises(ValueError, match="cannot read the token file"):
        TokenTable.load(str(tmp_path / "missing"))


def test_bearer_header():
    assert bearer(f"Bearer {A}") == A and bearer(f"bearer  {A} ") == A
    assert bearer(A) is None and bearer("Basic xyz") is None and bearer("Bearer ") is None and bearer(None) is None


def test_quotas_concurrent_and_per_minute():
    now = [0.0]
    quotas = Quotas(clock=lambda: now[0])
    one, = parse_tokens(f"{A} one max_sessions=1", "f")
    assert quotas.admit(one) is None
    why, retry = quotas.admit(one)
    assert "1 concurrent sessions" in why and retry >= 1
    quotas.release(one)
    assert quotas.admit(one) is None and quotas.active("one") == 1
    two, = parse_tokens(f"{B} two sessions_per_minute=2", "f")
    assert quotas.admit(two) is None
    now[0] = 20.0
    assert quotas.admit(two) is None
    why, retry = quotas.admit(two)
    assert "2 new sessions a minute" in why and retry == 40  # the first one ages out at 60 s
    now[0] = 60.0
    assert quotas.admit(two) is None
    assert quotas.admit(None) is None  # authentication off: no quota


def test_session_caps_bound_what_a_client_may_ask_for():
    """session.update's max_session_s and idle_timeout_s stop at the server's maxima."""
    from rtmedia.server.session.config import ConfigError, SessionSettings
    from rtmedia.v1 import realtime_pb2

    caps = {"max_session_s": 7200, "idle_timeout_s": 600}
    settings = SessionSettings(responder="echo")
    voices = {"v": [22050]}
    assert settings.updated(realtime_pb2.SessionConfig(idle_timeout_s=600), voices, ["echo"], caps=caps) \
        .idle_timeout_s == 600
    for field, value in (("idle_timeout_s", 601), ("max_session_s", 7201)):
        with pytest.raises(ConfigError, match=rf"{field}={value} is outside 1\.\.\d+ \(the server's maximum\)"):
            settings.updated(realtime_pb2.SessionConfig(**{field: value}), voices, ["echo"], caps=caps)
