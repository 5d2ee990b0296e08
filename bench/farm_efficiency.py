"""GPU efficiency of one worker over a long batch (issue #15: >= 0.99 per engine): a local
farm (private redis-server, the scheduler, one worker pinned to the model), N jobs of one
size and 1 step queued at once, after two warm-up jobs.

Busy time is what the worker records for each job: `timings.generate_s`, the engine's time
around the runtime's generate_image call (sdfarm.native.engine). The makespan is the
worker's: from the first batch job's run start (`timings.begun_at`, the worker's clock; the
record's `started` for an older worker) to the last one's end (`ended`, written after its
PNG). Efficiency = sum(generate_s) / makespan. Where the rest goes, per job from the same
records: `worker_pre_s` (run start -> native call: the claim unless the job was claimed
ahead, the spec, validation, inputs, the engine request) and the time from one job's
generate end to the next job's run start (the result handed to the uploader, the next
message, Celery's ack and delivery when the chain ends);
PNG encoding (`encode_s`) runs on the uploader thread beside the next generation.

    python bench/farm_efficiency.py --model DIR [--device CUDA0] [--jobs 500] [--size 512] \
        [--deadline 150] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import sdcli


def q(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p * (len(v) - 1))))]


def dist(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "sum_s": round(sum(values), 4),
        "median_ms": round(statistics.median(values) * 1e3, 3) if values else None,
        "p90_ms": round((q(values, 0.9) or 0) * 1e3, 3) if values else None,
        "max_ms": round(max(values) * 1e3, 3) if values else None,
    }


def union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one span: the time some engine was inside the runtime.
    With one engine it is the sum of its generations; with N slots the GPU is busy while any
    of them generates, so one slot's claim and hand-off hide behind another's generation."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyse(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rows = sorted(rows, key=lambda r: r["started"])
    for r in rows:
        r["gen_start"] = r["started"] + r["worker_pre_s"]
        r["gen_end"] = r["gen_start"] + r["generate_s"]
    gen = [r["generate_s"] for r in rows]
    span = rows[-1]["ended"] - rows[0]["started"]
    gen_span = rows[-1]["gen_end"] - rows[0]["gen_start"]
    between = [b["started"] - a["gen_end"] for a, b in zip(rows, rows[1:], strict=False)]
    pre = [r["worker_pre_s"] for r in rows]
    idle = [b["gen_start"] - a["gen_end"] for a, b in zip(rows, rows[1:], strict=False)]
    tail = rows[-1]["ended"] - rows[-1]["gen_end"]
    busy = union([(r["gen_start"], r["gen_end"]) for r in rows])
    return {
        "jobs": len(rows),
        "generate_sum_s": round(sum(gen), 4),
        "generate": dist(gen),
        "worker_makespan_s": round(span, 4),
        "efficiency": round(sum(gen) / span, 4),
        "gpu_busy_union_s": round(busy, 4),
        "gpu_efficiency": round(busy / span, 4),
        "images_per_s": round(len(rows) / span, 3),
        "generate_span_s": round(gen_span, 4),
        "efficiency_first_to_last_generate": round(sum(gen) / gen_span, 4),
        "gap": {
            "total_s": round(span - sum(gen), 4),
            "idle_between_generates": dist(idle),
            "worker_pre (run start -> native call: claim unless ahead, checks, engine)": dist(pre),
            "generate end -> next run start (hand-off to uploader, the next message)": dist(
                between
            ),
            "last job: generate end -> ended (its PNG and finish)": round(tail, 4),
            "first job: claim -> generate start": round(pre[0], 4),
        },
        "encode_on_uploader_thread": dist([r["encode_s"] for r in rows if r["encode_s"]]),
        "queued": dist([r["queued_s"] for r in rows if r["queued_s"] is not None]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="CUDA0")
    p.add_argument("--jobs", type=int, default=500)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--deadline", type=float, default=150.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--engines", type=int, default=1, help="the worker's engine slots")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.monotonic()
    from sdfarm.client.farm import Farm, FarmBusyError
    from sdfarm.localfarm.farm import LocalFarm

    model = Path(args.model).resolve()
    name = model.name
    common = {"width": args.size, "height": args.size, "steps": 1}
    doc: dict[str, Any] = {
        "bench": "farm_efficiency",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(model),
        "device": args.device,
        "jobs_asked": args.jobs,
        "engines": args.engines,
        "prefetch": int(os.environ.get("SDFARM_PREFETCH") or 1),
        "chain": os.environ.get("SDFARM_CHAIN") or "1",
        "size": f"{args.size}x{args.size}",
        "steps": 1,
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
    }
    out = Path(args.out)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="eff-logs-"))
    sdcli.say(f"starting a local farm on {args.device} (logs in {log_dir})")
    local = LocalFarm(
        [model.parent],
        devices=[args.device],
        announce=False,
        log_dir=log_dir,
        worker_args=["--pin", name],
        engines=args.engines,
        ready_timeout=120,
    )
    local.start()
    doc["farm_start_s"] = round(time.monotonic() - t0, 3)
    save()
    try:
        with Farm(local.url) as farm:
            warm = [farm.submit(name, "warm", seed=i, **common).result(timeout=120) for i in (1, 2)]
            doc["warmup_timings"] = [w.metadata.get("timings") for w in warm]
            sdcli.say(f"warm: {doc['warmup_timings']}")
            left = args.deadline - (time.monotonic() - t0)
            tmo = max(10.0, left - 5)
            stop_at = time.monotonic() + tmo
            c0 = time.perf_counter()
            pending: deque[Any] = deque()
            done: list[tuple[Any, Any]] = []
            submitted = 0
            for i in range(args.jobs):
                if time.monotonic() > stop_at:
                    break
                while True:
                    try:
                        pending.append(farm.submit(name, f"farm job {i}", seed=1000 + i, **common))
                        submitted += 1
                        break
                    except FarmBusyError:
                        if not pending:
                            raise
                        j = pending.popleft()
                        done.append((j, j.result(timeout=max(1.0, stop_at - time.monotonic()))))
            submit_s = time.perf_counter() - c0
            sdcli.say(f"{submitted} jobs queued in {submit_s:.2f} s")
            cut = False
            while pending:
                j = pending.popleft()
                try:
                    done.append((j, j.result(timeout=max(1.0, stop_at - time.monotonic()))))
                except Exception as e:  # noqa: BLE001 - the deadline: keep what finished
                    cut = True
                    doc["cut"] = f"{type(e).__name__}: {e}"
                    pending.appendleft(j)
                    break
                if len(done) % 100 == 0:
                    sdcli.say(f"  {len(done)} done")
            client_makespan = time.perf_counter() - c0
            for j in pending:
                j.cancel()
            rows = []
            for job, res in done:
                rec = job.record()
                t = res.metadata.get("timings", {})
                rows.append(
                    {
                        "job": job.id,
                        "created": float(rec["created"]),
                        # the run's start (a job claimed ahead writes `started` after it)
                        "started": float(t.get("begun_at") or rec["started"]),
                        "ended": float(rec["ended"]),
                        "generate_s": float(t["generate_s"]),
                        "worker_pre_s": float(t.get("worker_pre_s") or 0.0),
                        "encode_s": t.get("encode_s"),
                        "queued_s": t.get("queued_s"),
                        "chained": bool(res.metadata.get("chained")),
                        "ahead": bool(res.metadata.get("ahead")),
                        "claimed_ahead": bool(res.metadata.get("claimed_ahead")),
                    }
                )
            doc["client"] = {
                "submitted": submitted,
                "finished": len(done),
                "cut_by_deadline": cut,
                "submit_s": round(submit_s, 3),
                "makespan_s": round(client_makespan, 3),
                "images_per_s": round(len(done) / client_makespan, 3),
                "efficiency": round(sum(r["generate_s"] for r in rows) / client_makespan, 4),
            }
            doc["worker"] = analyse(rows) if rows else None
            # how the jobs reached the engine (sdfarm.worker.chain): chained, prepared ahead
            doc["jobs_chained"] = sum(r["chained"] for r in rows)
            doc["jobs_prepared_ahead"] = sum(r["ahead"] for r in rows)
            doc["jobs_claimed_ahead"] = sum(r["claimed_ahead"] for r in rows)
            sdcli.say(
                f"chained {doc['jobs_chained']}, claimed ahead {doc['jobs_claimed_ahead']}, "
                f"prepared ahead {doc['jobs_prepared_ahead']}"
            )
            doc["per_job"] = [
                {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}
                for r in rows
            ]
            save()
    finally:
        local.stop()
    w = doc.get("worker") or {}
    sdcli.say(
        f"{w.get('jobs')} jobs: worker makespan {w.get('worker_makespan_s')} s, generate sum "
        f"{w.get('generate_sum_s')} s, efficiency {w.get('efficiency')}, "
        f"{w.get('images_per_s')} img/s; client {doc.get('client')}"
    )
    print(json.dumps(w.get("gap"), indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
