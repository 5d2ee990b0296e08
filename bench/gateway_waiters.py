"""Waiting generation requests and SSE streams held at once, against /healthz: what the gateway
costs while it holds --waiters `POST /v1/images/generations` requests whose jobs cannot end yet
and --streams `GET /v1/jobs/{id}/events` streams.

Each variant gets a private redis-server and `sdfarm gateway` in its own process, with no
worker and no scheduler, so every job stays queued and every request keeps waiting (the farm
of a busy worker, seen from the gateway). An asyncio client (httpx.AsyncClient) measures
/healthz alone, opens the waiters and the streams, waits until they are all held (every
waiter's job in Redis, every stream past its first event) or --settle seconds pass, lets
--quiet seconds go by (the last requests enter their wait: subscribing, a first read), measures
/healthz again (p50/p99/max) and reads the gateway process (psutil: CPU seconds to open them
all and CPU share while they are held, RSS, threads) and Redis's connected clients. Then it
cancels the queued jobs until every waiter has its answer (409 job_cancelled) and every
stream its `cancelled` event: nobody is left hanging.

With --baseline REF (a git ref, e.g. main), the same run first serves the gateway of REF's
gateway/, client/ and store/ (extracted with `git archive` into a temporary folder and put
first on PYTHONPATH), so the two lines are side by side in one run on one machine.

    python bench/gateway_waiters.py [--waiters 500] [--streams 200] [--baseline main]
                                    [--json bench/results/gateway_waiters.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from gateway_load import free_port, measure, pct, raise_fd_limit

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-no-such-worker"
PACKAGES = ("native", "store", "worker", "scheduler", "client", "cli", "localfarm", "gateway")
BASELINE_PARTS = ("gateway", "client", "store")


@contextlib.contextmanager
def baseline_tree(ref: str) -> Iterator[str]:
    """A PYTHONPATH entry whose `sdfarm` package is REF's gateway, client and store (the rest
    from this tree: they did not change); REF may also be a folder holding those three (for
    a machine without the git history)."""
    with tempfile.TemporaryDirectory(prefix="sdfarm-baseline-") as tmp:
        src = Path(tmp, "src")
        if Path(ref).is_dir():  # a tree already extracted (a machine without the git history)
            src = Path(ref).resolve()
        else:
            src.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", ref, *BASELINE_PARTS],
                check=True, capture_output=True,
            ).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        pkg = Path(tmp, "path", "sdfarm")
        pkg.mkdir(parents=True)
        for name in PACKAGES:
            target = src / name if name in BASELINE_PARTS else ROOT / name
            (pkg / name).symlink_to(target, target_is_directory=True)
        yield str(pkg.parent)


@contextlib.contextmanager
def gateway(token: str, pythonpath: str | None) -> Iterator[tuple[str, int, str]]:
    """(base URL, pid, redis URL) of `sdfarm gateway` over a private redis-server."""
    from sdfarm.localfarm.redis_server import RedisServer

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    with RedisServer.start() as redis_server:
        port = free_port()
        gw = subprocess.Popen(
            [sys.executable, "-m", "sdfarm.cli.main", "gateway", "--port", str(port),
             "--redis", redis_server.url, "--token", token, "--rate-limit", "1e9",
             "--log-level", "warning"],
            env=env,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                if gw.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start")
                time.sleep(0.1)
            yield url, gw.pid, redis_server.url
        finally:
            gw.terminate()
            try:
                gw.wait(15)
            except subprocess.TimeoutExpired:
                gw.kill()
                gw.wait()


def queued_ids(store: Any) -> list[str]:
    from sdfarm.store import keys

    ids = []
    for p in keys.PRIORITIES:
        ids += [x.decode() for x in store.r.lrange(keys.pending_key(p), 0, -1)]
    return ids


def ms(values: list[float]) -> dict[str, float]:
    out = [v * 1000 for v in values]
    return {"p50": pct(out, 50), "p99": pct(out, 99), "max": max(out), "n": len(out)}


async def run(args: argparse.Namespace, url: str, token: str, pid: int, redis_url: str) -> dict:
    from sdfarm.store import Store

    store = Store.connect(redis_url)
    proc = psutil.Process(pid)
    auth = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=args.waiters + args.streams + 20)
    timeout = httpx.Timeout(args.settle + 600.0, pool=None)
    async with (
        httpx.AsyncClient(base_url=url, headers=auth, limits=limits, timeout=timeout) as http,
        httpx.AsyncClient(base_url=url, timeout=30) as probe,
    ):
        stream_jobs = []
        for k in range(args.stream_jobs):
            r = await http.post("/v1/jobs", json={"model": MODEL, "prompt": f"watched {k}"})
            r.raise_for_status()
            stream_jobs.append(r.json()["id"])
        await measure(probe, 20, args.interval)  # warm up
        idle = await measure(probe, args.samples, args.interval)

        opened = 0
        all_open = asyncio.Event()
        stream_ends: list[str] = []

        async def hold(k: int) -> None:
            nonlocal opened
            job_id = stream_jobs[k % len(stream_jobs)]
            async with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("event: queued"):
                        opened += 1
                        if opened == args.streams:
                            all_open.set()
                    elif line.startswith("event: "):
                        stream_ends.append(line[len("event: ") :])
                        return

        async def wait(k: int) -> int:
            body = {"model": MODEL, "prompt": f"waiter {k}", "size": "64x64",
                    "response_format": "b64_json"}  # fmt: skip
            r = await http.post("/v1/images/generations", json=body)
            return r.status_code

        cpu0, t0 = proc.cpu_times(), time.perf_counter()
        waiters = [asyncio.create_task(wait(k)) for k in range(args.waiters)]
        streams = [asyncio.create_task(hold(k)) for k in range(args.streams)]
        want = args.stream_jobs + args.waiters
        queued = 0
        settle = time.monotonic() + args.settle
        while time.monotonic() < settle:
            queued = await asyncio.to_thread(lambda: len(queued_ids(store)))
            if queued >= want and all_open.is_set():
                break
            await asyncio.sleep(0.2)
        held_s = time.perf_counter() - t0
        await asyncio.sleep(args.quiet)  # the last requests finish entering their wait
        held = {
            "waiting_requests_open": sum(not t.done() for t in waiters),
            "waiting_jobs_in_farm": queued - args.stream_jobs,
            "streams_open": min(opened, sum(not t.done() for t in streams)),
            "redis_clients": int(store.r.info("clients")["connected_clients"]),
            "pubsub_channels": len(store.r.pubsub_channels()),
        }
        cpu1, t1 = proc.cpu_times(), time.perf_counter()
        loaded = await measure(probe, args.samples, args.interval)
        cpu2, t2 = proc.cpu_times(), time.perf_counter()
        figures = {
            "rss_mib": proc.memory_info().rss / 2**20,
            "threads": proc.num_threads(),
            "cpu_s_to_hold": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
            "hold_s": held_s,
            "cpu_pct_while_held": 100
            * ((cpu2.user + cpu2.system) - (cpu1.user + cpu1.system))
            / (t2 - t1),
        }
        held["waiting_requests_still_open_after"] = sum(not t.done() for t in waiters)

        t3 = time.perf_counter()
        drain = time.monotonic() + args.drain
        while time.monotonic() < drain and not all(t.done() for t in waiters + streams):
            for job_id in await asyncio.to_thread(queued_ids, store):
                await asyncio.to_thread(store.cancel, job_id, "bench")
            await asyncio.sleep(0.2)
        answers = [t.result() for t in waiters if t.done() and not t.exception()]
        for t in waiters + streams:
            t.cancel()
        await asyncio.gather(*waiters, *streams, return_exceptions=True)
    store.close()
    return {
        "held": held,
        "healthz_idle_ms": ms(idle),
        "healthz_loaded_ms": ms(loaded),
        "gateway": figures,
        "release": {
            "s": time.perf_counter() - t3,
            "answers": {str(c): answers.count(c) for c in sorted(set(answers))},
            "streams_ended": {k: stream_ends.count(k) for k in sorted(set(stream_ends))},
        },
    }


def line(name: str, r: dict) -> str:
    h, g, i, held = r["held"], r["gateway"], r["healthz_idle_ms"], r["healthz_loaded_ms"]
    pad = "\n" + " " * 10
    return (
        f"{name:<9} waiters open {h['waiting_requests_open']:>4} (jobs in farm "
        f"{h['waiting_jobs_in_farm']:>4})  streams {h['streams_open']:>4}  "
        f"Redis clients {h['redis_clients']:>3}, channels {h['pubsub_channels']:>3}{pad}"
        f"/healthz idle p50 {i['p50']:.2f} p99 {i['p99']:.2f} ms | held p50 {held['p50']:.2f} "
        f"p99 {held['p99']:.2f} max {held['max']:.2f} ms{pad}"
        f"gateway CPU {g['cpu_s_to_hold']:.2f} s to open, {g['cpu_pct_while_held']:.0f} % "
        f"while held, RSS {g['rss_mib']:.0f} MiB, {g['threads']} threads{pad}"
        f"released in {r['release']['s']:.1f} s: {r['release']['answers']}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiters", type=int, default=500, help="waiting generation requests (500)")
    p.add_argument("--streams", type=int, default=200, help="SSE streams (200)")
    p.add_argument("--stream-jobs", type=int, default=20, help="jobs the streams watch (20)")
    p.add_argument("--samples", type=int, default=300, help="/healthz requests measured (300)")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between them (0.02)")
    p.add_argument("--settle", type=float, default=60.0, help="most seconds to get all held")
    p.add_argument("--quiet", type=float, default=3.0, help="seconds between held and measured")
    p.add_argument("--drain", type=float, default=120.0, help="most seconds to release all")
    p.add_argument("--target-ms", type=float, default=50.0, help="the held p99 to meet (50)")
    p.add_argument(
        "--baseline", default=None, help="a git ref (or folder) to measure first, side by side"
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    raise_fd_limit()

    variants: list[tuple[str, str | None]] = [("this", None)]
    base_name = Path(args.baseline).name if args.baseline else ""
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if args.baseline:
            variants.insert(0, (base_name, stack.enter_context(baseline_tree(args.baseline))))
        for name, path in variants:
            token = secrets.token_hex(16)
            with gateway(token, path) as (url, pid, redis_url):
                results[name] = asyncio.run(run(args, url, token, pid, redis_url))
            print(line(name, results[name]), flush=True)

    mine = results["this"]
    ok = (
        mine["held"]["waiting_jobs_in_farm"] == args.waiters
        and mine["held"]["streams_open"] == args.streams
        and mine["healthz_loaded_ms"]["p99"] < args.target_ms
    )
    print(f"target: {args.waiters} waiters and {args.streams} streams held, /healthz p99 < "
          f"{args.target_ms:g} ms: {'met' if ok else 'MISSED'}")  # fmt: skip
    if args.json:
        doc = {
            "bench": "gateway_waiters",
            "args": vars(args),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_avg_after": os.getloadavg(),
            },
            "results": results,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
