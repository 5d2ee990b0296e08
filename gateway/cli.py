"""`sdfarm gateway [--host 127.0.0.1] [--port 8000] [--redis URL] [--token T ...]`.

Tokens come from --token (repeatable) and $SDFARM_GATEWAY_TOKENS (comma- or space-separated).
With no token the gateway serves only on a loopback address: binding anywhere else without a
token is refused before anything listens.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import socket
import sys

ENV_TOKENS = "SDFARM_GATEWAY_TOKENS"
EXIT_USAGE = 2


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
    """The refusal message for serving on `host` with `tokens`, or None when it is allowed."""
    if tokens or is_loopback(host):
        return None
    return (
        f"refusing to serve on {host} without a token: give --token T (or set {ENV_TOKENS}), "
        "or bind to 127.0.0.1"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sdfarm gateway", description="HTTP gateway: OpenAI images API, jobs API, metrics"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis", default=None, help="the farm's Redis URL (else as `sdfarm status`)")
    p.add_argument(
        "--token", action="append", default=[], help=f"a bearer token (repeatable; +${ENV_TOKENS})"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds /v1/images/generations waits"
    )
    p.add_argument(
        "--rate-limit",
        type=float,
        default=600.0,
        help="API requests a minute per token (per client address without tokens)",
    )
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokens = collect_tokens(args.token, os.environ.get(ENV_TOKENS))
    refusal = check_bind(args.host, tokens)
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

    app = create_app(url, tokens=tokens, timeout_s=args.timeout, rate_per_minute=args.rate_limit)
    print(
        f"sdfarm gateway on http://{args.host}:{args.port} (farm {url}; {len(tokens)} token(s))",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
