"""The VAE decode options of the pinned runtime (issue #15, "cut the decode"), measured with
its own sd-cli on one model: the default (full VAE, f16 weights as in the file, im2col
convolution, untiled), the VAE's weights in f32 (and bf16) through the runtime's per-tensor
type rules (`tensor_type_rules` of sd_ctx_params_t, sd-cli --tensor-type-rules
'^first_stage_model\\.=f32'), VAE tiling (32x32 latent tiles, the runtime's overlap, as our
engine tiles), direct convolution (vae_conv_direct) and TAESD as the decoder. (On master-596
the type rules do not reach the VAE: Conv2d creates every convolution weight as F16, and the
SD 2.x VAE is all convolutions; measured on the H200: identical pixels, docs/gpu.md.)

Decode time: each case is one sd-cli process generating `--batch-count N` images of 1 step;
the runtime decodes the N latents one after another and logs "latent i decoded, taking
N.NNs" for each (10 ms resolution). The figure is the median over latents 2..N (the first
pays graph allocation), and the mean of those, which resolves 10 ms / (N-1). Same pixels:
image i of a case against image i of the default (same seed), largest channel difference
and PSNR over all images.

    python bench/decode_options.py --cli SD_CLI --model DIR --taesd-model DIR \
        [--sizes 512,1024] [--batch 4] [--deadline 120] --out FILE.json
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
from typing import Any

import sdcli

# name -> (sd-cli flags, uses the TAESD model folder, what it is)
CASES: dict[str, tuple[list[str], bool, str]] = {
    "default": ([], False, "full VAE, f16 weights (the file's), im2col convolution, untiled"),
    "vae_f32": (
        ["--tensor-type-rules", r"^first_stage_model\.=f32"],
        False,
        "the VAE's weights converted to f32 at load (tensor_type_rules)",
    ),
    "tiled": (
        ["--vae-tiling", "--vae-tile-size", "32x32"],
        False,
        "VAE tiling, 32x32 latent tiles (our engine's), the runtime's overlap",
    ),
    "taesd": ([], True, "TAESD decoder (random weights) instead of the full VAE"),
    "conv_direct": (["--vae-conv-direct"], False, "direct convolution in the VAE"),
    "vae_bf16": (
        ["--tensor-type-rules", r"^first_stage_model\.=bf16"],
        False,
        "the VAE's weights converted to bf16 at load (tensor_type_rules)",
    ),
}
SLOW = {"conv_direct": 2}  # fewer latents for the case that is 10x slower


def compare(a: str, b: str) -> dict[str, Any] | None:
    import numpy as np
    from PIL import Image

    if not (Path(a).exists() and Path(b).exists()):
        return None
    x = np.asarray(Image.open(a).convert("RGB"), dtype=np.int16)
    y = np.asarray(Image.open(b).convert("RGB"), dtype=np.int16)
    if x.shape != y.shape:
        return {"error": f"shapes {x.shape} vs {y.shape}"}
    d = np.abs(x - y)
    mse = float(np.mean(d.astype(np.float64) ** 2))
    return {
        "max_abs_diff": int(d.max()),
        "mean_abs_diff": round(float(d.mean()), 4),
        "psnr_db": None if mse == 0 else round(10 * math.log10(255.0**2 / mse), 2),
        "identical": bool(mse == 0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cli", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--taesd-model", required=True)
    p.add_argument("--sizes", default="512,1024")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--batch", type=int, default=4, help="latents per case (--batch-count)")
    p.add_argument("--deadline", type=float, default=150.0)
    p.add_argument("--case-timeout", type=float, default=60.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.monotonic()
    files = sdcli.model_files(args.model)
    taesd_files = sdcli.model_files(args.taesd_model)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = [c for c in args.cases.split(",") if c]
    doc: dict[str, Any] = {
        "bench": "decode_options",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(Path(args.model).resolve()),
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "cases": {n: {"what": CASES[n][2], "flags": CASES[n][0]} for n in names},
        "runs": [],
        "skipped": [],
        "errors": [],
    }
    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="decode-"))

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")

    images: dict[tuple[str, int], list[str]] = {}
    for size in sizes:
        for name in names:
            flags, taesd, _ = CASES[name]
            n = args.batch
            if name in SLOW:  # 3 latents at 512, 2 above
                n = min(n, 3 if size <= 512 else SLOW[name])
            left = args.deadline - (time.monotonic() - t0)
            if left < 8:
                doc["skipped"].append({"case": name, "size": size, "why": "deadline"})
                sdcli.say(f"SKIPPED {name} {size}: deadline")
                continue
            tag = f"{name}-{size}"
            cmd = sdcli.command(
                args.cli,
                taesd_files if taesd else files,
                size,
                str(tmp / f"{tag}-%d.png"),
                batch_count=n,
                extra=flags,
            )
            sdcli.say(f"{tag}: {n} latents ...")
            r = sdcli.run(cmd, min(args.case_timeout, left - 2), tmp / "logs", tag)
            lat = sdcli.latent_decodes(r["stdout"])
            ph = sdcli.phases(r["stdout"])
            saved = sdcli.saved_images(r["stdout"])
            steady = lat[1:] if len(lat) > 1 else lat
            wtype = [
                ln.split("VAE weight type stat:")[-1].strip()
                for ln in r["stdout"].splitlines()
                if "VAE weight type stat" in ln
            ]
            run = {
                "case": name,
                "size": size,
                "latents": n,
                "returncode": r["returncode"],
                "wall_s": r["wall_s"],
                "latent_decode_s": lat,
                "decode_ms_median": round(statistics.median(steady) * 1e3, 1) if steady else None,
                "decode_ms_mean": round(statistics.mean(steady) * 1e3, 2) if steady else None,
                "first_decode_ms": round(lat[0] * 1e3, 1) if lat else None,
                "phases_s": ph,
                "vae_weight_types": wtype[:1],
                "images": saved,
                "command": cmd,
            }
            if r["returncode"] != 0 or not lat:
                run["stderr_tail"] = sdcli.tail(r["stderr"], 2000)
                run["stdout_tail"] = sdcli.tail(r["stdout"], 2000)
                doc["errors"].append({"case": name, "size": size, "rc": r["returncode"]})
            images[(name, size)] = saved
            doc["runs"].append(run)
            save()
            sdcli.say(
                f"  rc {r['returncode']}, decode ms median {run['decode_ms_median']} "
                f"mean {run['decode_ms_mean']} (first {run['first_decode_ms']}), "
                f"wall {r['wall_s']} s, VAE types {run['vae_weight_types']}"
            )
    # Same pixels as the default, image by image (numpy only here, after every runtime child).
    for run in doc["runs"]:
        base = images.get(("default", run["size"])) or []
        mine = images.get((run["case"], run["size"])) or []
        cmps = [compare(a, b) for a, b in zip(base, mine, strict=False)]
        cmps = [c for c in cmps if c and "error" not in c]
        if cmps:
            run["vs_default"] = {
                "images_compared": len(cmps),
                "max_abs_diff": max(c["max_abs_diff"] for c in cmps),
                "mean_abs_diff": round(statistics.mean(c["mean_abs_diff"] for c in cmps), 4),
                "psnr_db_min": None
                if all(c["identical"] for c in cmps)
                else min(c["psnr_db"] for c in cmps if c["psnr_db"] is not None),
                "identical": all(c["identical"] for c in cmps),
            }
    table = []
    for name in names:
        row: dict[str, Any] = {"case": name, "what": CASES[name][2]}
        for size in sizes:
            r = next((x for x in doc["runs"] if x["case"] == name and x["size"] == size), None)
            row[f"decode_ms_{size}"] = r and r["decode_ms_median"]
            row[f"decode_ms_mean_{size}"] = r and r["decode_ms_mean"]
            row[f"vs_default_{size}"] = r and r.get("vs_default")
        table.append(row)
    doc["table"] = table
    save()
    print(f"{'case':<12} " + " ".join(f"{f'ms@{s}':>9} {'max|d|':>6} {'PSNR':>6}" for s in sizes))
    for row in table:
        cells = []
        for s in sizes:
            v = row[f"vs_default_{s}"] or {}
            cells.append(
                f"{row[f'decode_ms_mean_{s}'] or '-':>9} {v.get('max_abs_diff', '-'):>6} "
                f"{v.get('psnr_db_min') or ('inf' if v.get('identical') else '-'):>6}"
            )
        print(f"{row['case']:<12} " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
