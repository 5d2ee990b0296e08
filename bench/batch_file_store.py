"""A long batch through the real farm with the file result store (issue #14): a local farm
(private redis-server, the scheduler, one worker with `--results file://...`, i.e.
SDFARM_RESULTS), the tiny model, and the real batch client (`sdfarm batch FILE.jsonl --redis
URL`, a separate process) rendering N jobs. Every 0.5 s it samples Redis `used_memory` (and
key count) and the RSS of the client, the scheduler and the worker (its main process and the
Celery pool process that holds the engine). Reported: before / peak / after for Redis (also
Redis's own `used_memory_peak`), start / end / peak for each process, the images written
and the file store's size.

With --deadline the client is interrupted (SIGINT: it cancels what it has in flight) when
the time is up; the count reached is then recorded as such.

    python bench/batch_file_store.py [--device CUDA0] [--jobs 5000] [--size 512] \
        [--deadline 120] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import sdcli
from tinymodel import tiny_model

MIB = 1024 * 1024


def rss(pid: int | None, tree: bool = False) -> int | None:
    import psutil

    if pid is None:
        return None
    try:
        p = psutil.Process(pid)
        total = p.memory_info().rss
        if tree:
            total += sum(c.memory_info().rss for c in p.children(recursive=True))
        return total
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def pool_pid(worker_pid: int) -> int | None:
    import psutil

    try:
        kids = psutil.Process(worker_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    return kids[0].pid if kids else None
    # With --engines N there are N pool processes: the figures are the first one's.


def count_pngs(folder: Path) -> int:
    try:
        return sum(1 for e in os.scandir(folder) if e.name.endswith(".png"))
    except FileNotFoundError:
        return 0


def du(folder: Path) -> tuple[int, int]:
    n = size = 0
    for root, _, files in os.walk(folder):
        for f in files:
            n += 1
            size += os.path.getsize(os.path.join(root, f))
    return n, size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="CUDA0")
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--in-flight", type=int, default=None, help="the client's --in-flight")
    p.add_argument("--deadline", type=float, default=300.0)
    p.add_argument("--engines", type=int, default=1, help="the worker's engine slots")
    p.add_argument("--every", type=float, default=0.5)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.monotonic()
    import redis

    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.farm import LocalFarm

    tmp = Path(tempfile.mkdtemp(prefix="batch-file-"))
    model = Path(args.model).resolve() if args.model else tiny_model(tmp / "models")
    store_dir = tmp / "results"
    store_dir.mkdir()
    out_dir = tmp / "out"
    inp = tmp / "batch.jsonl"
    with open(inp, "w") as f:
        for i in range(args.jobs):
            f.write(json.dumps({"prompt": f"a lighthouse number {i} at dusk", "seed": i}) + "\n")
    doc: dict[str, Any] = {
        "bench": "batch_file_store",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(model),
        "device": args.device,
        "jobs_asked": args.jobs,
        "size": f"{args.size}x{args.size}",
        "steps": 1,
        "results": f"file://{store_dir}",
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
    }
    out = Path(args.out)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    log_dir = Path(args.log_dir or tmp / "logs")
    sdcli.say(f"local farm on {args.device}, results file://{store_dir}, model {model.name}")
    local = LocalFarm(
        [model.parent],
        devices=[args.device],
        announce=False,
        log_dir=log_dir,
        results=f"file://{store_dir}",
        engines=args.engines,
        ready_timeout=120,
    )
    local.start()
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    client: subprocess.Popen[bytes] | None = None
    try:
        r = redis.Redis.from_url(local.url)
        sched = local.procs["scheduler"].pid
        worker = local.procs[f"worker:{args.device}"].pid

        def reading() -> dict[str, Any]:
            info = r.info("memory")
            pool = pool_pid(worker)
            return {
                "t": round(time.monotonic() - t0, 2),
                "used_memory": int(info["used_memory"]),
                "keys": int(r.dbsize()),
                "client_rss": rss(client.pid) if client else None,
                "scheduler_rss": rss(sched),
                "worker_main_rss": rss(worker),
                "worker_pool_rss": rss(pool),
                "redis_rss": rss(local.redis.pid if local.redis else None),
                "pngs": count_pngs(out_dir),
            }

        doc["farm_ready"] = reading()
        sdcli.say(f"farm ready in {doc['farm_ready']['t']} s: {doc['farm_ready']}")
        with Farm(local.url) as farm:  # one job so the worker's engine is loaded
            w = farm.submit(model.name, "warm", seed=1, width=args.size, height=args.size,
                            steps=1).result(timeout=120)  # fmt: skip
        doc["warmup_timings"] = w.metadata.get("timings")
        time.sleep(1.0)
        doc["before"] = reading()
        sdcli.say(f"before: {doc['before']}")
        save()

        def sample() -> None:
            while not stop.is_set():
                try:
                    samples.append(reading())
                except Exception as e:  # noqa: BLE001 - a sample lost is not the run lost
                    samples.append({"t": round(time.monotonic() - t0, 2), "error": str(e)})
                stop.wait(args.every)

        cmd = [
            sys.executable, "-m", "sdfarm.cli.main", "batch", str(inp), "--model", model.name,
            "--out", str(out_dir), "--width", str(args.size), "--height", str(args.size),
            "--steps", "1", "--redis", local.url, "--json", "--quiet",
        ]  # fmt: skip
        if args.in_flight:
            cmd += ["--in-flight", str(args.in_flight)]
        doc["client_command"] = cmd
        left = args.deadline - (time.monotonic() - t0)
        sdcli.say(f"client: {' '.join(cmd[1:4])} ... ({left:.0f} s left)")
        c0 = time.monotonic()
        client = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        interrupted = False
        next_note = c0 + 10
        while client.poll() is None:
            now = time.monotonic()
            if now - t0 > args.deadline - 25:
                sdcli.say("deadline: SIGINT to the client (it cancels what is in flight)")
                interrupted = True
                client.send_signal(signal.SIGINT)
                try:
                    client.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    client.kill()
                break
            if now >= next_note and samples:
                s = samples[-1]
                sdcli.say(
                    f"  {s.get('pngs')} images, {s.get('pngs', 0) / (now - c0):.1f}/s, redis "
                    f"{(s.get('used_memory') or 0) / MIB:.1f} MiB, client "
                    f"{(s.get('client_rss') or 0) / MIB:.1f} MiB"
                )
                next_note = now + 10
            time.sleep(0.2)
        wall = time.monotonic() - c0
        stdout, stderr = client.communicate(timeout=30)
        time.sleep(2.0)  # the worker finishes or drops what was cancelled
        stop.set()
        th.join(timeout=5)
        after = reading()
        after["client_rss"] = None
        doc["after"] = after
        info = r.info("memory")
        try:
            summary = json.loads(stdout.decode() or "{}")
        except ValueError:
            summary = {"raw": stdout.decode()[-2000:]}
        written = count_pngs(out_dir)
        n_files, n_bytes = du(store_dir)
        ok = [s for s in samples if "error" not in s]

        launched = c0 - t0

        def stat(key: str) -> dict[str, Any]:
            # The client's start: its first reading 2 s after launch (its imports done).
            first = launched + 2.0 if key == "client_rss" else 0.0
            vals = [s[key] for s in ok if s.get(key) is not None and s["t"] >= first]
            return {
                "start": vals[0] if vals else None,
                "end": vals[-1] if vals else None,
                "peak": max(vals) if vals else None,
                "start_mib": round(vals[0] / MIB, 1) if vals else None,
                "end_mib": round(vals[-1] / MIB, 1) if vals else None,
                "peak_mib": round(max(vals) / MIB, 1) if vals else None,
            }

        doc["result"] = {
            "images_written": written,
            "completed_all": written >= args.jobs and not interrupted,
            "interrupted_at_deadline": interrupted,
            "client_wall_s": round(wall, 2),
            "images_per_s": round(written / wall, 2) if wall else None,
            "client_exit": client.returncode,
            "client_summary": summary,
            "client_stderr_tail": stderr.decode(errors="replace")[-1500:],
            "file_store": {"files": n_files, "bytes": n_bytes},
            "redis_used_memory": {
                "before": doc["before"]["used_memory"],
                "peak_sampled": max((s["used_memory"] for s in ok), default=None),
                "after": after["used_memory"],
                "before_mib": round(doc["before"]["used_memory"] / MIB, 2),
                "peak_sampled_mib": round(max((s["used_memory"] for s in ok), default=0) / MIB, 2),
                "after_mib": round(after["used_memory"] / MIB, 2),
                "redis_used_memory_peak_mib": round(int(info["used_memory_peak"]) / MIB, 2),
                "keys_before": doc["before"]["keys"],
                "keys_after": after["keys"],
            },
            "rss": {
                "client": stat("client_rss"),
                "scheduler": stat("scheduler_rss"),
                "worker_main": stat("worker_main_rss"),
                "worker_pool (engine)": stat("worker_pool_rss"),
                "redis_server": stat("redis_rss"),
            },
            "samples": len(ok),
        }
        doc["samples"] = ok[:: max(1, len(ok) // 400)]
        save()
    finally:
        stop.set()
        if client is not None and client.poll() is None:
            client.kill()
        local.stop()
    res = doc.get("result", {})
    sdcli.say(
        f"{res.get('images_written')} images in {res.get('client_wall_s')} s "
        f"({res.get('images_per_s')}/s), interrupted: {res.get('interrupted_at_deadline')}"
    )
    print(json.dumps({"redis": res.get("redis_used_memory"), "rss": res.get("rss")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
