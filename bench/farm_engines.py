"""Several engines per device through the real farm: a local farm (redis-server, the scheduler,
one worker with `--engines N` on DEV) runs K jobs submitted at once, for each N; images/s,
how many jobs ran at once, the device's peak memory (nvidia-smi where it is present, else
the worker's processes' RSS) and what the scheduler accounted for the engines (their
estimates in the heartbeat against the device's capacity).

    python bench/farm_engines.py --device DEV --engines 1,2,4 --jobs K --size 512 --steps 1 \\
        [--batch B] [--model DIR] [--threads T] [--out FILE]

Before the timed batch each N gets 2N warm-up jobs at once, so every slot has loaded its
engine (and warmed it up) before the clock starts. images/s = K / (the last job's end - the
first job's claim), by the job records; "at once" is the most jobs whose claim-to-generated
windows overlap. `--batch B`: every job asks B images (`batch_count`; a UNet model samples them
together), and images/s counts K x B images. Without --model, the tiny test model.
Needs only the package's dependencies on PYTHONPATH and a redis-server on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpupeak import gpu_index, gpu_used_mib
from tinymodel import tiny_model  # noqa: E402


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


class Sampler:
    """Peak device memory (or worker RSS) and the scheduler's view of the engines, sampled
    every `period` s from a thread while the batch runs."""

    def __init__(self, store: Any, key: str, worker_pid: int, gpu: str | None) -> None:
        self.store, self.key, self.pid, self.gpu = store, key, worker_pid, gpu
        self.peak_mib = 0.0
        self.engines = 0
        self.accounted = 0
        self.capacity = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        if self.gpu is not None:
            used = gpu_used_mib(self.gpu)
            if used is not None:
                self.peak_mib = max(self.peak_mib, float(used))
        else:
            self.peak_mib = max(self.peak_mib, tree_rss(self.pid) / 2**20)
        hb = self.store.heartbeat(self.key) or {}
        loaded = hb.get("loaded") or []
        self.engines = max(self.engines, len(loaded))
        self.accounted = max(self.accounted, sum(int(e.get("estimate") or 0) for e in loaded))
        self.capacity = int(hb.get("capacity") or self.capacity)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            with contextlib.suppress(Exception):  # a missed sample is not a result
                self.sample()

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()


def busy(timings: dict[str, Any]) -> float:
    """A job's time in its slot from the claim: the worker's work before the generation (the
    load included) and the generation; the PNG encode and the upload run on the uploader
    thread, beside the slot's next job."""
    return sum(float(timings.get(k) or 0.0) for k in ("worker_pre_s", "generate_s"))


def most_at_once(windows: list[tuple[float, float]]) -> int:
    """The most running windows that overlap at one instant."""
    edges = sorted([(s, 1) for s, _ in windows] + [(e, -1) for _, e in windows])
    now = best = 0
    for _, d in edges:
        now += d
        best = max(best, now)
    return best


def one_n(
    args: argparse.Namespace, models_dir: Path, model: str, n: int, gpu: str | None
) -> dict[str, Any]:
    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.farm import LocalFarm
    from sdfarm.store import keys

    common = {"width": args.size, "height": args.size, "steps": args.steps, "cfg_scale": 1.0,
              "decoder": args.decoder, "batch_count": args.batch}  # fmt: skip
    baseline = gpu_used_mib(gpu) if gpu is not None else None
    local = LocalFarm(
        [models_dir], devices=[args.device], threads=args.threads, announce=False,
        host="enginesbench", worker_args=["--engines", str(n)], ready_timeout=300,
    )  # fmt: skip
    with local, Farm(local.url, submitter="farm-engines") as farm:
        key = keys.device_key("enginesbench", args.device)
        t = time.perf_counter()
        warm = [farm.submit(model, f"warm {i}", seed=i, **common) for i in range(2 * n)]
        for job in warm:
            job.result(timeout=args.timeout)
        warm_s = time.perf_counter() - t
        pid = local.procs[f"worker:{args.device}"].pid
        with Sampler(farm.store, key, pid, gpu) as sampler:
            t = time.perf_counter()
            jobs = [farm.submit(model, f"prompt {i}", seed=100 + i, **common)
                    for i in range(args.jobs)]  # fmt: skip
            results = [job.result(timeout=args.timeout) for job in jobs]
            wall = time.perf_counter() - t
        records = [job.record() for job in jobs]
    # A slot is busy from its claim to the end of its generation (the encode and upload run
    # on beside the next job, so the record's `ended` would overlap even with one slot).
    windows = [
        (float(r["started"]), float(r["started"]) + busy(res.metadata.get("timings") or {}))
        for r, res in zip(records, results, strict=True)
    ]
    span = max(float(r["ended"]) for r in records) - min(s for s, _ in windows)
    estimate = max(int(r.get("estimate") or 0) for r in records)
    return {
        "engines": n,
        "jobs": args.jobs,
        "batch": args.batch,
        "images": sum(len(res.pngs) for res in results),
        "images_per_s": args.jobs * args.batch / span,
        "images_per_s_wall": args.jobs * args.batch / wall,
        "span_s": span,
        "wall_s": wall,
        "warmup_s": warm_s,
        "most_at_once": most_at_once(windows),
        "peak_mib": round(sampler.peak_mib, 1),
        "peak_source": "nvidia-smi memory.used" if gpu is not None else "worker processes' RSS",
        "baseline_mib": baseline,
        "job_estimate_bytes": estimate,
        "engines_in_heartbeat": sampler.engines,
        "accounted_bytes": sampler.accounted,
        "capacity_bytes": sampler.capacity,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="CPU", help="the device as `sdfarm devices` names it")
    p.add_argument("--engines", default="1,2,4", help="comma-separated N values")
    p.add_argument("--jobs", type=int, default=40, help="jobs in the timed batch, per N")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch", type=int, default=1, help="images per job (batch_count)")
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per engine")
    p.add_argument("--decoder", default="default", help="the jobs' decoder: default, vae, taesd")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--deadline", type=float, default=None,
        help="seconds: no new N starts within 45 s of it (what finished is written after each N)",
    )  # fmt: skip
    args = p.parse_args()
    t0 = time.monotonic()
    counts = [int(x) for x in args.engines.split(",") if x.strip()]
    gpu = gpu_index(args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model).resolve() if args.model else tiny_model(Path(tmp))
        name = model.name if args.model else "tiny model"
        for n in counts:
            if args.deadline is not None and time.monotonic() - t0 > args.deadline - 45:
                print(f"--engines {n}: skipped (deadline)", file=sys.stderr, flush=True)
                continue
            print(f"--engines {n}: {args.jobs} jobs on {args.device}", file=sys.stderr, flush=True)
            rows.append(one_n(args, model.parent, model.name, n, gpu))
            if args.out:
                write(args, name, rows)
    gib = 2**30
    print(f"{name} on {args.device}, {args.size}x{args.size}, {args.steps} step(s), "
          f"{args.jobs} jobs of {args.batch} image(s) per N")  # fmt: skip
    print(f"{'N':>3} {'img/s':>8} {'vs N=1':>7} {'at once':>8} {'peak MiB':>10} "
          f"{'engines':>8} {'accounted GiB':>14} {'capacity GiB':>13}")  # fmt: skip
    base = rows[0]["images_per_s"] if rows else 1.0
    for r in rows:
        print(
            f"{r['engines']:>3} {r['images_per_s']:>8.2f} {r['images_per_s'] / base:>7.2f} "
            f"{r['most_at_once']:>8} {r['peak_mib']:>10.0f} {r['engines_in_heartbeat']:>8} "
            f"{r['accounted_bytes'] / gib:>14.2f} {r['capacity_bytes'] / gib:>13.2f}"
        )
    return 0


def write(args: argparse.Namespace, name: str, rows: list[dict[str, Any]]) -> None:
    doc = {
        "bench": "farm_engines",
        "device": args.device,
        "model": name,
        "size": args.size,
        "steps": args.steps,
        "batch": args.batch,
        "host": platform.node(),
        "cores": os.cpu_count(),
        "cuda_mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
