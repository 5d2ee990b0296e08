"""The TAESD decoder against the full VAE on this machine: how far apart their images of the
same latent are (mean absolute difference, largest difference, PSNR) and what each decode
costs: the runtime's own `decode_first_stage completed, taking N.NNs` record (wall clock, 10 ms
resolution) and the whole job's CPU seconds of this process (on a machine shared with other
work CPU time is the steadier figure; with one step of the tiny model everything but the
decode is the same small amount for both decoders, so the CPU difference is the decodes').

Two engines of one model, one per decoder (the runtime fixes the decoder per context:
sdfarm.native.decoders), run the same jobs (same seed, so the same latent: the decoder does
not take part in sampling) interleaved, `--runs` times per size. The model is the tiny one
with a VAE beside its TAESD (sdfarm.native.testmodel.make_vae_test_model); `--vae-ch 128`
gives its VAE the real KL-f8 decoder's width (49.5 M parameters, as SD 1.x/2.x/XL/Flux have;
random weights), so the decode times are a real-size VAE's and a real-size TAESD's. Random
weights: the images differ completely, and the difference says only that the two are other
decoders; docs/gpu.md quotes what TAESD's authors measured on trained weights.

    python bench/decoder_quality.py [--sizes 256,512] [--runs 3] [--vae-ch 32|128]
                                    [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

DECODE_RE = re.compile(r"decode_first_stage completed, taking ([0-9.]+)s")
DECODERS = ("vae", "taesd")


def cpu_s() -> float:
    """This process's CPU seconds (the runtime's threads included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def decode_seconds(records: list[Any]) -> float | None:
    """The runtime's decode time from a generation's records."""
    for r in records:
        m = DECODE_RE.search(r.message)
        if m:
            return float(m.group(1))
    return None


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Mean and largest absolute difference (0..255) and PSNR (dB) of two 8-bit images."""
    d = a.astype(np.float64) - b.astype(np.float64)
    mse = float((d * d).mean())
    return {
        "mean_abs_diff": round(float(np.abs(d).mean()), 2),
        "max_abs_diff": int(np.abs(d).max()),
        "psnr_db": round(10 * math.log10(255.0**2 / mse), 2) if mse else math.inf,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,512")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--vae-ch", type=int, default=32, help="the VAE decoder's base width")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.params import GenerationParams
    from sdfarm.native.testmodel import make_vae_test_model

    sizes = [int(s) for s in args.sizes.split(",")]
    log = LogConfig(level="info")
    times: dict[str, dict[str, dict[str, list[float]]]] = {
        d: {str(s): {"decode_s": [], "generate_s": [], "cpu_s": []} for s in sizes}
        for d in DECODERS
    }
    diffs: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_vae_test_model(tmp, vae_ch=args.vae_ch)
        files = {f.name: f.stat().st_size for f in sorted(folder.glob("*.safetensors"))}
        engines = {d: Engine.load(folder, decoder=d, threads=args.threads) for d in DECODERS}
        try:
            for size in sizes:
                job = GenerationParams(prompt="a decoder benchmark", width=size, height=size,
                                       steps=args.steps, seed=11)  # fmt: skip
                images: dict[str, np.ndarray] = {}
                for d in DECODERS:  # warm: the first call at a size allocates its graphs
                    engines[d].generate(replace(job, decoder=d))
                for _ in range(args.runs):
                    for d in DECODERS:
                        t, c = time.perf_counter(), cpu_s()
                        r = engines[d].generate(replace(job, decoder=d), log=log)
                        wall, cpu = time.perf_counter() - t, cpu_s() - c
                        row = times[d][str(size)]
                        row["generate_s"].append(round(wall, 3))
                        row["cpu_s"].append(round(cpu, 3))
                        row["decode_s"].append(decode_seconds(r.records) or float("nan"))
                        image = np.asarray(r.image.convert("RGB"))
                        if d in images:
                            assert (images[d] == image).all(), "a decoder's image changed"
                        images[d] = image
                diffs[str(size)] = compare(images["vae"], images["taesd"])
        finally:
            for e in engines.values():
                e.dispose()
    summary = {
        d: {
            s: {
                "decode_s_median": statistics.median(v["decode_s"]),
                "generate_s_median": statistics.median(v["generate_s"]),
                "cpu_s_median": statistics.median(v["cpu_s"]),
            }
            for s, v in per.items()
        }
        for d, per in times.items()
    }
    for s in map(str, sizes):
        vae, taesd = summary["vae"][s], summary["taesd"][s]
        print(
            f"{s}x{s}: decode wall VAE {vae['decode_s_median']:.2f} s, TAESD "
            f"{taesd['decode_s_median']:.2f} s; job CPU VAE {vae['cpu_s_median']:.2f} s, TAESD "
            f"{taesd['cpu_s_median']:.2f} s; images: mean |diff| "
            f"{diffs[s]['mean_abs_diff']}/255, max {diffs[s]['max_abs_diff']}, "
            f"PSNR {diffs[s]['psnr_db']} dB"
        )
    doc = {
        "bench": "decoder_quality",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0]},
        "args": vars(args),
        "model": {"files": files, "vae_ch": args.vae_ch, "weights": "random"},
        "times": times,
        "summary": summary,
        "difference_vae_vs_taesd": diffs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
