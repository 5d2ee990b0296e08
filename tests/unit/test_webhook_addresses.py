"""The webhook address policy (sdfarm.native.addresses) on injected resolver answers: public
addresses pass, every private, loopback, link-local, carrier-grade NAT, multicast, reserved
or unspecified one is refused naming the option, one bad answer among good ones refuses the
URL, and the operator's allowance lets exactly what it names through."""

from __future__ import annotations

import ipaddress

import pytest

from sdfarm.native.addresses import (
    address_allowed,
    allowed_addresses,
    allowed_networks,
    check_url,
)
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import JobOptions, check_options


def answers(*found: str):
    return lambda host, port: list(found)


REFUSED = [
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "127.0.0.1",
    "169.254.169.254",  # cloud metadata
    "100.64.0.1",  # carrier-grade NAT
    "0.0.0.0",
    "224.0.0.1",
    "240.0.0.1",
    "255.255.255.255",
    "::1",
    "fe80::1",
    "fc00::1",
    "ff02::1",
    "::ffff:10.0.0.1",  # IPv4-mapped
    "::",
]


@pytest.mark.parametrize("address", REFUSED)
def test_non_public_addresses_are_refused_naming_the_option(address: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        allowed_addresses("webhook", "https://hooks.example/x", resolve=answers(address), allow=())
    assert info.value.parameter == "webhook"
    assert address.split("%")[0] in str(info.value) or str(ipaddress.ip_address(address)) in str(
        info.value
    )
    assert "SDFARM_WEBHOOK_ALLOW_PRIVATE" in str(info.value)


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    got = allowed_addresses("webhook", "https://a.example/x", resolve=answers(address), allow=())
    assert got == [address]


def test_one_private_answer_among_public_ones_refuses_the_url() -> None:
    with pytest.raises(InvalidParameterError, match="10.1.2.3"):
        allowed_addresses(
            "webhook", "http://a.example/", resolve=answers("8.8.8.8", "10.1.2.3"), allow=()
        )


def test_the_operator_allowance() -> None:
    assert allowed_networks("1") is True and allowed_networks("") == ()
    nets = allowed_networks("127.0.0.1, 10.1.0.0/16")
    assert nets != () and nets is not True
    ok = answers("10.1.9.9")
    assert allowed_addresses("webhook", "http://r.lan/", resolve=ok, allow=nets) == ["10.1.9.9"]
    with pytest.raises(InvalidParameterError):
        allowed_addresses("webhook", "http://r.lan/", resolve=answers("10.2.0.1"), allow=nets)
    assert address_allowed(ipaddress.ip_address("192.168.0.1"), True)
    with pytest.raises(ValueError):
        allowed_networks("10.0.0.0/33")  # a typo is an error, never a silent "allow all"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://a.example/x", "http:// or https://"),
        ("file:///etc/passwd", "http:// or https://"),
        ("https:///x", "no host"),
        ("https://user:pw@a.example/", "user name or password"),
        ("https://a.example/a b", "spaces"),
        ("https://a.example:99999/", "not a URL"),
        ("https://a.example/" + "x" * 3000, "at most 2048"),
        (42, "must be a URL"),
    ],
)
def test_bad_urls_are_refused_before_any_lookup(url: object, why: str) -> None:
    def never(host: str, port: int) -> list[str]:
        raise AssertionError("resolved a URL that should have been refused first")

    with pytest.raises(InvalidParameterError, match=why) as info:
        check_url("webhook", url, resolve=never)
    assert info.value.parameter == "webhook"


def test_a_host_that_does_not_resolve_is_refused() -> None:
    def fails(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    with pytest.raises(InvalidParameterError, match="does not resolve"):
        check_url("webhook", "https://nowhere.invalid/", resolve=fails)


def test_no_webhook_is_the_default_and_needs_no_lookup() -> None:
    assert JobOptions().webhook == "" and check_options(JobOptions()).webhook == ""


def test_the_job_schema_refuses_a_private_webhook_under_the_default_policy(monkeypatch) -> None:
    monkeypatch.delenv("SDFARM_WEBHOOK_ALLOW_PRIVATE", raising=False)
    for url in ("http://10.0.0.1/hook", "http://127.0.0.1:8080/hook", "http://[::1]/"):
        with pytest.raises(InvalidParameterError) as info:
            check_options(JobOptions(webhook=url))
        assert info.value.parameter == "webhook" and str(info.value).startswith("invalid webhook")


def test_every_door_takes_the_webhook_option(monkeypatch) -> None:
    """The CLI's generate and batch flags and a batch's options come from the job schema, so
    `webhook` is one of them and gets the same check."""
    from sdfarm.cli.main import build_parser
    from sdfarm.client.batch import batch_options

    monkeypatch.delenv("SDFARM_WEBHOOK_ALLOW_PRIVATE", raising=False)
    parser = build_parser()
    for argv in (
        ["generate", "p", "--model", "m"],
        ["batch", "f.txt", "--out", "o", "--model", "m"],
    ):
        args = parser.parse_args([*argv, "--webhook", "https://hooks.example/x"])
        assert args.webhook == "https://hooks.example/x"
    with pytest.raises(InvalidParameterError) as info:
        batch_options({"webhook": "http://10.0.0.1/hook"})
    assert info.value.parameter == "webhook"
