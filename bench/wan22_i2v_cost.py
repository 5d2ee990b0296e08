"""What a random-weight Wan2.2-I2V-14B test DiT costs on this machine: why the first/last-frame
tests run on no real-runtime model in CI.

The runtime builds a Wan DiT only at the real sizes (40 layers of dim 5120 for the 14B models,
src/wan.hpp of master-596: any other layer count aborts) and refuses a file missing any tensor
("tensor '...' not in model file", src/model.cpp), so the smallest I2V-14B it loads is the whole
14.3 B-parameter expert, written here as the Wan test model's DiTs are (q4_0 linear weights,
sdfarm.native.wantestmodel.I2V_14B) beside the Wan test model's VAE. One expert is measured
(a pair doubles file, write, load and RSS): its write, its load, one 32x32, 5-frame, 1-step,
cfg 1 video without images and one with a first and a last frame, the process's peak RSS.
The DiT is written into a temporary folder (8 GB of disk) and removed after.

    python bench/wan22_i2v_cost.py [--out bench/results/wan22_i2v_cost-cpu.json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import hashlib, io, json, resource, sys, time
from PIL import Image
from sdfarm.native.engine import Engine

def png(color):
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, "PNG")
    return buf.getvalue()

out = {}
t = time.monotonic()
with Engine.load(sys.argv[1], device="cpu", threads=2) as engine:
    out["load_s"] = round(time.monotonic() - t, 1)
    out["resident_estimate"] = engine.facts.resident()
    for case, images in (("no_images", {}),
                         ("first_last", {"init_image": png((200, 0, 0)),
                                         "end_image": png((0, 0, 200))})):
        t = time.monotonic()
        r = engine.video(prompt="x", width=32, height=32, frames=5, steps=1, cfg_scale=1.0,
                         seed=1, **images)
        out[case] = {
            "generate_s": round(time.monotonic() - t, 1),
            "video_model": r.metadata["video_model"],
            "estimate": r.metadata["estimate"],
            "frames_sha256": hashlib.sha256(b"".join(f.tobytes() for f in r.frames)).hexdigest(),
        }
out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""


def write(folder: Path) -> dict:
    """The I2V-14B DiT and a model.json beside a link to the Wan test model's VAE, in a
    process of its own (numpy stays out of the process that loads the runtime)."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from sdfarm.native.wantestmodel import I2V_14B, cached_wan_test_model, write_dit\n"
        "vae = cached_wan_test_model() / 'vae.safetensors'\n"
        "t = time.monotonic()\n"
        "write_dit(Path(sys.argv[1]) / 'dit.gguf', I2V_14B)\n"
        "print(round(time.monotonic() - t, 1)); print(vae)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True
    )
    seconds, vae = done.stdout.split()[-2:]
    os.link(vae, folder / "vae.safetensors")
    manifest = {"files": {"diffusion_model": "dit.gguf", "vae": "vae.safetensors"},
                "native_size": [64, 64]}  # fmt: skip
    (folder / "model.json").write_text(json.dumps(manifest), encoding="utf-8")
    return {"write_s": float(seconds), "dit_bytes": (folder / "dit.gguf").stat().st_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--keep", help="write the model into this folder and keep it")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wan22-i2v-") as tmp:
        folder = Path(args.keep or tmp) / "wan22-i2v-14b-test"
        folder.mkdir(parents=True, exist_ok=True)
        row = write(folder)
        print(f"write {row['write_s']} s, {row['dit_bytes']:,} bytes", flush=True)
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True
        )
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    print(json.dumps(row, indent=2))
    doc = {
        "what": "one random-weight Wan2.2-I2V-14B expert (40 layers, dim 5120, in_dim 36, q4_0 "
        "linear weights) beside the Wan test VAE, no T5: write, load, one 32x32x5 1-step cfg-1 "
        "video without and with first+last frame, peak RSS; 2 threads, this machine's CPU",
        "when": time.strftime("%Y-%m-%d"),
        "cpu_threads": os.cpu_count(),
        "load_average_after": [round(x, 1) for x in os.getloadavg()],
        **row,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
