"""What the shared rate limit costs a request: `RateLimiter.take` (the burst and the minute
windows, two sliding-window scripts of the `limits` package) against a private redis-server on
this machine, beside the same limiter counting in process (what one gateway did before the
counts moved to Redis). Prints p50/p99 in ms as JSON.

    python bench/ratelimit_cost.py [--takes 2000] [--callers 50] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

from sdfarm.gateway.ratelimit import MEMORY, RateLimiter
from sdfarm.localfarm.redis_server import RedisServer


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def measure(limiter: RateLimiter, takes: int, callers: int) -> dict[str, float]:
    times = []
    for i in range(takes):
        start = time.perf_counter()
        await limiter.take(f"token:{i % callers}")
        times.append((time.perf_counter() - start) * 1e3)
    await limiter.close()
    return {"p50_ms": round(pct(times, 50), 3), "p99_ms": round(pct(times, 99), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--takes", type=int, default=2000)
    ap.add_argument("--callers", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    server = RedisServer.start()
    try:
        out = {
            "machine": platform.platform(),
            "takes": args.takes,
            "callers": args.callers,
            "redis": asyncio.run(measure(RateLimiter(1e6, server.url), args.takes, args.callers)),
            "in_process": asyncio.run(measure(RateLimiter(1e6, MEMORY), args.takes, args.callers)),
        }
    finally:
        server.stop()
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
