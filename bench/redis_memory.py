"""Redis memory over a long batch: every key of a finished job expires, so after the TTL the
farm's Redis stops growing. A local farm with the tiny model runs N small jobs (through
Farm.map, a bounded window) with SDFARM_RESULT_TTL shortened; Redis's used memory and key
count are printed every `--every` jobs, then once more after the TTL has passed.

    python bench/redis_memory.py [--jobs 2000] [--ttl 60] [--every 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tinymodel import tiny_model


def reading(store, done: int, t0: float) -> dict:
    info = store.r.info("memory")
    return {
        "jobs_done": done,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "used_memory": int(info["used_memory"]),
        "keys": int(store.r.dbsize()),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--ttl", type=int, default=60, help="SDFARM_RESULT_TTL for the run")
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ["SDFARM_RESULT_TTL"] = str(args.ttl)  # before sdfarm.store is imported
    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.farm import LocalFarm
    from sdfarm.store import keys

    assert args.ttl == keys.RESULT_TTL
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        with LocalFarm([model.parent], devices=["CPU"], announce=False) as local:
            farm = Farm(local.url)
            t0 = time.monotonic()
            rows.append(reading(farm.store, 0, t0))
            items = ({"prompt": f"memory {i}", "seed": i} for i in range(args.jobs))
            results = farm.map(items, model.name, window=16, width=64, height=64, steps=1)
            for n, _ in enumerate(results, 1):
                if n % args.every == 0:
                    rows.append(reading(farm.store, n, t0))
                    print(json.dumps(rows[-1]), flush=True)
            time.sleep(args.ttl + 5)
            rows.append(reading(farm.store, args.jobs, t0))
            print(json.dumps(rows[-1]), flush=True)
            farm.close()
    print(f"{args.jobs} jobs, result TTL {args.ttl} s")
    print(f"{'jobs':>6} {'elapsed s':>10} {'used memory MiB':>16} {'keys':>7}")
    for r in rows:
        print(
            f"{r['jobs_done']:>6} {r['elapsed_s']:>10.1f} {r['used_memory'] / 2**20:>16.2f} "
            f"{r['keys']:>7}"
        )
    steady = [r["used_memory"] for r in rows if r["elapsed_s"] > args.ttl * 1.5]
    if steady:
        print(
            f"after the first TTL: used memory {min(steady) / 2**20:.2f}..{max(steady) / 2**20:.2f}"
            f" MiB over {len(steady)} readings"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"jobs": args.jobs, "ttl": args.ttl,
                                              "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
