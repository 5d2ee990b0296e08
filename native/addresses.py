"""Webhook URLs and the address policy that keeps a farm from calling into its own network.

A webhook makes the farm's scheduler send an HTTP request to a URL the job's submitter chose.
Without a policy that is a server-side request forgery (SSRF): a caller of the gateway could
make the farm POST to its Redis, a cloud metadata service (169.254.169.254) or anything else
on the private network behind it. So a webhook URL is refused unless every address its host
resolves to is a public one (`ipaddress`'s `is_global`, and not multicast: private, loopback,
link-local, carrier-grade NAT, multicast, reserved and unspecified addresses are all out; an
IPv4-mapped IPv6 address is judged by its IPv4 address).

The operator may allow private addresses (a farm whose receivers live on its own network, or
tests whose receiver is on 127.0.0.1) with `SDFARM_WEBHOOK_ALLOW_PRIVATE`: `1` allows any
address, a comma list of networks (`10.1.0.0/16,127.0.0.1`) allows those. Every process that
checks a URL (the client or gateway at submit, the scheduler at delivery) reads it, at each
check, so it must be the same in all of them.

The check runs twice: at submit (a clear error naming the option before anything is queued)
and again at delivery, whose connection then goes to an address this check returned (a name
that resolved to a public address at submit and to a private one later, DNS rebinding, is
refused then; the connection never resolves the name a second time). Resolution is a
parameter (`resolve`), so the policy is tested on any answer without a DNS server.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import SplitResult, urlsplit

from sdfarm.native.errors import InvalidParameterError

MAX_URL_CHARS = 2048
SCHEMES = ("http", "https")
ALLOW_ENV = "SDFARM_WEBHOOK_ALLOW_PRIVATE"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Sequence[str]]


def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (getaddrinfo, TCP), in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def allowed_networks(value: str | None = None) -> bool | tuple[Network, ...]:
    """The operator's allowance ($SDFARM_WEBHOOK_ALLOW_PRIVATE unless `value` is given): True
    for every address, else the networks allowed beside public addresses. ValueError for a
    network that does not parse (an operator's typo must not silently allow nothing or all)."""
    text = (os.environ.get(ALLOW_ENV, "") if value is None else value).strip()
    if text.lower() in ("1", "true", "yes", "all"):
        return True
    if text.lower() in ("", "0", "false", "no"):
        return ()
    return tuple(ipaddress.ip_network(part.strip(), strict=False) for part in text.split(","))


def public(ip: Address) -> bool:
    """Whether `ip` is an address on the public internet (the default policy)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def address_allowed(ip: Address, allow: bool | tuple[Network, ...]) -> bool:
    if allow is True or public(ip):
        return True
    assert allow is not False
    return any(ip.version == net.version and ip in net for net in allow)


def parse_url(name: str, value: Any) -> SplitResult:
    """`value` split, or InvalidParameterError naming `name`: http or https, a host, no user
    name or password (they would be stored with the job and shown in its record), at most
    MAX_URL_CHARS characters, no spaces or control characters."""
    if not isinstance(value, str):
        raise InvalidParameterError(name, f"must be a URL, got {type(value).__name__}")
    if len(value) > MAX_URL_CHARS:
        raise InvalidParameterError(name, f"is {len(value)} characters, at most {MAX_URL_CHARS}")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidParameterError(name, "contains spaces or control characters")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise InvalidParameterError(name, f"is not a URL: {exc}") from None
    if parts.scheme not in SCHEMES:
        raise InvalidParameterError(
            name, f"must be an http:// or https:// URL, got {parts.scheme or 'no'} scheme"
        )
    if not parts.hostname:
        raise InvalidParameterError(name, "has no host")
    if parts.username is not None or parts.password is not None:
        raise InvalidParameterError(name, "must not carry a user name or password")
    return parts


def default_port(parts: SplitResult) -> int:
    return parts.port or (443 if parts.scheme == "https" else 80)


def allowed_addresses(
    name: str,
    value: Any,
    *,
    resolve: Resolver = resolve_host,
    allow: bool | tuple[Network, ...] | None = None,
) -> list[str]:
    """The addresses a request to URL `value` may go to: every one its host resolves to, all
    allowed by the policy (`allow`: allowed_networks() when None). InvalidParameterError
    naming `name` for a bad URL, a host that does not resolve, or any address refused; one
    refused address refuses the URL (a client picking among several could reach it)."""
    parts = parse_url(name, value)
    host = parts.hostname or ""
    policy = allowed_networks() if allow is None else allow
    try:
        found = [
            ipaddress.ip_address(a.split("%", 1)[0]) for a in resolve(host, default_port(parts))
        ]
    except (OSError, UnicodeError) as exc:
        raise InvalidParameterError(name, f"host {host!r} does not resolve: {exc}") from None
    except ValueError as exc:
        raise InvalidParameterError(name, f"host {host!r} resolved to {exc}") from None
    if not found:
        raise InvalidParameterError(name, f"host {host!r} resolves to no address")
    for ip in found:
        if not address_allowed(ip, policy):
            raise InvalidParameterError(
                name,
                f"host {host!r} is {ip}, a private, loopback, link-local, multicast or "
                f"reserved address; webhooks go to public addresses only (the operator may "
                f"allow others with {ALLOW_ENV})",
            )
    return [str(ip) for ip in found]


def check_url(name: str, value: Any, *, resolve: Resolver = resolve_host) -> str:
    """`value` if it is a webhook URL the policy allows now; "" (no webhook) stays ""."""
    if value == "":
        return ""
    allowed_addresses(name, value, resolve=resolve)
    return value
