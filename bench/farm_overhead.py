"""What the farm adds to a job: the same tiny-model jobs in-process and through a local farm.

Sequential jobs give the per-job latency; the farm's added latency per job is its
submit-to-result time minus the runtime's own generation time for that job (reported in the
result's metadata), so it counts everything the farm does: queueing, placement, the Celery
hop, PNG encoding, the upload and the wake-up of the client. A batch submitted at once gives
the throughput, side by side with the in-process loop (generate + PNG encode per image).

    python bench/farm_overhead.py [--jobs 200] [--size 64] [--steps 1] [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tinymodel import tiny_model

from sdfarm.native.engine import Engine
from sdfarm.native.params import GenerationParams
from sdfarm.native.png import png_bytes


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def in_process(model: Path, jobs: int, size: int, steps: int) -> dict:
    engine = Engine.load(model)
    engine.generate(GenerationParams(prompt="warm", width=size, height=size, steps=steps, seed=0))
    lat, gen = [], []
    t0 = time.perf_counter()
    for i in range(jobs):
        t = time.perf_counter()
        r = engine.generate(
            GenerationParams(prompt=f"prompt {i}", width=size, height=size, steps=steps, seed=i)
        )
        png_bytes(r.image, r.metadata)
        lat.append(time.perf_counter() - t)
        gen.append(r.metadata["timings"]["generate_s"])
    total = time.perf_counter() - t0
    engine.dispose()
    return {"latency": lat, "generate": gen, "throughput": jobs / total}


def celery_floor(redis_url: str, n: int) -> list[float]:
    """Sequential round trips of a no-op Celery task (bench/celery_noop.py) through a
    prefork worker of one process on the farm's Redis: send, run, store and read the result."""
    env = {**os.environ, "SDFARM_REDIS_URL": redis_url}
    here = Path(__file__).resolve().parent
    cmd = [sys.executable, "-m", "celery", "-A", "celery_noop", "worker", "--pool", "prefork"]
    cmd += ["-c", "1", "-Q", "noop", "--without-gossip", "--without-mingle", "-l", "WARNING"]
    worker = subprocess.Popen(cmd, cwd=here, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    sys.path.insert(0, str(here))
    os.environ["SDFARM_REDIS_URL"] = redis_url
    try:
        from celery_noop import noop

        noop.apply_async((0,), queue="noop").get(timeout=120)  # the worker is up
        out = []
        for i in range(n):
            t = time.perf_counter()
            noop.apply_async((i,), queue="noop").get(timeout=30)
            out.append(time.perf_counter() - t)
        return out
    finally:
        worker.terminate()
        worker.wait(30)


def on_farm(models_dir: Path, model: str, jobs: int, size: int, steps: int) -> dict:
    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.farm import LocalFarm

    common = {"width": size, "height": size, "steps": steps}
    with LocalFarm([models_dir], announce=False) as local, Farm(local.url) as farm:
        farm.submit(model, "warm", seed=0, **common).result(timeout=300)
        lat, gen, hops = [], [], []
        for i in range(jobs):
            t, wall = time.perf_counter(), time.time()
            job = farm.submit(model, f"prompt {i}", seed=i, **common)
            r = job.result(timeout=300)
            lat.append(time.perf_counter() - t)
            gen.append(r.metadata["timings"]["generate_s"])
            hops.append(job_hops(wall, time.time(), job.events(), r.metadata["timings"]))
        floor = celery_floor(local.url, jobs)
        t0 = time.perf_counter()
        pending = [farm.submit(model, f"batch {i}", seed=i, **common) for i in range(jobs)]
        for job in pending:
            job.result(timeout=600)
        total = time.perf_counter() - t0
    return {
        "latency": lat,
        "generate": gen,
        "throughput": jobs / total,
        "hops": hops,
        "celery_floor": floor,
    }


HOPS = ("submit", "scheduler", "celery", "worker", "encode", "client")


def job_hops(start: float, end: float, events: list[dict], timings: dict) -> dict[str, float]:
    """Where one sequential job's time outside generation went, from its events (each
    stamped with time.time() by the process that wrote it): the client's own work before its
    submit script; the submit script, the scheduler's wake-up and placement; the placement
    script and Celery's delivery to the pool process; the worker's claim and work around the
    generation; the PNG encode; the final write and the client's wake-up and read."""
    t = {e["event"]: e["t"] for e in events if e.get("event") != "step"}
    encode = timings.get("encode_s", 0.0)
    return {
        "submit": t["queued"] - start,
        "scheduler": t["placed"] - t["queued"],
        "celery": t["running"] - t["placed"],
        "worker": t["done"] - t["running"] - timings["generate_s"] - encode,
        "encode": encode,
        "client": end - t["done"],
    }


def summary(run: dict) -> dict:
    added = [a - g for a, g in zip(run["latency"], run["generate"], strict=True)]
    return {
        "latency_p50_ms": pct(run["latency"], 50) * 1e3,
        "latency_p99_ms": pct(run["latency"], 99) * 1e3,
        "generate_p50_ms": pct(run["generate"], 50) * 1e3,
        "added_p50_ms": pct(added, 50) * 1e3,
        "added_p99_ms": pct(added, 99) * 1e3,
        "added_mean_ms": statistics.fmean(added) * 1e3,
        "throughput_per_s": run["throughput"],
        **{
            f"hop_{h}_p50_ms": pct([x[h] for x in run["hops"]], 50) * 1e3
            for h in HOPS
            if run.get("hops")
        },
        **(
            {
                "celery_noop_p50_ms": pct(run["celery_floor"], 50) * 1e3,
                "celery_noop_p99_ms": pct(run["celery_floor"], 99) * 1e3,
            }
            if run.get("celery_floor")
            else {}
        ),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--model", default=None, help="a model folder (default: a fresh tiny model)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model).resolve() if args.model else tiny_model(Path(tmp))
        local = summary(in_process(model, args.jobs, args.size, args.steps))
        print("in-process loop done; now the farm", file=sys.stderr, flush=True)
        farm = summary(on_farm(model.parent, model.name, args.jobs, args.size, args.steps))
    name = model.name if args.model else "tiny model"
    print(f"{args.jobs} jobs, {name}, {args.size}x{args.size}, {args.steps} step(s)")
    print(f"{'':28} {'in-process':>12} {'farm':>12}")
    for k in farm:
        if k in local:
            print(f"{k:28} {local[k]:>12.2f} {farm[k]:>12.2f}")
    ratio = farm["throughput_per_s"] / local["throughput_per_s"]
    print(
        f"farm added latency per job: p50 {farm['added_p50_ms']:.2f} ms, "
        f"p99 {farm['added_p99_ms']:.2f} ms (in-process: p50 {local['added_p50_ms']:.2f} ms, "
        f"p99 {local['added_p99_ms']:.2f} ms, the PNG encode)"
    )
    over = {p: farm[f"added_p{p}_ms"] - local[f"added_p{p}_ms"] for p in (50, 99)}
    print(
        f"farm over the in-process path (both generate and encode): p50 {over[50]:.2f} ms, "
        f"p99 {over[99]:.2f} ms; a bare Celery no-op round trip here: "
        f"p50 {farm['celery_noop_p50_ms']:.2f} ms, p99 {farm['celery_noop_p99_ms']:.2f} ms"
    )
    celery = {p: farm[f"celery_noop_p{p}_ms"] for p in (50, 99)}
    print(
        f"farm over the in-process path / a bare Celery round trip: p50 "
        f"{over[50] / celery[50]:.2f}, p99 {over[99] / celery[99]:.2f}"
    )
    print(f"throughput farm / in-process: {ratio:.3f}")
    print(
        "where a sequential farm job's added time goes (p50, ms): "
        + ", ".join(f"{h} {farm[f'hop_{h}_p50_ms']:.2f}" for h in HOPS)
    )
    if args.out:
        doc = {
            "bench": "farm_overhead",
            "jobs": args.jobs,
            "size": args.size,
            "steps": args.steps,
            "model": name,
            "machine": platform.platform(),
            "date": time.strftime("%Y-%m-%d"),
            "in_process": local,
            "farm": farm,
            "throughput_ratio": ratio,
            "farm_over_in_process_p50_ms": over[50],
            "farm_over_in_process_p99_ms": over[99],
            "farm_over_celery_p50": over[50] / celery[50],
            "farm_over_celery_p99": over[99] / celery[99],
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
