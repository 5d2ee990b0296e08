"""Stage memory: per model and size, the estimate, peak RSS (VmHWM) and peak GPU memory (NVML,
polled from the suite's process every 20 ms)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .analysis import above_estimate, child_status, fmt_gib, fmt_s, parse_sizes
from .children import gens_spec, run_child
from .harness import Deadline, Runtime, Stage


def stage_memory(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("memory", args, deadline, runtimes)
    rt = runtimes[0]
    models = [m for m in (args.model, args.taesd_model) if m]
    rows = []
    for model in models:
        for w, h in parse_sizes(args.sizes):
            name = f"{Path(model).name} {w}x{h}"

            def one(model: str = model, w: int = w, h: int = h, name: str = name) -> dict[str, Any]:
                spec = {
                    "model": model,
                    "device": rt.device,
                    "log_level": "none",
                    "gens": gens_spec(1, w, h, 1),
                    # The TAESD model decodes with its TAESD (a job's decoder; its own
                    # decoder is the checkpoint's VAE: sdfarm.native.decoders).
                    "decoder": "taesd" if model == args.taesd_model else "default",
                }
                env = rt.env()
                st.child_command(spec, env)
                res = run_child(spec, env, deadline.child_timeout(args.case_timeout), gpu=True)
                g = (res.get("gens") or [{}])[0]
                gpu = res.get("gpu") or {}
                caps = res.get("capabilities") or {}
                row = {
                    "case": name,
                    "model": Path(model).name,
                    "size": f"{w}x{h}",
                    "estimate": g.get("estimate"),
                    "native_estimate": caps.get("estimate"),
                    "peak_rss": res.get("peak_rss"),
                    "gpu_peak": gpu.get("peak"),
                    "gpu_peak_process": gpu.get("peak_process"),
                    "gpu_peak_device_delta": gpu.get("peak_used_delta"),
                    "gpu_per_process": gpu.get("per_process"),
                    "gpu": gpu,
                    "generate_s": g.get("generate_s"),
                    "device": caps.get("device"),
                    "fit_plan": caps.get("fit_plan"),
                    "error": res.get("error") or g.get("error"),
                    **child_status(res),
                }
                rows.append(row)
                return row

            st.case(name, one)
    over = above_estimate(rows, ("peak_rss", "gpu_peak", "gpu_peak_device_delta"))
    st.doc["summary"] = {
        "above_estimate": over,
        "max_gpu_ratio": max(
            (
                r["gpu_peak"] / r["estimate"]
                for r in rows
                if r.get("gpu_peak") and r.get("estimate")
            ),
            default=None,
        ),
        "max_rss_ratio": max(
            (
                r["peak_rss"] / r["estimate"]
                for r in rows
                if r.get("peak_rss") and r.get("estimate")
            ),
            default=None,
        ),
    }
    lines = [
        f"{rt.label}: GiB; GPU = NVML per process when listed (*), else device delta",
        f"{'case':<34} {'estimate':>8} {'peak RSS':>8} {'GPU peak':>9} {'dev delta':>9} "
        f"{'gen s':>6}",
    ]
    for r in rows:
        star = "*" if r.get("gpu_per_process") else " "
        lines.append(
            f"{r['case']:<34} {fmt_gib(r['estimate']):>8} {fmt_gib(r['peak_rss']):>8} "
            f"{fmt_gib(r['gpu_peak']):>8}{star} {fmt_gib(r['gpu_peak_device_delta']):>9}"
            f" {fmt_s(r['generate_s'], 2):>6}" + (" ERROR" if r.get("error") else "")
        )
    if over:
        for o in over:
            lines.append(
                f"ABOVE ESTIMATE: {o['case']} {o['measure']} {fmt_gib(o['value'])} GiB "
                f"> {fmt_gib(o['estimate'])} GiB ({o['ratio']:.2f}x)"
            )
    else:
        lines.append("no case above its estimate" if rows else "no case measured")
    if rows and not any((r.get("gpu") or {}).get("available") for r in rows):
        lines.append(f"GPU polling unavailable: {(rows[0].get('gpu') or {}).get('reason')}")
    st.finish(lines)
