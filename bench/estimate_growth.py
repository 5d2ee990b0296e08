"""Peak process memory against the engine's estimate, per image size.

Each size runs in a fresh process (load + one generation, weights kept, the engine's own
settings), whose peak RSS (VmHWM) is compared with Engine.estimate_for(width, height): the
seed's estimate at the model's native size, growing by GROWTH_BYTES_PER_PIXEL above it.

    python bench/estimate_growth.py MODEL_DIR [--sizes 256,384,512,768,1024] [--steps 1]
        [--out bench/results/estimate_growth-NAME.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from sdfarm.native.engine import Engine
from sdfarm.native.params import GenerationParams
model, w, h, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
e = Engine.load(model)
t = time.monotonic()
e.generate(GenerationParams(prompt="a bench image", width=w, height=h, steps=steps, seed=1))
gen = time.monotonic() - t
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"estimate": e.estimate_for(w, h), "peak_rss": hwm, "generate_s": gen,
                  "native_size": e.capabilities.native_size}))
"""


def measure(model: str, width: int, height: int, steps: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(width), str(height), str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--sizes", default="256,384,512,768,1024")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    print(f"{'size':>10} {'estimate GiB':>13} {'peak RSS GiB':>13} {'peak/est':>9} {'gen s':>7}")
    for s in (int(x) for x in args.sizes.split(",")):
        r = measure(args.model, s, s, args.steps)
        r["size"] = s
        r["ratio"] = r["peak_rss"] / r["estimate"]
        rows.append(r)
        print(
            f"{s:>5}x{s:<4} {r['estimate'] / 2**30:>13.3f} {r['peak_rss'] / 2**30:>13.3f} "
            f"{r['ratio']:>9.2f} {r['generate_s']:>7.2f}",
            flush=True,
        )
    doc = {
        "bench": "estimate_growth",
        "model": Path(args.model).name,
        "steps": args.steps,
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
        "max_ratio": max(r["ratio"] for r in rows),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"max peak/estimate: {doc['max_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
