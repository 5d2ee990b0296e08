"""Peak memory and time of a generation with and without VAE tiling, against our estimates.

Each case runs in a fresh process (load + one generation, the engine's own settings): peak
RSS (VmHWM) and, on a GPU, peak GPU memory polled through NVML every 20 ms from this process
(as bench/gpu_suite measures it: NVML's figure for the child when it lists it, else the
device's used memory over its idle baseline). Each row names the untiled and the tiled
estimate (ModelFacts.estimate) and whether the runtime really tiled (its debug records).

    python bench/vae_tiling.py MODEL_DIR [--sizes 1024 2048 4096] [--steps 1]
        [--device cpu|cuda|vulkan] [--runtime-dir DIR] [--modes off on]
        [--figure BYTES] [--no-check-memory] [--timeout S] [--out FILE.json]

--device picks the runtime as bench/gpu_suite does (SDFARM_BACKEND, SDFARM_RUNTIME_DIR for a
build made elsewhere); cpu hides every GPU. --figure BYTES (e.g. 20GiB) is the demonstration:
the engine reads its host's figures, the compute device's figure (MemAvailable for the CPU)
is capped at BYTES, and each size runs with vae_tiling auto: a size whose untiled estimate
exceeds BYTES while its tiled one fits is generated in tiles, and the row says so (plan,
warning, peak). Without --figure the modes are `off` (untiled) and `on` (tiled).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GiB = 1024**3

CHILD = r"""
import json, sys, time
from dataclasses import replace
from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.errors import EngineError
from sdfarm.native.params import GenerationParams
spec = json.loads(sys.argv[1])
figures = None
if spec["figure"]:
    from sdfarm.native.devices import choose_compute_device
    from sdfarm.native.probe import read_host_figures
    figs = read_host_figures(None)
    cap, compute = spec["figure"], choose_compute_device(figs, spec["device"])
    devices = tuple(replace(d, free=min(d.free, cap), total=min(d.total, cap))
                    if d.name == compute.name else d for d in figs.devices)
    mem = figs.mem_available if compute.type != "cpu" else min(figs.mem_available, cap)
    figures = replace(figs, devices=devices, mem_available=mem)
out = {}
try:
    e = Engine.load(spec["model"], device=spec["device"], figures=figures,
                    check_memory=spec["check"], log=LogConfig(level=spec.get("log_level", "debug")))
    w, h = spec["size"]
    p = GenerationParams(prompt="a lighthouse on a cliff at dusk", width=w, height=h,
                         steps=spec["steps"], seed=42, vae_tiling=spec["mode"])
    out["estimate_untiled"] = e.estimate_for(w, h)
    out["estimate_tiled"] = e.estimate_for(w, h, tiled=True)
    out["device"] = e.capabilities.device
    out["figures"] = e.capabilities.figures
    t = time.monotonic()
    r = e.generate(p)
    out["generate_s"] = time.monotonic() - t
    out["tiled"] = r.metadata["vae_tiled"]
    out["estimate"] = r.metadata["estimate"]
    out["warnings"] = r.metadata["warnings"]
    out["tiles_logged"] = [x.message for x in r.records if "processing" in x.message
                           and "tiles" in x.message]
    import numpy as np  # only now: numpy loaded before the CUDA runtime crashed its load
    px = np.asarray(r.image, dtype=np.float32)
    out["image"] = {"size": list(r.image.size), "std": float(px.std())}
    if spec.get("save"):
        r.image.save(spec["save"])
except EngineError as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["peak_rss"] = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                       if l.startswith("VmHWM"))
print("@@vae_tiling " + json.dumps(out))
"""

BACKENDS = {"cpu": "cpu", "cuda": "cuda", "vulkan": "vulkan"}
GPU_DEVICES = ("cuda", "vulkan")
"""Where the NVML poller reads the peak: NVIDIA's driver reports a Vulkan process's memory too."""


def child_env(device: str, runtime_dir: str | None) -> dict[str, str]:
    """The environment of a child on `device`, as bench/gpu_suite's Runtime.env builds it."""
    env = dict(os.environ)
    env["SDFARM_BACKEND"] = BACKENDS[device]
    env.setdefault("PYTHONUNBUFFERED", "1")
    if runtime_dir:
        env["SDFARM_RUNTIME_DIR"] = str(Path(runtime_dir).resolve())
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["GGML_VK_VISIBLE_DEVICES"] = ""
    return env


def poller(device: str) -> Any:
    """bench/gpu_suite's NVML poller on an NVIDIA GPU (CUDA or Vulkan), else None."""
    if device not in GPU_DEVICES:
        return None
    sys.path.insert(0, str(HERE))
    try:
        from gpu_suite.children import GpuPoller
    finally:
        sys.path.pop(0)
    return GpuPoller()


def measure(spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One case in a fresh process: the child's report plus the GPU peak and wall time."""
    gpu = poller(spec["device_label"])
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    if gpu is not None:
        gpu.start(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err = f"timed out after {timeout:.0f} s; " + err
    finally:
        if gpu is not None:
            gpu.stop()
    lines = [x for x in out.splitlines() if x.startswith("@@vae_tiling ")]
    row: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1]) if lines else {}
    if not lines:
        # An abort's cause comes before its backtrace: keep the lines that say what failed.
        said = [x for x in err.splitlines() if re.search(r"error|abort|assert|fail", x, re.I)]
        row["error"] = f"child exited {proc.returncode} without a result: {err[-1500:]}"
        row["error_lines"] = [x[:300] for x in said[:8]]
    row["wall_s"] = round(time.monotonic() - t0, 3)
    if gpu is not None:
        row["gpu"] = gpu.summary()
        row["gpu_peak"] = row["gpu"].get("peak")
    return row


def parse_bytes(text: str) -> int:
    """`20GiB`, `512MiB` or a number of bytes."""
    units = {"gib": GiB, "mib": 1024**2, "kib": 1024, "gb": 10**9, "mb": 10**6, "b": 1}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * scale)
    return int(low)


def gib(n: Any) -> str:
    return f"{n / GiB:.2f}" if isinstance(n, int | float) else "-"


def table(rows: list[dict[str, Any]], device: str) -> list[str]:
    """Rows per size: the untiled and tiled estimates, each mode's peak (GPU on a GPU, RSS on
    the CPU), time, and whether the runtime tiled."""
    peak_name = "GPU peak" if device in GPU_DEVICES else "peak RSS"
    lines = [
        f"{'size':>10} {'mode':>5} {'est untiled':>11} {'est tiled':>9} {'used est':>8} "
        f"{peak_name:>9} {'peak/est':>8} {'gen s':>7} {'tiled':>5}  note   (GiB)",
    ]
    for r in rows:
        peak = r.get("gpu_peak") if device in GPU_DEVICES else r.get("peak_rss")
        est = r.get("estimate")
        ratio = f"{peak / est:.2f}" if peak and est else "-"
        gen = f"{r['generate_s']:.1f}" if "generate_s" in r else "-"
        note = (r.get("error") or "; ".join(r.get("warnings") or []))[:90]
        tiled = {True: "yes", False: "no"}.get(r.get("tiled"), "-")
        lines.append(
            f"{r['size']:>10} {r['mode']:>5} {gib(r.get('estimate_untiled')):>11} "
            f"{gib(r.get('estimate_tiled')):>9} {gib(est):>8} {gib(peak):>9} {ratio:>8} "
            f"{gen:>7} {tiled:>5}  {note}"
        )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    p.add_argument("--runtime-dir", default=None)
    p.add_argument("--modes", nargs="+", choices=("off", "on", "auto"), default=None)
    p.add_argument("--figure", type=parse_bytes, default=None)
    p.add_argument("--no-check-memory", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--save-images", default=None, help="a folder for the generated PNGs")
    p.add_argument(
        "--log-level",
        default="debug",
        help="the engine's log level in each case (debug: the runtime's tile count is read "
        "from its records)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    modes = args.modes or (["auto"] if args.figure else ["off", "on"])
    env = child_env(args.device, args.runtime_dir)
    engine_device = "cpu" if args.device == "cpu" else "auto"
    rows: list[dict[str, Any]] = []
    doc = {
        "bench": "vae_tiling",
        "model": Path(args.model).name,
        "device": args.device,
        "steps": args.steps,
        "figure": args.figure,
        "machine": f"{platform.machine()} {platform.processor()} {os.cpu_count()} cores".strip(),
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if args.figure:
        print(f"device figure capped at {gib(args.figure)} GiB; vae_tiling {', '.join(modes)}")
    print("\n".join(table([], args.device)), flush=True)
    for size in args.sizes:
        for mode in modes:
            save = None
            if args.save_images:
                Path(args.save_images).mkdir(parents=True, exist_ok=True)
                save = str(Path(args.save_images) / f"{size}-{mode}.png")
            spec = {
                "model": str(args.model), "device": engine_device, "device_label": args.device,
                "size": [size, size], "steps": args.steps, "mode": mode,
                "figure": args.figure, "check": not args.no_check_memory, "save": save,
                "log_level": args.log_level,
            }  # fmt: skip
            row = {"size": f"{size}x{size}", "mode": mode, **measure(spec, env, args.timeout)}
            rows.append(row)
            print(table([row], args.device)[1], flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
