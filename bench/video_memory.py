"""Peak memory of a video job against its estimate (`ModelFacts.video_estimate`).

Each case runs in a fresh process: load the random-weight Wan2.1 T2V 1.3B test model
(sdfarm.native.wantestmodel, cached), make one video (1 step, cfg 1), encode its frames as
PNGs and the animated WebP as the worker does, and report the peak beside the job's estimate,
the load and generate times. On the CPU the peak is the process's peak RSS (ru_maxrss); on a
CUDA device it is nvidia-smi's memory.used, sampled every 50 ms by the parent while the child
runs, less its reading before.

    python bench/video_memory.py [--device CUDA0] [--cases 480x832x17,...] [--out FILE]
                                 [--variant moe]

`--variant moe` runs the Wan 2.2-style MoE pair of the test model (a high_noise_diffusion_model
beside the same DiT: both stay loaded) with one step of each expert (high_noise_steps 1).
`--variant i2v` runs the image-to-video variant (a Wan2.1 I2V DiT and its CLIP vision encoder)
with an init and an end image of the frame size, and reports the runtime's compute buffers and
the encoder's time (its debug records).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import gpupeak

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


VARIANTS = {
    "t2v": ("wan-t2v-test", {}),
    "moe": ("wan-moe-test", {"high_noise_steps": 1}),
    "i2v": ("wan-i2v-test", {"images": True}),
}
"""--variant: the test model's folder name and what each video adds to its parameters."""


def child(w: int, h: int, frames: int, device: str, model: str, extra: dict | None = None) -> dict:
    """One case in this process: the peak RSS, the estimate and the times. numpy stays out
    of this process before the runtime loads (on the H200 host that crashed it: docs/gpu.md),
    so the model is written by another process first (`test_model`)."""
    import resource

    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.png import png_bytes

    extra = dict(extra or {})
    images = extra.pop("images", False)
    if images:  # an init and an end image of the frame size (PIL only: no numpy here)
        extra.update(init_image=_png(w, h, (200, 40, 40)), end_image=_png(w, h, (40, 40, 200)))
    log = LogConfig(level="debug") if images else None
    t = time.monotonic()
    with Engine.load(model, device=device, threads=2, log=log) as engine:
        load_s = time.monotonic() - t
        t = time.monotonic()
        result = engine.video(
            prompt="a bench", width=w, height=h, frames=frames, steps=1, cfg_scale=1.0, seed=1,
            **extra,
        )  # fmt: skip
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
        **({"compute_buffers": _buffers(result.records)} if images else {}),
    }


def _png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def _buffers(records: list) -> list[str]:
    """The runtime's compute buffer records of the job (e.g. "clip_vision compute buffer
    size: 10.88 MB(RAM)") and its stage times (the CLIP vision encoder's, the whole video's),
    in order."""
    keys = ("compute buffer size", "get_clip_vision_output completed", "generate_video completed")
    return [
        r.message.removeprefix("stable_diffusion: ")
        for r in records
        if any(k in r.message for k in keys)
    ]


def test_model(name: str = "wan-t2v-test") -> str:
    """The cached Wan test model's folder, written (numpy) in a process of its own."""
    code = f"from sdfarm.native.wantestmodel import cached_wan_test_model as m; print(m({name!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def run_case(w: int, h: int, frames: int, device: str, model: str, variant: str) -> dict:
    """A case in a child process; on CUDA, its GPU peak sampled from here."""
    cmd = [sys.executable, __file__, "--child", str(w), str(h), str(frames), "--device", device,
           "--model", model, "--variant", variant]  # fmt: skip
    return gpupeak.run_row(cmd, device, {"size": f"{w}x{h}", "frames": frames})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", default="cpu", help="cpu (default) or CUDA0, ...")
    ap.add_argument("--cases", default=None, help="WxHxFRAMES,... (default: the CPU table)")
    ap.add_argument("--deadline", type=float, default=None, help="no new case after this (s)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="t2v", help="the test model")
    args = ap.parse_args()
    name, extra = VARIANTS[args.variant]
    if args.child:
        w, h, frames = (int(x) for x in args.child)
        print(json.dumps(child(w, h, frames, args.device, args.model, extra)))
        return 0
    model = test_model(name)
    cases = CASES
    if args.cases:
        cases = tuple(tuple(int(x) for x in c.split("x")) for c in args.cases.split(","))
    t0 = time.monotonic()
    rows = []
    for w, h, frames in cases:
        if args.deadline is not None and time.monotonic() - t0 > args.deadline:
            print(f"{w}x{h}x{frames}: skipped (deadline)", flush=True)
            continue
        row = run_case(w, h, frames, args.device, model, args.variant)
        rows.append(row)
        if row.get("failed"):
            continue
        print(
            f"{row['size']:>8} x {row['frames']:>2} frames  peak {row['peak_rss'] / 2**20:7.1f} "
            f"MiB  estimate {row['estimate'] / 2**20:7.1f} MiB  x{row['estimate_over_peak']}  "
            f"load {row['load_s']} s  generate {row['generate_s']} s",
            flush=True,
        )
        for line in row.get("compute_buffers") or ():
            print(f"    {line}", flush=True)
    doc = {
        "what": "peak RSS of one video job (fresh process, frames PNG-encoded, animated WebP) "
        "vs ModelFacts.video_estimate; random-weight Wan2.1 T2V 1.3B (q4_0 DiT, f16 VAE, no "
        "T5), 1 step, cfg 1"
        + (
            "; as a MoE pair: a second DiT of the same architecture as high_noise_diffusion_model"
            ", one step of each expert (high_noise_steps 1)"
            if args.variant == "moe"
            else ""
        )
        + (
            "; as Wan2.1-I2V-1.3B (img_emb, in_dim 36) with its CLIP vision encoder (OpenCLIP "
            "ViT-H/14, q4_0), an init and an end image of the frame size"
            if args.variant == "i2v"
            else ""
        ),
        "model": name,
        "device": args.device,
        "peak": "nvidia-smi memory.used above its reading before the case"
        if args.device.upper().startswith("CUDA")
        else "the process's peak RSS",
        "threads": 2,
    }
    return gpupeak.finish(doc, rows, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
