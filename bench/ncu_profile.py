"""Where an image's GPU time goes, kernel by kernel, through Nsight Compute: the runtime's own
sd-cli (pixel-identical to our engine, docs/gpu.md) makes one image under `ncu`, which times
every kernel it launches (`gpu__time_duration`, clocks and caches left as they run).

    python bench/ncu_profile.py --cli SD_CLI --model DIR --sizes 512,1024 [--steps 1] \\
        [--ncu ncu] [--out FILE]

The kernels come in launch order. sd-cli runs flash attention in the diffusion model only, so
the flash-attention kernels mark the UNet: kernels before the first are the text encoder (and
the UNet's first blocks), kernels after the last are the VAE decode (and the UNet's output
convolution). Per phase and over all, kernels are summed by name.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdcli import command, env_for, model_files  # noqa: E402


def short(name: str) -> str:
    """A kernel's name without template arguments and parameter lists, for grouping."""
    while True:
        stripped = re.sub(r"<[^<>]*>", "", name)
        if stripped == name:
            break
        name = stripped
    name = re.sub(r"\(.*\)$", "", name)
    name = name.replace("void ", "").strip()
    return name[:90]


def read_kernels(log: str) -> list[tuple[str, float]]:
    """(kernel name, ms) in launch order from ncu's CSV log."""
    rows = [line for line in log.splitlines() if line.startswith('"')]
    out = []
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", ""))
            unit = row.get("Metric Unit", "ns")
            scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0}.get(
                unit, 1e-6
            )
            out.append((row["Kernel Name"], value * scale))
    return out


def phases(kernels: list[tuple[str, float]]) -> dict[str, list[tuple[str, float]]]:
    fa = [i for i, (name, _) in enumerate(kernels) if "flash_attn" in name]
    if not fa:
        return {"all": kernels}
    return {
        "before the first flash attention (text encoder)": kernels[: fa[0]],
        "UNet (first to last flash attention)": kernels[fa[0] : fa[-1] + 1],
        "after the last flash attention (VAE decode)": kernels[fa[-1] + 1 :],
    }


def summary(kernels: list[tuple[str, float]], top: int) -> dict[str, Any]:
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for name, ms in kernels:
        total[short(name)] += ms
        count[short(name)] += 1
    rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return {
        "kernels": len(kernels),
        "ms": round(sum(ms for _, ms in kernels), 3),
        "top": [{"kernel": n, "ms": round(t, 3), "launches": count[n]} for n, t in rows],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out")
    ap.add_argument("--deadline", type=float, default=600.0)
    args = ap.parse_args()

    files = model_files(args.model)
    report: dict[str, Any] = {
        "cli": args.cli,
        "model": args.model,
        "steps": args.steps,
        "sizes": {},
    }
    start = time.monotonic()
    for size in [int(s) for s in args.sizes.split(",")]:
        left = args.deadline - (time.monotonic() - start)
        if left < 20:
            print(f"{size}: skipped (deadline)")
            continue
        work = Path(tempfile.mkdtemp())
        log = work / "ncu.csv"
        cmd = [
            args.ncu,
            "--metrics",
            "gpu__time_duration.sum",
            "--cache-control",
            "none",
            "--clock-control",
            "none",
            "--csv",
            "--print-units",
            "base",
            "--log-file",
            str(log),
        ]
        cmd += command(args.cli, files, size, str(work / "out.png"), steps=args.steps)
        t = time.perf_counter()
        proc = subprocess.run(
            cmd, env=env_for(args.cli), capture_output=True, text=True, timeout=left
        )
        wall = time.perf_counter() - t
        text = log.read_text() if log.exists() else ""
        kernels = read_kernels(text)
        if proc.returncode != 0 or not kernels:
            print(f"{size}: ncu exited {proc.returncode}, {len(kernels)} kernels")
            print(proc.stderr[-2000:], text[-2000:])
            continue
        parts = {name: summary(ks, args.top) for name, ks in phases(kernels).items()}
        report["sizes"][str(size)] = {
            "wall_s_under_ncu": round(wall, 1),
            "all": summary(kernels, args.top),
            "phases": parts,
        }
        print(
            f"== {size}x{size}, {args.steps} step(s): {len(kernels)} kernels, "
            f"{sum(ms for _, ms in kernels):.1f} ms of kernel time ({wall:.0f} s under ncu)"
        )
        for name, p in parts.items():
            print(f"  {name}: {p['kernels']} kernels, {p['ms']:.1f} ms")
            for r in p["top"]:
                print(f"      {r['ms']:9.3f} ms  x{r['launches']:<5} {r['kernel']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
