"""The session bounds are settings: `serve` flags (or YAML keys) reach the sessions' Limits,
and a bound that is not a positive integer is refused in one line."""

from __future__ import annotations

import pytest
from rtmedia.server import cli
from rtmedia.server.app import RtmediaServer


def test_session_flags_reach_the_sessions_limits() -> None:
    args = cli.build_parser().parse_args([
        "serve", "--no-llm", "--responder", "echo", "--session-outbox-events", "10", "--session-outbox-bytes", "4096",
        "--session-text-chars", "300", "--session-instructions-chars", "400", "--session-id-bytes", "64"])
    limits = RtmediaServer(cli.config_from_args(args)).realtime.context.limits
    assert (limits.max_outbox_events, limits.max_outbox_bytes, limits.max_text_chars,
            limits.max_instructions_chars, limits.max_id_bytes) == (10, 4096, 300, 400, 64)


def test_defaults_are_the_documented_ones() -> None:
    limits = RtmediaServer(cli.config_from_args(cli.build_parser().parse_args(["serve", "--no-llm", "--responder", "echo"]))
                           ).realtime.context.limits
    assert (limits.max_outbox_events, limits.max_outbox_bytes, limits.max_text_chars,
            limits.max_instructions_chars, limits.max_id_bytes) == (4096, 8 * 1024 * 1024, 2000, 2000, 256)


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bound_must_be_a_positive_integer(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--session-id-bytes", value])
    assert "expected a positive integer" in capsys.readouterr().err
