"""How the runtime applies LoRAs, and what a change of LoRA set costs on a loaded engine.

For each apply mode of master-596 (`immediately`: merged into the weights when the set
changes; `at_runtime`: computed beside the weights in every step), one engine runs the same
job without a LoRA, with the test LoRA, with it again, with another set (the LoRA at another
weight), with the first set again and without a LoRA again; each mode in its own process
(SDFARM_LORA_APPLY). It prints the time of each generation and whether the same job gave the
same bytes every time (the engine's weights unchanged by what ran before).

    python bench/lora_cost.py [--model DIR] [--size 64] [--steps 2] [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tinymodel import tiny_model

SEQUENCE = ("plain", "lora", "lora again", "other set", "lora after other", "plain again")


def child(model: str, size: int, steps: int, repeat: int) -> dict:
    """Run SEQUENCE `repeat` times in one engine (this process); times and digests."""
    import hashlib

    from sdfarm.native.engine import Engine
    from sdfarm.native.loras import LoraCatalog, lora_dirs
    from sdfarm.native.params import GenerationParams
    from sdfarm.native.testmodel import TEST_LORA

    folder = Path(model)
    catalog = LoraCatalog(lora_dirs([folder.parent]))
    files = {TEST_LORA: catalog.load(TEST_LORA)}
    sets = {
        "plain": (),
        "lora": ((TEST_LORA, 1.0),),
        "lora again": ((TEST_LORA, 1.0),),
        "other set": ((TEST_LORA, 0.5),),
        "lora after other": ((TEST_LORA, 1.0),),
        "plain again": (),
    }
    times: dict[str, list[float]] = {k: [] for k in SEQUENCE}
    digests: dict[str, set[str]] = {k: set() for k in SEQUENCE}
    with Engine.load(folder) as engine:
        base = {"prompt": "a lora benchmark", "width": size, "height": size, "steps": steps}
        engine.generate(GenerationParams(**base, seed=1))  # warm
        for _ in range(repeat):
            for step in SEQUENCE:
                t = time.perf_counter()
                r = engine.generate(GenerationParams(**base, seed=7, loras=sets[step]), loras=files)
                times[step].append(time.perf_counter() - t)
                digests[step].add(hashlib.sha256(r.image.tobytes()).hexdigest()[:16])
    return {
        "times": {k: statistics.median(v) for k, v in times.items()},
        "digests": {k: sorted(v) for k, v in digests.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder whose parent has loras/")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.size, args.steps, args.repeat)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model(tmp))
        runs = {}
        for mode in ("immediately", "at_runtime"):
            cmd = [sys.executable, __file__, "--child", model, "--size", str(args.size),
                   "--steps", str(args.steps), "--repeat", str(args.repeat)]  # fmt: skip
            env = {**os.environ, "SDFARM_LORA_APPLY": mode}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{Path(model).name}, {args.size}x{args.size}, {args.steps} steps, median of "
          f"{args.repeat}")  # fmt: skip
    print(f"{'generation':<18}" + "".join(f"{m:>14}" for m in runs))
    for step in SEQUENCE:
        print(f"{step:<18}" + "".join(f"{r['times'][step]:>13.3f}s" for r in runs.values()))
    for mode, r in runs.items():
        d = r["digests"]
        same_plain = d["plain"] == d["plain again"] and len(d["plain"]) == 1
        same_lora = d["lora"] == d["lora again"] == d["lora after other"] and len(d["lora"]) == 1
        print(
            f"{mode}: the plain job gives the same bytes after LoRA jobs: {same_plain}; "
            f"the LoRA job gives the same bytes after another set: {same_lora}"
        )
        r["reproducible"] = same_plain and same_lora
    if args.out:
        doc = {"bench": "lora_cost", "model": Path(model).name, "size": args.size,
               "steps": args.steps, "repeat": args.repeat, "runs": runs}  # fmt: skip
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
