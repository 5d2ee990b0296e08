"""What previews cost: the time of one job without previews and with them (TAE and the latent
projection, every step and every other step), wall clock and the process's CPU time, runs of
each setting interleaved so a machine shared with other work slows them alike. One engine,
the same job (same seed) each time; the images must be identical with and without previews.

    python bench/preview_cost.py [--model DIR] [--size 256] [--steps 4] [--repeat 5]
                                 [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tinymodel import tiny_model

SETTINGS = [("off", "tae", 0), ("tae", "tae", 1), ("tae/2", "tae", 2), ("proj", "proj", 1)]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from sdfarm.native.engine import Engine
    from sdfarm.native.params import GenerationParams

    rows: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n, _, _ in SETTINGS}
    frames: dict[str, int] = {}
    images: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model(tmp))
        with Engine.load(model, threads=args.threads) as engine:
            base = {"prompt": "a preview benchmark", "width": args.size, "height": args.size,
                    "steps": args.steps, "seed": 5}  # fmt: skip
            engine.generate(GenerationParams(**base))  # warm
            for _ in range(args.repeat):
                for name, mode, every in SETTINGS:
                    engine.preview_mode = mode
                    got: list[object] = []
                    w, c = time.perf_counter(), cpu_s()
                    r = engine.generate(
                        GenerationParams(**base, preview_every=every), preview=got.append
                    )
                    rows[name]["wall"].append(time.perf_counter() - w)
                    rows[name]["cpu"].append(cpu_s() - c)
                    frames[name] = len(got)
                    images[name] = r.image.tobytes()
    off = {k: statistics.median(v) for k, v in rows["off"].items()}
    print(f"{Path(model).name}, {args.size}x{args.size}, {args.steps} steps, {args.threads} "
          f"threads, median of {args.repeat} (interleaved)")  # fmt: skip
    print(f"{'previews':<8} {'wall s':>7} {'+wall':>7} {'cpu s':>7} {'+cpu':>7} {'frames':>6} same")
    table = {}
    for name, _, _ in SETTINGS:
        wall = statistics.median(rows[name]["wall"])
        cpu = statistics.median(rows[name]["cpu"])
        same = images[name] == images["off"]
        print(f"{name:<8} {wall:>7.3f} {wall / off['wall'] - 1:>+7.0%} {cpu:>7.3f} "
              f"{cpu / off['cpu'] - 1:>+7.0%} {frames[name]:>6} {same}")  # fmt: skip
        table[name] = {"wall_s": wall, "cpu_s": cpu, "frames_seen": frames[name],
                       "same_image": same, "runs": rows[name]}  # fmt: skip
    if args.out:
        doc = {"bench": "preview_cost", "model": Path(model).name, "size": args.size,
               "steps": args.steps, "threads": args.threads, "repeat": args.repeat,
               "settings": table}  # fmt: skip
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
