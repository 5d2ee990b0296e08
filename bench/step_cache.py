"""The step caches of master-596 (sd_cache_params_t, the job's `step_cache`): the time of one
image with each mode against none, and what it changes in the image (PSNR and the largest pixel
difference against the uncached image of the same seed). One engine, the same job per mode.

    python bench/step_cache.py [--model DIR] [--size 256] [--steps 20] [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tinymodel import tiny_model


def psnr(a: bytes, b: bytes) -> float:
    """Peak signal-to-noise ratio of two 8-bit images of one size (inf when equal)."""
    n = len(a)
    mse = sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / n
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from sdfarm.native.engine import Engine
    from sdfarm.native.params import STEP_CACHES, GenerationParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model(tmp))
        rows = {}
        with Engine.load(model) as engine:
            base = {"prompt": "a step cache benchmark", "width": args.size,
                    "height": args.size, "steps": args.steps, "seed": 5}  # fmt: skip
            engine.generate(GenerationParams(**base))  # warm
            # Round-robin over the modes, so a machine that slows down or speeds up during
            # the run weighs on every mode alike.
            times: dict[str, list[float]] = {mode: [] for mode in STEP_CACHES}
            images: dict[str, bytes] = {}
            for _ in range(args.repeat):
                for mode in STEP_CACHES:
                    t = time.perf_counter()
                    r = engine.generate(GenerationParams(**base, step_cache=mode))
                    times[mode].append(time.perf_counter() - t)
                    images[mode] = r.image.tobytes()
            for mode in STEP_CACHES:
                rows[mode] = {"seconds": statistics.median(times[mode]), "image": images[mode]}
    off = rows["off"]
    print(f"{Path(model).name}, {args.size}x{args.size}, {args.steps} steps, median of "
          f"{args.repeat}")  # fmt: skip
    print(f"{'mode':<11} {'s/image':>8} {'speed-up':>9} {'PSNR dB':>8} {'max diff':>9}")
    table = {}
    for mode, r in rows.items():
        diff = max(abs(x - y) for x, y in zip(r["image"], off["image"], strict=True))
        quality = psnr(r["image"], off["image"])
        speedup = off["seconds"] / r["seconds"]
        print(f"{mode:<11} {r['seconds']:>8.3f} {speedup:>8.2f}x {quality:>8.1f} {diff:>9}")
        table[mode] = {"seconds": r["seconds"], "speedup": speedup, "psnr_db": quality,
                       "max_pixel_diff": diff}  # fmt: skip
    if args.out:
        doc = {"bench": "step_cache", "model": Path(model).name, "size": args.size,
               "steps": args.steps, "repeat": args.repeat, "modes": table}  # fmt: skip
        Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
