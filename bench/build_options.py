"""The runtime's build and run options on one GPU: seconds per image and whether the image is
the same, each variant in its own fresh process, side by side in one run.

A variant is a label, a runtime build folder (`sdfarm build --json` prints its `directory`;
e.g. one built with `--cmake-arg=-DSD_FAST_SOFTMAX=ON`) and environment settings for the
process (e.g. `GGML_CUDA_DISABLE_GRAPHS=1`). Each child loads the model on the device, makes
one untimed image per size, then `--images` timed ones (same seed), and reports the median
seconds per image and the SHA-256 of the last image's pixels, and keeps that image as a PNG;
the parent compares every variant's pixels with the first variant's: the same or not, and where
not, how far (the largest difference of a channel value, the share of values that differ, and
the PSNR in dB).

    python bench/build_options.py --model DIR --device CUDA0 --sizes 512,1024 --images 5 \\
        --variant base=/tmp/cudart --variant graphs-off=/tmp/cudart:GGML_CUDA_DISABLE_GRAPHS=1 \\
        --variant fast-softmax=/tmp/cudart-fs [--batch B] [--out FILE]

`--batch B`: every call is a job of B images (`batch_count`, seeds 42..42+B-1), timed per
image (the call's time / B), its pixels all B images'; on a CUDA device each variant's
process is sampled for its GPU memory peak (nvidia-smi, above the reading before it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpupeak  # noqa: E402

MARK = "@@build-options "


def process_gpu_mib() -> int | None:
    """This process's GPU memory now, by nvidia-smi (None where it does not answer): what it
    holds between images (weights, context, ggml's memory pool), not the peak, since the
    runtime frees its compute buffers after each call (on the H200 the full-size model held
    3.2 / 3.6 GiB after 512 / 1024 images through im2col, against its 10 GiB peak at 1024)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(mib.strip())
    return None


def child(
    model: str, device: str, sizes: list[int], images: int, save: str, steps: int = 1,
    batch: int = 1,
) -> None:  # fmt: skip
    import hashlib

    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.params import GenerationParams

    engine = Engine.load(Path(model), log=LogConfig(level="warn"), device=device)
    for size in sizes:
        params = GenerationParams(prompt="a build options bench", width=size, height=size,
                                  steps=steps, seed=42, batch_count=batch)  # fmt: skip
        engine.generate(params)  # untimed: first use of this size
        times, digest = [], ""
        for _ in range(images):
            t = time.perf_counter()
            result = engine.generate(params)
            times.append((time.perf_counter() - t) / batch)
            digest = hashlib.sha256(b"".join(im.tobytes() for im in result.images)).hexdigest()[:16]
        result.image.save(f"{save}-{size}.png")
        print(MARK + json.dumps({"size": size, "s_per_image": statistics.median(times),
                                 "times": [round(x, 4) for x in times],
                                 "pixels": digest, "gpu_mib": process_gpu_mib(),
                                 "estimate_mib": engine.estimate_for(size, size, batch=batch) >> 20,
                                 "batch": batch, "images_back": len(result.images)}),
              flush=True)  # fmt: skip
    engine.dispose()


def difference(a_png: Path, b_png: Path) -> dict:
    """How far two images are apart: largest channel difference, share differing, PSNR."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(a_png), dtype=np.int16)
    b = np.asarray(Image.open(b_png), dtype=np.int16)
    if a.shape != b.shape:
        return {"shape_differs": True}
    d = np.abs(a - b)
    mse = float(np.mean(d.astype(np.float64) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
    return {"max_abs_diff": int(d.max()), "share_differing": round(float(np.mean(d > 0)), 6),
            "psnr_db": round(float(psnr), 2) if mse else None}  # fmt: skip


def parse_variant(text: str) -> tuple[str, str, dict[str, str]]:
    """Parse `label=DIR[:KEY=VALUE[,KEY=VALUE]]` into (label, dir, env)."""
    label, _, rest = text.partition("=")
    directory, _, settings = rest.partition(":")
    env = dict(s.split("=", 1) for s in settings.split(",") if s)
    if not label or not directory:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: want LABEL=DIR[:KEY=VALUE,...]")
    return label, directory, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="CUDA0")
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--images", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1, help="sampling steps of every image")
    ap.add_argument("--batch", type=int, default=1, help="images per call (batch_count)")
    ap.add_argument("--variant", action="append", type=parse_variant, default=[])
    ap.add_argument("--deadline", type=float, default=None, help="no new variant after (s)")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        child(args.model, args.device, sizes, args.images, args.save, args.steps, args.batch)
        return 0
    t0 = time.monotonic()
    keep = Path(tempfile.mkdtemp(prefix="build-options-"))
    rows: list[dict] = []
    for label, directory, env in args.variant:
        if args.deadline is not None and time.monotonic() - t0 > args.deadline:
            print(f"{label}: skipped (deadline)", flush=True)
            continue
        child_env = {**os.environ, "SDFARM_RUNTIME_DIR": directory, **env}
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--device",
               args.device, "--sizes", args.sizes, "--images", str(args.images),
               "--steps", str(args.steps), "--batch", str(args.batch),
               "--save", str(keep / label)]  # fmt: skip
        done, peak = gpupeak.sampled(cmd, args.device, env=child_env)
        found = [json.loads(line[len(MARK) :]) for line in done.stdout.splitlines()
                 if line.startswith(MARK)]  # fmt: skip
        if done.returncode != 0 or not found:
            print(f"{label}: failed (exit {done.returncode}): {done.stderr[-600:]}", flush=True)
            rows.append({"variant": label, "failed": True})
            continue
        for r in found:
            rows.append({"variant": label, "runtime": Path(directory).name, "env": env, **r,
                         "process_peak_mib": None if peak is None else peak >> 20})  # fmt: skip
            print(f"{label:14} {r['size']:>5}  {r['s_per_image'] * 1000:7.1f} ms/image  "
                  f"{r.get('images_back')} of {r.get('batch')} images  "
                  f"pixels {r['pixels']}  GPU {r.get('gpu_mib')} MiB, peak "
                  f"{rows[-1]['process_peak_mib']} MiB (estimate {r.get('estimate_mib')} MiB)",
                  flush=True)  # fmt: skip
    first = args.variant[0][0]
    base = {r["size"]: r["pixels"] for r in rows if r.get("variant") == first and "size" in r}
    for r in rows:
        if "pixels" in r:
            r["same_pixels_as_first"] = r["pixels"] == base.get(r["size"])
            if not r["same_pixels_as_first"] and r["size"] in base:
                size = r["size"]
                r["against_first"] = difference(
                    keep / f"{first}-{size}.png", keep / f"{r['variant']}-{size}.png"
                )
                print(f"{r['variant']:14} {r['size']:>5}  against {first}: {r['against_first']}")
    shutil.rmtree(keep, ignore_errors=True)
    doc = {"what": __doc__.splitlines()[0], "model": Path(args.model).name,
           "device": args.device, "images": args.images, "steps": args.steps,
           "batch": args.batch,
           "rows": rows}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
