"""Open server-sent event streams against /healthz: how fast the gateway answers its health
check while it holds many `GET /v1/jobs/{id}/events` streams open.

A private redis-server and `sdfarm gateway` in its own process, no worker and no scheduler, so
the jobs stay queued and every stream stays open (reading the job's events until it ends). An
asyncio client (httpx.AsyncClient) submits a few jobs, measures /healthz alone, opens --streams
streams spread over the jobs and waits until each has its first event, then measures /healthz
again while they are all open. Prints p50/p99/max of both and the gateway's threads; the
target is a p99 under 50 ms with 500 streams.

    python bench/gateway_load.py [--streams 500] [--jobs 50] [--samples 300]
                                 [--interval 0.02] [--target-ms 50]
    python bench/gateway_load.py --gateway http://127.0.0.1:8000 --token T  # a running one
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

MODEL = "bench-no-such-worker"


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds a process has used (Linux), or None."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def proc_status(pid: int) -> dict[str, str]:
    """Threads and VmRSS of a process (Linux), or {} elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as f:
            pairs = (line.split(":", 1) for line in f if ":" in line)
            return {k: v.strip() for k, v in pairs if k in ("Threads", "VmRSS")}
    except OSError:
        return {}


@contextlib.contextmanager
def local_gateway(token: str) -> Iterator[tuple[str, int]]:
    """(base URL, pid) of `sdfarm gateway` over a private redis-server with no worker."""
    from sdfarm.localfarm.redis_server import RedisServer

    with RedisServer.start() as redis_server:
        port = free_port()
        gw = subprocess.Popen(
            [sys.executable, "-m", "sdfarm.cli.main", "gateway", "--port", str(port),
             "--redis", redis_server.url, "--token", token, "--rate-limit", "1e9",
             "--log-level", "warning"],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if gw.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start")
                time.sleep(0.1)
            yield url, gw.pid
        finally:
            gw.terminate()
            try:
                gw.wait(15)
            except subprocess.TimeoutExpired:
                gw.kill()
                gw.wait()


async def measure(probe: httpx.AsyncClient, samples: int, interval: float) -> list[float]:
    """/healthz latencies in seconds, one request at a time, `interval` apart."""
    out = []
    for _ in range(samples):
        t = time.perf_counter()
        r = await probe.get("/healthz")
        out.append(time.perf_counter() - t)
        if r.status_code != 200:
            raise RuntimeError(f"/healthz answered {r.status_code}: {r.text[:200]}")
        await asyncio.sleep(interval)
    return out


async def run(args: argparse.Namespace, url: str, token: str, pid: int | None) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=args.streams + 10, max_keepalive_connections=None)
    timeout = httpx.Timeout(60.0, pool=None)
    async with (
        httpx.AsyncClient(base_url=url, headers=auth, limits=limits, timeout=timeout) as streams,
        httpx.AsyncClient(base_url=url, timeout=30) as probe,
    ):
        ids = []
        for k in range(args.jobs):
            r = await streams.post("/v1/jobs", json={"model": MODEL, "prompt": f"load {k}"})
            if r.status_code != 202:
                raise RuntimeError(f"submit answered {r.status_code}: {r.text[:300]}")
            ids.append(r.json()["id"])
        await measure(probe, 20, args.interval)  # warm up
        idle = await measure(probe, args.samples, args.interval)

        opened = 0
        all_open = asyncio.Event()
        errors: list[str] = []

        async def hold(k: int) -> None:
            nonlocal opened
            try:
                async with streams.stream("GET", f"/v1/jobs/{ids[k % len(ids)]}/events") as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"events answered {r.status_code}")
                    async for line in r.aiter_lines():
                        if line.startswith("event: queued"):
                            opened += 1
                            if opened == args.streams:
                                all_open.set()
                raise RuntimeError("a stream ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported, and the run fails
                errors.append(f"stream {k}: {type(exc).__name__}: {exc}")
                all_open.set()

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(hold(k)) for k in range(args.streams)]
        try:
            await asyncio.wait_for(all_open.wait(), args.open_timeout)
        except TimeoutError:
            errors.append(f"only {opened} of {args.streams} streams opened")
        open_s = time.perf_counter() - t0
        if errors:
            raise RuntimeError("; ".join(errors[:5]))
        proc = proc_status(pid) if pid else {}
        cpu0, t1 = cpu_seconds(pid), time.perf_counter()
        loaded = await measure(probe, args.samples, args.interval)
        cpu1, t2 = cpu_seconds(pid), time.perf_counter()
        still_open = sum(not t.done() for t in tasks)
        proc_after = proc_status(pid) if pid else {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    return {
        "idle": idle,
        "loaded": loaded,
        "open_s": open_s,
        "still_open": still_open,
        "threads": proc.get("Threads", "?"),
        "threads_after": proc_after.get("Threads", "?"),
        "rss": proc_after.get("VmRSS", "?"),
        "cpu": None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / (t2 - t1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=500, help="concurrent SSE streams (500)")
    p.add_argument("--jobs", type=int, default=50, help="queued jobs the streams watch (50)")
    p.add_argument("--samples", type=int, default=300, help="/healthz requests measured (300)")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between them (0.02)")
    p.add_argument("--open-timeout", type=float, default=120.0)
    p.add_argument("--target-ms", type=float, default=50.0, help="the p99 to meet (50)")
    p.add_argument("--gateway", default=None, help="a running gateway's URL (else one is started)")
    p.add_argument("--token", default=None, help="its token (with --gateway)")
    args = p.parse_args()
    if args.streams < 1 or args.jobs < 1 or args.samples < 1:
        p.error("--streams, --jobs and --samples must be at least 1")
    raise_fd_limit()

    if args.gateway:
        result = asyncio.run(run(args, args.gateway.rstrip("/"), args.token or "", None))
    else:
        token = secrets.token_hex(16)
        with local_gateway(token) as (url, pid):
            result = asyncio.run(run(args, url, token, pid))

    def line(name: str, values: list[float]) -> str:
        ms = [v * 1000 for v in values]
        return (f"  /healthz {name:<28} p50 {pct(ms, 50):7.2f} ms   p99 {pct(ms, 99):7.2f} ms   "
                f"max {max(ms):7.2f} ms   (n={len(ms)})")  # fmt: skip

    p99 = pct(result["loaded"], 99) * 1000
    print(f"gateway load: {args.streams} SSE streams on {args.jobs} queued jobs")
    print(line("with no stream", result["idle"]))
    print(line(f"with {args.streams} streams open", result["loaded"]))
    print(f"  streams opened (first event each) in {result['open_s']:.2f} s; "
          f"{result['still_open']} still open after the measurement")  # fmt: skip
    if result["threads"] != "?":
        print(f"  gateway process: {result['threads']} threads with the streams open "
              f"({result['threads_after']} after), RSS {result['rss']}")  # fmt: skip
    if result["cpu"] is not None:
        print(f"  gateway CPU while measuring: {result['cpu'] * 100:.0f} % of one core")
    verdict = "met" if p99 < args.target_ms else "MISSED"
    print(f"  target p99 < {args.target_ms:g} ms: {verdict} ({p99:.2f} ms)")
    return 0 if p99 < args.target_ms else 1


if __name__ == "__main__":
    raise SystemExit(main())
