"""Peak memory of a video job on the CPU against its estimate (`ModelFacts.video_estimate`).

Each case runs in a fresh process: load the random-weight Wan2.1 T2V 1.3B test model
(sdfarm.native.wantestmodel, cached), make one video (1 step, cfg 1), encode its frames as
PNGs and the animated WebP as the worker does, and report the process's peak RSS (ru_maxrss)
beside the job's estimate, the load and generate times.

    python bench/video_memory.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# (width, height, frames)
CASES = (
    (32, 32, 5),
    (64, 64, 1),
    (64, 64, 5),
    (64, 64, 9),
    (64, 64, 17),
    (128, 128, 5),
    (128, 128, 9),
)


def child(w: int, h: int, frames: int) -> dict:
    """One case in this process: the peak RSS, the estimate and the times."""
    import resource

    from sdfarm.native.engine import Engine
    from sdfarm.native.png import png_bytes
    from sdfarm.native.wantestmodel import cached_wan_test_model

    model = cached_wan_test_model()
    t = time.monotonic()
    with Engine.load(model, device="cpu", threads=2) as engine:
        load_s = time.monotonic() - t
        t = time.monotonic()
        result = engine.video(
            prompt="a bench", width=w, height=h, frames=frames, steps=1, cfg_scale=1.0, seed=1
        )
        seconds = time.monotonic() - t
        pngs = [png_bytes(f, {**result.metadata, "frame": i}) for i, f in enumerate(result.frames)]
        estimate = result.metadata["estimate"]
        resident = engine.facts.resident()
        model_bytes = engine.model.total_bytes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "size": f"{w}x{h}",
        "frames": frames,
        "model_bytes": model_bytes,
        "peak_rss": peak,
        "estimate": estimate,
        "resident_estimate": resident,
        "covered": estimate >= peak,
        "estimate_over_peak": round(estimate / peak, 2),
        "load_s": round(load_s, 2),
        "generate_s": round(seconds, 2),
        "result_bytes": sum(map(len, pngs)) + len(result.webp),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*(int(x) for x in args.child))))
        return 0
    rows = []
    for w, h, frames in CASES:
        cmd = [sys.executable, __file__, "--child", str(w), str(h), str(frames)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{row['size']:>8} x {row['frames']:>2} frames  peak {row['peak_rss'] / 2**20:7.1f} "
            f"MiB  estimate {row['estimate'] / 2**20:7.1f} MiB  x{row['estimate_over_peak']}  "
            f"load {row['load_s']} s  generate {row['generate_s']} s",
            flush=True,
        )
    doc = {
        "what": "peak RSS of one video job (fresh process, frames PNG-encoded, animated WebP) "
        "vs ModelFacts.video_estimate; random-weight Wan2.1 T2V 1.3B (q4_0 DiT, f16 VAE, no "
        "T5), 1 step, cfg 1",
        "device": "CPU",
        "threads": 2,
        "rows": rows,
        "all_covered": all(r["covered"] for r in rows),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if doc["all_covered"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
