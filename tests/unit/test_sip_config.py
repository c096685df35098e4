"""The SIP door's configuration and the pure parts of its calls: flags, the --sip-config file,
per-call settings, accept rules, transfer targets, INVITE headers and instruction fields."""

from __future__ import annotations

import argparse

import pytest
from rtmedia.web.telephony.sip import CallInfo, fill, invite_headers, uri_user
from rtmedia.web.telephony.sip_cli import add_sip_flags, sip_argv, sip_config
from rtmedia.web.telephony.sip_config import AcceptRules, SipConfig, Trunk, host_port, load_file, port_range


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_sip_flags(p, aliases=True)
    return p.parse_args(argv)


def test_flags_make_a_config_and_round_trip_for_serve():
    args = parse("--sip-listen", "0.0.0.0:5080", "--rtp-ports", "30000-30099", "--max-calls", "3",
                 "--sip-public-address", "203.0.113.7", "--sip-control", "off")
    config = sip_config(args)
    assert config.listen == ("0.0.0.0", 5080) and config.rtp_ports == (30000, 30099) and config.max_calls == 3
    assert config.public_address == "203.0.113.7" and config.control is None
    assert sip_argv(args) == ["--sip-listen", "0.0.0.0:5080", "--sip-public-address", "203.0.113.7",
                              "--sip-rtp-ports", "30000-30099", "--sip-max-calls", "3", "--sip-control", "off"]


@pytest.mark.parametrize("argv, message", [
    (("--sip-listen", "nope:port"), "--sip-listen must be HOST:PORT"),
    (("--rtp-ports", "5-3"), "--sip-rtp-ports must be LOW-HIGH"),
    (("--rtp-ports", "40000-40005", "--max-calls", "4"), "holds 3 calls"),
    (("--max-calls", "0"), "within 1..4"),
    (("--max-calls", "5"), "holds 4 calls a process"),
    (("--sip-tls-listen", "127.0.0.1:5061"), "needs --sip-tls-cert"),
    (("--sip-register", "not-a-uri"), "must be a SIP URI"),
    (("--sip-register", "sip:host.example"), "names no user"),
    (("--sip-password-file", "/x"), "goes with --sip-register"),
    (("--sip-config", "/nonexistent.yaml"), "No such file"),
])
def test_bad_flags_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        sip_config(parse(*argv))


def test_the_password_comes_from_its_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RTMEDIA_SIP_PASSWORD", "from-env")
    config = sip_config(parse("--sip-register", "sip:1555@trunk.example:5080"))
    (trunk,) = config.trunks
    assert (trunk.username, trunk.password, trunk.registrar) == ("1555", "from-env", "sip:trunk.example:5080")
    (tmp_path / "pw").write_text("from-file\n")
    config = sip_config(parse("--sip-register", "sip:1555@trunk.example", "--sip-password-file", str(tmp_path / "pw")))
    assert config.trunks[0].password == "from-file"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="the file is empty"):
        sip_config(parse("--sip-register", "sip:1555@trunk.example", "--sip-password-file", str(tmp_path / "empty")))


def test_the_config_file_sets_trunks_numbers_rules_and_codecs(tmp_path):
    (tmp_path / "pw").write_text("secret")
    (tmp_path / "sip.yaml").write_text(f"""
session: {{responder: echo, instructions: "Hi {{caller}}"}}
numbers:
  "+15551230000": {{voice: en_US-joe-medium}}
  conference-room: {{echo_cancellation: true}}
trunks:
  - {{name: carrier, register: "sip:alice@sip.example", password_file: {tmp_path / 'pw'}, max_calls: 2,
      session: {{responder: openai}}}}
accept: {{deny: ["+1900*"], allow: ["+1*", "sip:*@pbx.example"]}}
transfer: {{allow: ["sip:desk@*"]}}
headers: ["X-Customer"]
codecs: [pcmu]
""")
    config = SipConfig(**load_file(str(tmp_path / "sip.yaml")))
    (trunk,) = config.trunks
    assert (trunk.name, trunk.password, trunk.max_calls) == ("carrier", "secret", 2)
    assert config.for_call("+15551230000", trunk) == {"responder": "openai", "instructions": "Hi {caller}",
                                                      "voice": "en_US-joe-medium"}
    assert config.for_call("other", None) == {"responder": "echo", "instructions": "Hi {caller}"}
    assert config.accept.decide("+15550001", "sip:+15550001@x") and not config.accept.decide("+19005550", "")
    assert config.accept.decide("bob", "sip:bob@pbx.example") and not config.accept.decide("bob", "sip:bob@else")
    assert config.may_transfer_to("sip:desk@10.0.0.1") and not config.may_transfer_to("sip:other@10.0.0.1")
    assert config.codecs == ("PCMU",) and config.headers == ("X-Customer",)
    assert not config.echo_cancellation and config.for_call("conference-room", None)["echo_cancellation"] is True
    assert sip_config(parse("--sip-echo-cancellation", "on")).echo_cancellation


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "a mapping at the top"),
    ("nonsense: 1", "unknown keys nonsense"),
    ("session: {temperature: 2}", "unknown session settings temperature"),
    ("numbers: {room: {echo_cancellation: maybe}}", "echo_cancellation must be true or false"),
    ("trunks: [{name: x}]", "needs `register"),
    ("accept: {webhook: ftp://x}", "http\\(s\\) URL"),
    ("codecs: [opus]", "some of G722, PCMU, PCMA"),
    ("a: [", "not YAML"),
])
def test_a_bad_config_file_names_its_mistake(tmp_path, text, message):
    (tmp_path / "sip.yaml").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_file(str(tmp_path / "sip.yaml"))


def test_host_port_and_port_range():
    assert host_port("[::1]:5060", "--x") == ("::1", 5060)
    assert host_port("example.org", "--x", 5061) == ("example.org", 5061)
    assert port_range("10000-10001", "--x") == (10000, 10001)
    with pytest.raises(ValueError):
        port_range("10000-10000", "--x")


def test_the_parts_of_an_invite_the_call_keeps():
    assert uri_user('"Alice" <sip:+15551230000@pbx.example>;tag=1') == "+15551230000"
    assert uri_user("<tel:+15551230000>") == "+15551230000"
    assert uri_user("garbage") == ""
    message = ("INVITE sip:x@y SIP/2.0\r\nVia: SIP/2.0/UDP h\r\nX-Customer: 42\r\nx-other: a\r\n"
               "P-Asserted-Identity: <sip:1@x>\r\n\r\nv=0\r\nX-Not-A-Header: 1\r\n")
    assert invite_headers(message, ("X-*",)) == {"X-Customer": "42", "x-other": "a"}
    assert invite_headers(message, ("p-asserted-identity",)) == {"P-Asserted-Identity": "<sip:1@x>"}


def test_instructions_take_the_caller_the_number_and_headers():
    info = CallInfo("id", "inbound", "+1555", "+1444", headers={"X-Customer": "42"})
    text = "Caller {caller} dialled {called}, customer {header:x-customer}{header:X-Missing}; {literal} {}"
    assert fill(text, info) == "Caller +1555 dialled +1444, customer 42; {literal} {}"


def test_accept_rules_without_patterns_accept_everyone():
    assert AcceptRules().decide("anyone", "sip:anyone@x")
    assert Trunk.from_uri("t", "sip:u@h:5070;transport=tcp", None).registrar == "sip:h:5070"
