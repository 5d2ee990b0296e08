"""Scrape time of the gateway's /metrics as finished jobs grow: flat, because the counters are
kept as things happen (sdfarm.store.metrics) and a scrape reads O(models x devices) hashes,
never the job records. For contrast, the scan the gateway used to do on every scrape
(`Store.count_by_state`, one HGET per job record) is timed on the same Redis.

A private redis-server; jobs are written through the Store's real transitions (submit, place,
claim, finish; some fail or are cancelled), over 3 models and 2 devices with live heartbeats,
one Redis database per checkpoint. The gateway's exposition (`generate_latest` of the registry
its app serves) is then taken `--scrapes` times per checkpoint, round-robin over them.

    python bench/metrics_scrape.py [--points 100,1000,10000] [--scrapes 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

MODELS = ("model-a", "model-b", "model-c")
DEVICES = ("bench/CPU", "bench/Vulkan0")
TOKEN = "bench-leader"


def write_jobs(store, start: int, stop: int) -> None:
    """Jobs start..stop-1 end through the real transitions: most done, every 10th failed by
    its worker, every 25th cancelled while queued."""
    from sdfarm.store import JobSpec, transport
    from sdfarm.store.records import new_dispatch_id

    for i in range(start, stop):
        model, device = MODELS[i % len(MODELS)], DEVICES[i % len(DEVICES)]
        spec = JobSpec(model=model, params={"prompt": f"p{i}", "width": 64, "height": 64})
        job_id, _, _ = store.submit(spec, 10**9)
        if i % 25 == 0:
            assert store.cancel(job_id) == 1
            continue
        dispatch = new_dispatch_id()
        held = (transport.queue_name(device), "{}")
        assert store.place(TOKEN, job_id, 5, device, dispatch, 1, "loaded", (), held) == 1
        store.r.delete(held[0])  # no worker reads it: keep Redis to the job records
        assert store.claim(job_id, dispatch, "inc", "bench") is not None
        state = "failed" if i % 10 == 0 else "done"
        assert store.finish(job_id, dispatch, device, state, meta={"i": i},
                            load_s=0.8 if i < 6 else None, generate_s=0.02 * (i % 50))  # fmt: skip


def summary(times_ms: list[float]) -> dict[str, float]:
    times = sorted(times_ms)
    return {
        "median_ms": round(statistics.median(times), 3),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))], 3),
    }


def db_url(url: str, db: int) -> str:
    """The server's URL on database `db` (one database per checkpoint)."""
    assert url.endswith("/0"), url
    return f"{url[:-2]}/{db}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="100,1000,10000")
    p.add_argument("--scrapes", type=int, default=50)
    p.add_argument("--scan-scrapes", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from prometheus_client import generate_latest

    from sdfarm.client.farm import Farm
    from sdfarm.gateway.metrics import gateway_registry
    from sdfarm.localfarm.redis_server import RedisServer
    from sdfarm.store import keys

    points = [int(x) for x in args.points.split(",")]
    server = RedisServer.start()
    try:
        # One database per checkpoint, filled once; then the scrapes go round-robin over
        # them, so a busy moment of the machine weighs on every checkpoint alike.
        farms, writes = [], []
        for db, point in enumerate(points):
            farm = Farm(db_url(server.url, db))
            assert farm.store.take_lease(TOKEN, 3_600_000)
            for device in DEVICES:
                farm.store.beat(device, {"key": device, "capacity": 1, "state": "idle"}, 3600)
            t = time.perf_counter()
            write_jobs(farm.store, 0, point)
            writes.append(time.perf_counter() - t)
            farms.append(farm)
        registries = [gateway_registry(farm) for farm in farms]
        texts = [generate_latest(r) for r in registries]  # warm: scripts, connections
        scrapes: list[list[float]] = [[] for _ in points]
        scans: list[list[float]] = [[] for _ in points]
        for n in range(args.scrapes):
            for i, registry in enumerate(registries):
                t = time.perf_counter()
                generate_latest(registry)
                scrapes[i].append((time.perf_counter() - t) * 1000)
                if n < args.scan_scrapes:
                    t = time.perf_counter()
                    farms[i].store.count_by_state()
                    scans[i].append((time.perf_counter() - t) * 1000)
        rows = []
        for i, point in enumerate(points):
            store = farms[i].store
            row = {
                "finished_jobs": point,
                "scrape": summary(scrapes[i]),
                "old_scan": summary(scans[i]),
                "exposition_bytes": len(texts[i]),
                "metrics_hash_fields": int(store.r.hlen(keys.METRICS_JOBS_KEY))
                + int(store.r.hlen(keys.METRICS_SECONDS_KEY)),
                "redis_keys": int(store.r.dbsize()),
                "write_s": round(writes[i], 2),
            }
            rows.append(row)
            print(
                f"{point:>7} jobs  scrape median {row['scrape']['median_ms']:7.3f} ms "
                f"p90 {row['scrape']['p90_ms']:7.3f} ms  | old key scan median "
                f"{row['old_scan']['median_ms']:9.3f} ms  | {row['metrics_hash_fields']} hash "
                f"fields, {row['redis_keys']} keys",
                flush=True,
            )
        for farm in farms:
            farm.close()
    finally:
        server.stop()
    doc = {
        "bench": "metrics_scrape",
        "what": "gateway /metrics exposition (generate_latest of its registry) vs the old "
        "per-scrape key scan (Store.count_by_state), as finished jobs grow",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "scrapes_per_point": args.scrapes,
        "old_scans_per_point": args.scan_scrapes,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
