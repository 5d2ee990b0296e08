"""Peak memory of `sdfarm convert` against the sizes it reads and writes, per model and type.

    python bench/convert_memory.py --models DIR MODEL[,MODEL...] --types q8_0,q4_k

Each conversion runs in a fresh process (this script with --one), which converts through
sdfarm.native.convert (the runtime's convert in its child) into a scratch model folder that is
removed afterwards, and reports the child's peak RSS (getrusage of its children). Beside it:
the source's bytes, the largest converted file's output bytes as written, the estimate of it
from the headers (sdfarm.native.convertmem.output_bytes) and the rule's need. The rows go to
bench/results/convert_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "convert_memory.json"


def one(models: str, model: str, type_name: str) -> dict[str, object]:
    """Convert `model` to `type_name` once, in this process's child; the measurements."""
    from sdfarm.native.convert import convert_model, convert_need, plan

    p = plan(model, type_name, [models], f"bench-convert-{type_name}-{os.getpid()}")
    need = convert_need(p)
    t = time.monotonic()
    try:
        done = convert_model(p, available_memory=lambda: None, free_disk=lambda _f: None)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        written = {f["file"]: f["after"] for f in done["files"] if f["action"] == "convert"}
    finally:
        shutil.rmtree(p.out_dir, ignore_errors=True)
    largest = max(written.values())
    return {
        "model": model,
        "type": type_name,
        "source_bytes": p.model.total_bytes,
        "largest_output_bytes": largest,
        "need_memory": need.memory,
        "need_disk": need.disk,
        "written_bytes": done["bytes_after"],
        "peak_rss": peak,
        "peak_over_output_mib": round((peak - largest) / 2**20, 1),
        "peak_over_need": round(peak / need.memory, 3),
        "seconds": round(time.monotonic() - t, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True)
    ap.add_argument("names", help="model names, comma-separated")
    ap.add_argument("--types", default="q8_0,q4_k")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.models, args.names, args.types)))
        return 0
    rows = []
    for model in args.names.split(","):
        for t in args.types.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--one", "--models", args.models, model, "--types", t],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    known = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    keep = [
        r for r in known if (r["model"], r["type"]) not in {(x["model"], x["type"]) for x in rows}
    ]
    RESULTS.write_text(json.dumps(keep + rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
