"""The Host check: a pure ASGI middleware that answers 400 (OpenAI's error shape) to a request
whose `Host` header names no host the gateway serves.

Without it, a web page the user visits can point a name it controls at 127.0.0.1 (DNS
rebinding) and read an open loopback gateway as its own origin; and the image URLs the gateway
hands out are built from the Host header. The allowed hosts are the bind address, the localhost
names and whatever the operator adds (`--allowed-host`): a name ("farm.example.com"), a suffix
("*.example.com" or ".example.com": the name and every subdomain), or "*" for any.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sdfarm.gateway.errors import APIError

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "ip6-localhost")
ANY = "*"


def normalize(host: str) -> str:
    """A Host header's (or a pattern's) name: lower case, without the port, the brackets of
    an IPv6 address or a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


class AllowedHosts:
    """Which Host headers are served."""

    def __init__(self, hosts: Iterable[str]) -> None:
        self.any = False
        self.names: set[str] = set()
        self.suffixes: list[str] = []
        for h in hosts:
            h = h.strip().lower()
            if not h:
                continue
            if h == ANY:
                self.any = True
            elif h.startswith(("*.", ".")):
                suffix = normalize(h.lstrip("*"))
                self.suffixes.append(suffix)
                self.names.add(suffix.lstrip("."))
            else:
                self.names.add(normalize(h))

    def allows(self, header: str | None) -> bool:
        if self.any:
            return True
        if not header:
            return False
        name = normalize(header)
        return name in self.names or any(name.endswith(s) for s in self.suffixes)


def allowed_hosts(bind: str | None, extra: Iterable[str] = ()) -> list[str]:
    """The hosts a gateway bound to `bind` serves: the bind address, the localhost names and
    `extra` (a gateway bound to every address, 0.0.0.0, needs its names in `extra`)."""
    return list(dict.fromkeys([*LOCAL_HOSTS, *([bind] if bind else []), *extra]))


class HostCheck:
    """Refuse (400, code invalid_host) an HTTP request whose Host is not allowed."""

    def __init__(self, app: Any, allowed: AllowedHosts) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.allowed.any:
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope.get("headers") or [] if k == b"host"), None)
        host = raw.decode("latin-1") if raw is not None else None
        if self.allowed.allows(host):
            await self.app(scope, receive, send)
            return
        shown = repr(host[:100]) if host is not None else "missing"
        await APIError(
            400,
            f"invalid Host header ({shown}): this gateway serves only the hosts it was "
            "configured for (sdfarm gateway --allowed-host)",
            param="Host",
            code="invalid_host",
        ).response()(scope, receive, send)
