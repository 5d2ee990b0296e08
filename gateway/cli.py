"""`sdfarm gateway [--host 127.0.0.1] [--port 8000] [--redis URL] [--token T ...]
[--operator-token T ...] [--trusted-proxy CIDR ...] [--allowed-host HOST ...]`.

Tokens come from --token (repeatable) and $SDFARM_GATEWAY_TOKENS, operator tokens from
--operator-token (repeatable) and $SDFARM_GATEWAY_OPERATOR_TOKENS (both variables comma- or
space-separated). A job submitted with a token belongs to it: a normal token sees, streams,
fetches and cancels only its own jobs (another's answer 404) and, on the status page (`/`,
`/v1/status`), only its own jobs besides the queues and device figures; an operator token sees
everything. With any token configured, the status page needs a token too, loopback clients
included (a browser signs in once at `/?token=T`, which sets a session cookie). With no token
at all the gateway serves only on a loopback address, open to every local client: binding
anywhere else without a token is refused before anything listens.

The rate limit (--rate-limit requests a minute) is counted per token, else per client address;
a failed authentication counts against the address. With --max-jobs N a token may have N
live jobs (queued, placed or running) at once. Both are counted in the farm's Redis, so every
gateway replica in front of one farm enforces one limit. The address is the TCP peer: behind a
reverse proxy, give the proxy's address with --trusted-proxy CIDR (repeatable; default none)
and the client's address is then read from X-Forwarded-For as that proxy wrote it. Never trust
a proxy that does not overwrite or append to X-Forwarded-For itself.

Requests must name this gateway in their Host header (so that a web page cannot rebind a name
of its own to the gateway's address): the bind address and the localhost names are accepted,
and every --allowed-host HOST (repeatable: a name, "*.example.com" for a domain and its
subdomains, or "*" for any host). A gateway bound to 0.0.0.0 behind a name needs that name.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import socket
import sys

ENV_TOKENS = "SDFARM_GATEWAY_TOKENS"
ENV_OPERATOR_TOKENS = "SDFARM_GATEWAY_OPERATOR_TOKENS"
EXIT_USAGE = 2
SHUTDOWN_GRACE_S = 5.0
"""How long a stopping gateway waits for open requests (an event stream of a queued job may
stay open for hours) before it closes them."""


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address ("localhost" included)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def collect_tokens(given: list[str], env: str | None) -> list[str]:
    tokens = [t for t in given if t]
    tokens += [t for t in re.split(r"[,\s]+", env or "") if t]
    return list(dict.fromkeys(tokens))


def check_bind(host: str, tokens: list[str]) -> str | None:
    """The refusal message for serving on `host` with `tokens` (normal and operator tokens
    together), or None when it is allowed."""
    if tokens or is_loopback(host):
        return None
    return (
        f"refusing to serve on {host} without a token: give --token T (or set {ENV_TOKENS}), "
        "or bind to 127.0.0.1"
    )


def _network(value: str) -> str:
    """argparse type of --trusted-proxy: an address or a CIDR."""
    try:
        ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an address or CIDR: {value!r}") from None
    return value.strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sdfarm gateway", description="HTTP gateway: OpenAI images API, jobs API, metrics"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis", default=None, help="the farm's Redis URL (else as `sdfarm status`)")
    p.add_argument(
        "--token",
        action="append",
        default=[],
        help=f"a bearer token; it sees its own jobs (repeatable; +${ENV_TOKENS})",
    )
    p.add_argument(
        "--operator-token",
        action="append",
        default=[],
        help=f"a bearer token that sees every job (repeatable; +${ENV_OPERATOR_TOKENS})",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds /v1/images/generations and edits wait"
    )
    p.add_argument(
        "--rate-limit",
        type=float,
        default=600.0,
        help="API requests a minute per token (per client address without one)",
    )
    p.add_argument(
        "--max-jobs",
        type=int,
        default=0,
        metavar="N",
        help="live jobs (queued, placed or running) a token may have at once; 0: no limit",
    )
    p.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        type=_network,
        metavar="CIDR",
        help="a reverse proxy whose X-Forwarded-For names the client (repeatable; default none)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a Host header to serve besides the bind address and localhost: a name, "
        "*.domain, or * for any (repeatable)",
    )
    p.add_argument("--log-level", default="info")
    return p


class _RedactTokens(logging.Filter):
    """Keep `?token=...` (the status page's sign-in) out of the access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                re.sub(r"([?&]token=)[^&\s]*", r"\1***", a) if isinstance(a, str) else a
                for a in record.args
            )
        return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokens = collect_tokens(args.token, os.environ.get(ENV_TOKENS))
    operators = collect_tokens(args.operator_token, os.environ.get(ENV_OPERATOR_TOKENS))
    refusal = check_bind(args.host, tokens + operators)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    from sdfarm.localfarm.state import find_redis_url

    url = find_redis_url(args.redis)
    if not url:
        print(
            "error: no farm running: start one with `sdfarm up`, or give --redis URL "
            "(or set SDFARM_REDIS_URL)",
            file=sys.stderr,
        )
        return 6  # EXIT_FARM of `sdfarm`
    import uvicorn

    from sdfarm.gateway.app import create_app
    from sdfarm.gateway.hosts import allowed_hosts

    hosts = allowed_hosts(args.host, args.allowed_host)
    app = create_app(
        url,
        tokens=tokens,
        operator_tokens=operators,
        timeout_s=args.timeout,
        rate_per_minute=args.rate_limit,
        max_jobs_per_token=args.max_jobs,
        trusted_proxies=args.trusted_proxy,
        allowed_hosts=hosts,
    )
    print(
        f"sdfarm gateway on http://{args.host}:{args.port} (farm {url}; {len(tokens)} token(s), "
        f"{len(operators)} operator token(s); hosts {', '.join(hosts)}; trusted proxies "
        f"{', '.join(args.trusted_proxy) or 'none'})",
        file=sys.stderr,
        flush=True,
    )
    logging.getLogger("uvicorn.access").addFilter(_RedactTokens())
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
