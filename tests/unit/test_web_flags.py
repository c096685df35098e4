"""The web front's command-line flags reach its typed config (BridgeConfig and the sections it
holds: the OpenAI API, Twilio, the credentials toward the server), and their mistakes are
refused with a message naming the flag; `rtmedia serve --web --no-openai-api` reaches the
server's config."""

from __future__ import annotations

import argparse
import re

import pytest
from rtmedia.web.bridge import BridgeConfig
from rtmedia.web.cli import add_web_parser, bridge_config

from tests.unit.test_web_auth import ALICE, SERVER


def test_openai_flags_reach_the_config():
    from rtmedia.web.openai.openai_api import OpenAIConfig

    parser = argparse.ArgumentParser()
    add_web_parser(parser.add_subparsers())
    assert bridge_config(parser.parse_args(["web"])).openai == OpenAIConfig()
    assert bridge_config(parser.parse_args(["web", "--no-openai-api"])).openai is None
    given = bridge_config(parser.parse_args(["web", "--openai-max-upload-bytes", "4096", "--openai-max-requests", "2"]))
    assert (given.openai.max_upload_bytes, given.openai.max_requests) == (4096, 2)
    with pytest.raises(ValueError, match="upload limit must be at least 1024 bytes, got 10"):
        bridge_config(parser.parse_args(["web", "--openai-max-upload-bytes", "10"]))
    with pytest.raises(ValueError, match="request limit must be at least 1, got 0"):
        bridge_config(parser.parse_args(["web", "--openai-max-requests", "0"]))


def test_twilio_flags_reach_the_config(tmp_path, monkeypatch):
    from rtmedia.web.telephony.twilio import TOKEN_ENV, TwilioConfig, signature

    parser = argparse.ArgumentParser()
    add_web_parser(parser.add_subparsers())
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert bridge_config(parser.parse_args(["web"])).twilio is None
    assert bridge_config(parser.parse_args(["web", "--twilio"])).twilio == TwilioConfig()
    token = tmp_path / "token"
    token.write_text("secret\n")
    given = bridge_config(parser.parse_args(["web", "--twilio", "--twilio-auth-token-file", str(token),
                                             "--twilio-public-url", "https://voice.example/"]))
    assert (given.twilio.auth_token, given.twilio.public_url) == ("secret", "https://voice.example")
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert bridge_config(parser.parse_args(["web", "--twilio"])).twilio.auth_token == "from-env"
    for argv, message in [(["--twilio-insecure"], "need --twilio"),
                          (["--twilio", "--twilio-auth-token-file", str(tmp_path / "none")], "No such file"),
                          (["--twilio", "--twilio-public-url", "voice.example"], "must be http(s)://HOST")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            bridge_config(parser.parse_args(["web", *argv]))
    token.write_text("")
    with pytest.raises(ValueError, match="the file is empty"):
        bridge_config(parser.parse_args(["web", "--twilio", "--twilio-auth-token-file", str(token)]))
    # Twilio's documented example (docs "Webhooks security"): this URL, these parameters, token 12345.
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+12349013030", "Digits": "1234", "From": "+12349013030",
              "To": "+18005551212"}
    from twilio.request_validator import RequestValidator

    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    assert signature("12345", url, params) == RequestValidator("12345").compute_signature(url, params)


def test_server_flags_reach_the_config(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    add_web_parser(parser.add_subparsers())
    monkeypatch.delenv("RTMEDIA_TOKEN", raising=False)
    plain = bridge_config(parser.parse_args(["web"]))
    assert (plain.server_tls, plain.server_token, plain.auth_tokens) == (False, None, None)
    monkeypatch.setenv("RTMEDIA_TOKEN", SERVER)
    assert bridge_config(parser.parse_args(["web"])).server_token == SERVER
    given = bridge_config(parser.parse_args(["web", "--target", "rtmedia.example:443", "--server-ca", "ca.pem",
                                             "--server-cert", "c.pem", "--server-key", "c.key",
                                             "--server-token", ALICE, "--auth-tokens", "t.txt"]))
    assert (given.server_tls, given.server_ca, given.server_cert, given.server_key, given.server_token,
            given.auth_tokens) == (True, "ca.pem", "c.pem", "c.key", ALICE, "t.txt")
    assert parser.parse_args(["web"]).grace == 30.0
    with pytest.raises(ValueError, match="--server-cert and --server-key"):
        BridgeConfig(server_cert="c.pem")
    # A token in plaintext only to this machine.
    with pytest.raises(ValueError, match="plaintext") as info:
        BridgeConfig(target="10.1.2.3:50051", server_token=ALICE)
    assert ALICE not in str(info.value)
    for target in ("127.0.0.1:50051", "[::1]:50051", "localhost:50051", "unix:/tmp/x.sock"):
        assert BridgeConfig(target=target, server_token=ALICE).forwards_tokens
    assert BridgeConfig(target="10.1.2.3:50051", server_tls=True, server_token=ALICE).forwards_tokens
    assert not BridgeConfig(target="10.1.2.3:50051").forwards_tokens
    with pytest.raises(ValueError, match="printable"):
        BridgeConfig(server_token="a token with spaces")


def test_serve_no_openai_api_reaches_the_server_config():
    from rtmedia.server import cli

    def config(*flags):
        return cli.config_from_args(cli.build_parser().parse_args(["serve", "--web", *flags]))

    assert config().web.openai_api and not config("--no-openai-api").web.openai_api
