"""Peak memory of a LoRA generation against its estimate, on the CPU or a CUDA device.

Each case runs in a fresh process: load the engine, generate one image of the size (1 step)
without a LoRA or with one, encode the PNG, and report the peak (the process's peak RSS; on a
CUDA device nvidia-smi's memory.used above its reading before, bench/gpupeak.py) beside the
job's estimate (the engine's `metadata["estimate"]`, the figure the scheduler places by: the
model's terms plus the LoRA file's bytes), and the load and generate times. The engine applies
LoRAs at run time (sdfarm.native.engine.lora_apply_mode), so the LoRA's weights are resident
beside the model's and its products run in every step.

The model: the tiny model and its LoRA by default, or `--model DIR` with a `loras/` folder
beside it (`python bench/fullsize_model.py OUT --lora` writes the random-weight SD-Turbo
model and a rank-64 LoRA on all its UNet transformer layers, `sd-turbo-lora`).

    python bench/lora_memory.py [--model DIR --lora NAME] [--sizes 512,1024] [--device CUDA0]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import gpupeak

KINDS = ("plain", "lora")


def child(model: str, lora: str, kind: str, size: int, device: str) -> dict:
    """One case in this process (no numpy before the runtime loads: on the H200 host that
    crashed it, docs/gpu.md)."""
    import io
    import resource

    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.loras import LoraCatalog, lora_dirs
    from sdfarm.native.params import GenerationParams

    folder = Path(model)
    files = {lora: LoraCatalog(lora_dirs([folder.parent])).load(lora)}
    loras = ((lora, 0.8),) if kind == "lora" else ()
    t = time.monotonic()
    engine = Engine.load(folder, threads=2, log=LogConfig(level="debug"), device=device)
    load_s = time.monotonic() - t
    params = GenerationParams(prompt="a lora bench", width=size, height=size, steps=1, seed=1,
                              loras=loras)  # fmt: skip
    t = time.monotonic()
    result = engine.generate(params, loras=files)
    generate_s = time.monotonic() - t
    png = io.BytesIO()
    result.image.save(png, "PNG")
    engine.dispose()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    estimate = int(result.metadata["estimate"])
    # "lora params backend buffer size = 96.12 MB(VRAM) (528 tensors)": what the runtime took
    # of the file (one line per model part it applied to); 0 tensors = a LoRA that matched
    # nothing, which would make the row meaningless.
    found = [m for r in result.records
             if (m := re.search(r"lora params backend buffer size =\s*([\d.]+) MB\((\w+)\) "
                                r"\((\d+) tensors\)", r.message))]  # fmt: skip
    return {
        "kind": kind,
        "size": f"{size}x{size}",
        "lora_bytes": files[lora].size if kind == "lora" else 0,
        "runtime_lora_mb": round(sum(float(m.group(1)) for m in found), 2),
        "runtime_lora_tensors": sum(int(m.group(3)) for m in found),
        "runtime_lora_buffer": sorted({m.group(2) for m in found}),
        "peak_rss": peak,
        "estimate": estimate,
        "covered": estimate >= peak,
        "estimate_over_peak": round(estimate / peak, 2),
        "load_s": round(load_s, 2),
        "generate_s": round(generate_s, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model folder with loras/ beside it (default: tiny)")
    ap.add_argument("--lora", default=None, help="the LoRA's name (default: the test LoRA)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--sizes", default="64,128")
    ap.add_argument("--device", default="cpu", help="cpu (default) or CUDA0, ...")
    ap.add_argument("--deadline", type=float, default=None, help="no new case after this (s)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, lora, kind, size = args.child
        print(json.dumps(child(model, lora, kind, int(size), args.device)))
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model, lora = args.model, args.lora
        if model is None:
            from tinymodel import tiny_model

            from sdfarm.native.testmodel import TEST_LORA

            model, lora = str(tiny_model(tmp)), lora or TEST_LORA
        if lora is None:
            ap.error("--lora NAME is needed with --model")
        rows = []
        for size in [int(s) for s in args.sizes.split(",")]:
            for kind in KINDS:
                if args.deadline is not None and time.monotonic() - t0 > args.deadline:
                    print(f"{kind} {size}: skipped (deadline)", flush=True)
                    continue
                cmd = [sys.executable, __file__, "--child", model, lora, kind, str(size),
                       "--device", args.device]  # fmt: skip
                row = gpupeak.run_row(cmd, args.device, {"kind": kind, "size": f"{size}x{size}"})
                if row.get("failed"):
                    rows.append(row)
                    continue
                rows.append(row)
                lora_rt = f"{row['runtime_lora_mb']} MB, {row['runtime_lora_tensors']} tensors"
                print(
                    f"{row['kind']:6} {row['size']:>9}  peak {row['peak_rss'] / 2**20:8.1f} MiB  "
                    f"estimate {row['estimate'] / 2**20:8.1f} MiB  x{row['estimate_over_peak']}  "
                    f"LoRA {row['lora_bytes'] / 2**20:.1f} MiB (runtime {lora_rt})  "
                    f"load {row['load_s']} s  generate {row['generate_s']} s",
                    flush=True,
                )
    doc = {
        "what": "peak of one generation (fresh process, 1 step, PNG encoded) with a LoRA "
        "applied at run time (weight 0.8) and without, vs the job's estimate",
        "model": Path(model).name,
        "lora": lora,
        "device": args.device,
    }
    return gpupeak.finish(doc, rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
