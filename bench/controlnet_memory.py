"""Peak memory of a ControlNet generation against its estimate, on the CPU or a CUDA device.

Each case runs in a fresh process with the random-weight SD 1.x model (sdfarm.native.sd1model:
UNet + CLIP-L q4_0, TAESD) and its ControlNet: load the engine (with the ControlNet, with an
embedding too, or neither), generate one image of the size (1 step, a random control image),
encode the PNG, and report the peak (the process's peak RSS, ru_maxrss; on a CUDA device
nvidia-smi's memory.used above its reading before, bench/gpupeak.py) beside the job's estimate (the
engine's `metadata["estimate"]`, the figure the scheduler places by), the runtime's own count
of the ControlNet's parameters ("controlnet N MB" in its load record) beside ours
(`ControlNetFile.resident_bytes`), and the load and generate times.

    python bench/controlnet_memory.py [--models DIR] [--out FILE] [--sizes 64,256,512] \
        [--device CUDA0]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import gpupeak

KINDS = ("plain", "controlnet", "controlnet+embedding")


def child(models: str, kind: str, size: int, device: str) -> dict:
    """One case in this process (no numpy before the runtime loads: on the H200 host that
    crashed it, docs/gpu.md)."""
    import io
    import random
    import resource

    from PIL import Image

    from sdfarm.native.controlnets import ControlNetCatalog, controlnet_dirs
    from sdfarm.native.embeddings import EmbeddingCatalog, embedding_dirs
    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.params import GenerationParams

    root = Path(models)
    control_net = embeddings = None
    extra: dict = {}
    if kind != "plain":
        control_net = ControlNetCatalog(controlnet_dirs([root])).load("sd1-control")
        pixels = random.Random(1).randbytes(size * size * 3)
        buf = io.BytesIO()
        Image.frombytes("RGB", (size, size), pixels).save(buf, "PNG")
        extra = {"control_net": "sd1-control", "control_image": buf.getvalue()}
    if kind == "controlnet+embedding":
        embeddings = [EmbeddingCatalog(embedding_dirs([root])).load("sd1-emb")]
        extra["embeddings"] = "sd1-emb"
    t = time.monotonic()
    engine = Engine.load(root / "sd1-tiny", threads=2, log=LogConfig(level="info"), device=device,
                         control_net=control_net, embeddings=embeddings or ())  # fmt: skip
    load_s = time.monotonic() - t
    records = [r.message for r in engine.drain_load_records()]
    params = GenerationParams(prompt="a bench sd1-emb", width=size, height=size, steps=1, seed=1,
                              **extra)  # fmt: skip
    t = time.monotonic()
    result = engine.generate(params)
    generate_s = time.monotonic() - t
    png = io.BytesIO()
    result.image.save(png, "PNG")
    engine.dispose()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runtime_cn = next(
        (float(m.group(1)) for r in records if (m := re.search(r"controlnet ([\d.]+)MB", r))),
        None,
    )
    estimate = int(result.metadata["estimate"])
    return {
        "kind": kind,
        "size": f"{size}x{size}",
        "peak_rss": peak,
        "estimate": estimate,
        "covered": estimate >= peak,
        "estimate_over_peak": round(estimate / peak, 2),
        "controlnet_runtime_mib": runtime_cn,
        "controlnet_ours_mib": round(control_net.resident_bytes / 2**20, 2)
        if control_net
        else None,
        "load_s": round(load_s, 2),
        "generate_s": round(generate_s, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="a models dir holding sd1-tiny (default: the test cache)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--sizes", default="64,256,512,768")
    ap.add_argument("--device", default="cpu", help="cpu (default) or CUDA0, ...")
    ap.add_argument("--deadline", type=float, default=None, help="no new case after this (s)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        models, kind, size = args.child
        print(json.dumps(child(models, kind, int(size), args.device)))
        return 0
    t0 = time.monotonic()
    models = args.models
    if models is None:
        from sdfarm.native.sd1model import ensure_sd1_test_model

        models = str(ensure_sd1_test_model())  # numpy: in this process, not the children
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for kind in KINDS:
            if args.deadline is not None and time.monotonic() - t0 > args.deadline:
                print(f"{kind} {size}: skipped (deadline)", flush=True)
                continue
            cmd = [sys.executable, __file__, "--child", models, kind, str(size),
                   "--device", args.device]  # fmt: skip
            row = gpupeak.run_row(cmd, args.device, {"kind": kind, "size": f"{size}x{size}"})
            if row.get("failed"):
                rows.append(row)
                continue
            rows.append(row)
            cn = (
                f"  ControlNet runtime {row['controlnet_runtime_mib']} MiB, ours "
                f"{row['controlnet_ours_mib']} MiB"
                if row["controlnet_ours_mib"]
                else ""
            )
            print(
                f"{row['kind']:21} {row['size']:>9}  peak {row['peak_rss'] / 2**20:7.1f} MiB  "
                f"estimate {row['estimate'] / 2**20:7.1f} MiB  x{row['estimate_over_peak']}  "
                f"load {row['load_s']} s  generate {row['generate_s']} s{cn}",
                flush=True,
            )
    doc = {
        "what": "peak RSS of one SD 1.x generation (fresh process, 1 step, PNG encoded) with "
        "a ControlNet, with a ControlNet and an embedding, and with neither, vs the job's "
        "estimate; the random-weight SD 1.x test model (q4_0 UNet and CLIP-L, TAESD) and its "
        "q4_0 ControlNet",
        "device": args.device,
        "threads": 2,
    }
    return gpupeak.finish(doc, rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
