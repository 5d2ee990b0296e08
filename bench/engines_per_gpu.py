"""Several engines on one GPU: N processes, each with its own loaded engine of one model, make
images at once; images/s of them all, each engine's seconds per image, the device's peak
memory (NVML) and what the scheduler accounts for them (N x the job's estimate).

    python bench/engines_per_gpu.py --model DIR --engines 1,2,4,8 --size 512 --steps 1 \\
        [--images 20] [--batch-count 1] [--out FILE]

Each child loads its engine and makes one image untimed, then all start together (the parent
releases them at once); images/s = images made / (last end - first start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MARK = "@@engines "
"""What starts a child's report lines: the runtime writes to stdout too (its progress)."""


def say(doc: dict[str, Any]) -> None:
    print(MARK + json.dumps(doc), flush=True)


def hear(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's next report ({} when it ended without one)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    return {}


def child(model: str, size: int, steps: int, images: int, batch_count: int) -> int:
    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.params import GenerationParams

    engine = Engine.load(model, log=LogConfig(level="none"))
    params = dict(prompt="a lighthouse on a cliff at dusk", width=size, height=size, steps=steps,
                  cfg_scale=1.0, batch_count=batch_count)  # fmt: skip
    engine.generate(GenerationParams(**params, seed=1))
    say({"ready": True, "estimate": engine.estimate_for(size, size)})
    sys.stdin.readline()  # go
    times, start = [], time.time()
    for i in range(images):
        t = time.perf_counter()
        engine.generate(GenerationParams(**params, seed=100 + i))
        times.append(time.perf_counter() - t)
    end = time.time()
    say({"start": start, "end": end, "times": times})
    engine.dispose()
    return 0


class Nvml:
    """The device's used memory over its idle baseline, polled every 20 ms (None without
    NVML)."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.nv = pynvml
            self.base = pynvml.nvmlDeviceGetMemoryInfo(self.h).used
        except Exception:  # noqa: BLE001 - no GPU: no figure
            self.nv = None

    def __enter__(self) -> Nvml:
        if self.nv is not None:
            threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            used = self.nv.nvmlDeviceGetMemoryInfo(self.h).used - self.base
            self.peak = used if self.peak is None else max(self.peak, used)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def run(n: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--size", str(args.size),
           "--steps", str(args.steps), "--images", str(args.images),
           "--batch-count", str(args.batch_count)]  # fmt: skip
    with Nvml() as nv:
        procs = [
            subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ)
            )  # fmt: skip
            for _ in range(n)
        ]
        ready = [hear(p) for p in procs]
        if not all(r.get("ready") for r in ready):
            for p in procs:
                p.kill()
            return {"engines": n, "error": "a child did not load its engine"}
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        done = [hear(p) for p in procs]
        for p in procs:
            p.wait(60)
    if not all("times" in d for d in done):
        return {"engines": n, "error": "a child died while generating"}
    made = n * args.images * args.batch_count
    wall = max(d["end"] for d in done) - min(d["start"] for d in done)
    per = [t / args.batch_count for d in done for t in d["times"]]
    return {
        "engines": n,
        "images": made,
        "wall_s": round(wall, 3),
        "images_per_s": round(made / wall, 2),
        "s_per_image_per_engine": round(statistics.median(per), 4),
        "gpu_peak_delta": nv.peak,
        "estimate_each": ready[0]["estimate"],
        "scheduler_accounts": n * ready[0]["estimate"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engines", default="1,2,4,8")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--images", type=int, default=20, help="images each engine makes, timed")
    p.add_argument("--batch-count", type=int, default=1)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.child:
        return child(args.model, args.size, args.steps, args.images, args.batch_count)
    rows = []
    for n in (int(x) for x in args.engines.split(",")):
        row = run(n, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            doc = {"bench": "engines_per_gpu", "model": Path(args.model).name,
                   "size": args.size, "steps": args.steps, "rows": rows}  # fmt: skip
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'engines':>7} {'img/s':>7} {'s/img/engine':>12} {'GPU peak GiB':>12} {'accounted':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['engines']:>7} ERROR {r['error']}")
            continue
        peak = r["gpu_peak_delta"] / 2**30 if r["gpu_peak_delta"] else float("nan")
        print(f"{r['engines']:>7} {r['images_per_s']:>7.2f} {r['s_per_image_per_engine']:>12.4f} "
              f"{peak:>12.2f} {r['scheduler_accounts'] / 2**30:>9.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
