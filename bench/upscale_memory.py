"""Peak memory of an upscale on the CPU against its estimate (`UpscalerFacts.estimate`).

Each case runs in a fresh process: load the upscaler, upscale a random image of the size,
encode the PNG as the worker's uploader does, and report the process's peak RSS
(ru_maxrss) beside the estimate of that job, with direct convolution (the CPU's and Vulkan's
path) and without it (im2col, CUDA's path, measured here on the CPU as a stand-in). Then a
generation of the tiny model whose hires pass upscales the latent or the image with an
upscaler, against the generation's estimate.

    python bench/upscale_memory.py [--models DIR] [--out FILE] [--hires-only]
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

# (upscaler, input width, input height, tile size)
CASES = (
    ("tiny-esrgan-x4", 64, 64, 0),
    ("tiny-esrgan-x4", 128, 128, 0),
    ("tiny-esrgan-x4", 128, 128, 64),
    ("tiny-esrgan-x2", 192, 192, 0),
    ("tiny-esrgan-x2", 256, 256, 128),
)


def child(models: str, name: str, w: int, h: int, tile: int) -> dict:
    """One case in this process: the peak RSS and the estimate."""
    import io
    import resource

    import numpy as np
    from PIL import Image

    from sdfarm.native.upscale import Upscaler
    from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs

    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    catalog = UpscalerCatalog(upscaler_dirs([models]))
    with Upscaler.load(catalog.load(name), tile_size=tile, threads=2) as up:
        t = time.monotonic()
        out = up.upscale(image=buf.getvalue(), tile_size=tile)
        seconds = time.monotonic() - t
        png = io.BytesIO()
        out.image.save(png, "PNG")
        estimate = up.estimate_for(w, h, tile)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "upscaler": name,
        "input": f"{w}x{h}",
        "output": "x".join(map(str, out.image.size)),
        "tile_size": tile,
        "conv_direct": os.environ.get("SDFARM_VAE_CONV_DIRECT") == "1",
        "peak_rss": peak,
        "estimate": estimate,
        "covered": estimate >= peak,
        "estimate_over_peak": round(estimate / peak, 2),
        "upscale_s": round(seconds, 2),
    }


HIRES_CASES = (
    # (hires upscaler or "" for the latent, width, height, hires_scale, tile size)
    ("", 128, 128, 2.0, 128),
    ("tiny-esrgan-x4", 128, 128, 2.0, 64),
    ("tiny-esrgan-x2", 128, 128, 2.0, 0),
)


def hires_child(models: str, name: str, w: int, h: int, scale: float, tile: int) -> dict:
    """A generation whose hires pass upscales with `name` (the tiny model, 2+2 steps): the
    peak RSS and the generation's estimate, which counts the upscaler's working memory."""
    import resource

    from sdfarm.native.engine import Engine
    from sdfarm.native.params import GenerationParams
    from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs

    catalog = UpscalerCatalog(upscaler_dirs([models]))
    files = {n: catalog.load(n) for n in catalog.names()}
    params = GenerationParams(prompt="a hires bench", width=w, height=h, steps=2, seed=1,
                              hires_scale=scale, hires_steps=2, hires_upscaler=name,
                              hires_tile_size=tile)  # fmt: skip
    with Engine.load(Path(models) / "tiny-f16", threads=2) as engine:
        t = time.monotonic()
        result = engine.generate(params, upscalers=files)
        seconds = time.monotonic() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    estimate = result.metadata["estimate"]
    return {
        "hires_upscaler": name or "(latent)",
        "size": f"{w}x{h} -> " + "x".join(map(str, result.image.size)),
        "tile_size": tile,
        "peak_rss": peak,
        "estimate": estimate,
        "covered": estimate >= peak,
        "estimate_over_peak": round(estimate / peak, 2),
        "generate_s": round(seconds, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="a models dir with upscalers/ (default: write the tiny ones)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--hires-only", action="store_true", help="only the hires-pass cases")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--hires-child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        models, name, w, h, tile = args.child
        print(json.dumps(child(models, name, int(w), int(h), int(tile))))
        return 0
    if args.hires_child:
        models, name, w, h, scale, tile = args.hires_child
        name = "" if name == "-" else name
        doc = hires_child(models, name, int(w), int(h), float(scale), int(tile))
        print(json.dumps(doc))
        return 0
    models = args.models
    if models is None:
        from sdfarm.native.testmodel import make_test_model

        models = tempfile.mkdtemp(prefix="sdfarm-upscale-")
        make_test_model(models)
    rows = []
    for direct in () if args.hires_only else ("1", "0"):
        for name, w, h, tile in CASES:
            env = {**os.environ, "SDFARM_VAE_CONV_DIRECT": direct}
            cmd = [sys.executable, __file__, "--child", models, name, str(w), str(h), str(tile)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"{row['upscaler']:15} {row['input']:>8} -> {row['output']:>9} tile "
                f"{row['tile_size']:>3} direct={int(row['conv_direct'])}  peak "
                f"{row['peak_rss'] / 2**20:7.1f} MiB  estimate {row['estimate'] / 2**20:7.1f} "
                f"MiB  x{row['estimate_over_peak']}  {row['upscale_s']} s",
                flush=True,
            )
    hires_rows = []
    for name, w, h, scale, tile in HIRES_CASES:
        cmd = [sys.executable, __file__, "--hires-child", models, name or "-", str(w), str(h),
               str(scale), str(tile)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        hires_rows.append(row)
        print(
            f"hires {row['hires_upscaler']:15} {row['size']:>20} tile {row['tile_size']:>3}  "
            f"peak {row['peak_rss'] / 2**20:7.1f} MiB  estimate {row['estimate'] / 2**20:7.1f} "
            f"MiB  x{row['estimate_over_peak']}  {row['generate_s']} s",
            flush=True,
        )
    doc = {
        "what": "peak RSS of one upscale (fresh process, PNG encoded) vs UpscalerFacts.estimate",
        "device": "CPU",
        "threads": 2,
        "rows": rows,
        "hires": hires_rows,
        "all_covered": all(r["covered"] for r in rows + hires_rows),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if doc["all_covered"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
