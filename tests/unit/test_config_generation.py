"""The `serve` flags and the deploy file's keys come from one declaration (rtmedia.protocol.settings):
every setting has a flag and a key, `rtmedia serve --help` shows one group per section, a deprecated
spelling still works and says the new one, and a bad key or value is refused naming the key."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from rtmedia.protocol.settings import iter_fields, sections
from rtmedia.server.cli import ServeConfig, build_parser, config_from_args


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_setting_has_one_key_and_a_flag_of_the_serve_parser() -> None:
    parser = serve_parser()
    dests = {action.dest for action in parser._actions}
    keys = ServeConfig.keys()
    assert len(keys) == len(set(keys)) > 90
    with_flags = [info.key for _, info in iter_fields(ServeConfig) if info.spec.cli]
    assert not [key for key in with_flags if key not in dests]
    # today's spellings are kept
    for flag in ("--responder", "--no-llm", "--web-port", "--sip-listen", "--asr-threads", "--grace"):
        assert flag in parser._option_string_actions, flag


def test_serve_help_is_grouped_by_section() -> None:
    parser = serve_parser()
    titles = [group.title for group in parser._action_groups]
    for section in sections(ServeConfig).values():
        assert section.TITLE in titles, section.TITLE
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "asr: the recogniser:" in out.getvalue() and "tracing: OpenTelemetry:" in out.getvalue()


def test_a_deprecated_spelling_works_and_names_the_new_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--web", "--web-twilio", "--web-twilio-insecure"])
    assert "--twilio-insecure" in capsys.readouterr().err
    assert config_from_args(args).twilio.insecure is True


def test_flat_and_nested_keys_build_the_same_config() -> None:
    flat = ServeConfig.of(asr_threads=2, web=True, web_port=8181)
    nested = ServeConfig.of(asr={"threads": 2}, web={"enabled": True, "port": 8181})
    assert flat == nested and flat.asr.threads == 2 and flat.web.port == 8181


@pytest.mark.parametrize(("values", "named"), [
    ({"asr_thread": 2}, "asr_thread"),
    ({"asr": {"thread": 2}}, "asr.thread"),
    ({"asr_threads": 0}, "asr_threads"),
    ({"turn_detection": "server"}, "turn_detection"),
    ({"record_max_mb": -1}, "record_max_mb"),
])
def test_a_bad_key_or_value_is_refused_naming_the_key(values: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ServeConfig.of(**values)
