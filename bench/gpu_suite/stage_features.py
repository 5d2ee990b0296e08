"""Stage features: peak memory against the estimate for what a job can ask beyond text to
image (img2img, inpainting, the hires pass), each case in its own child process (one engine,
one generation) with GPU memory polled as in stage memory, so every new part of the job
schema has its row in the table of peak against estimate."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .analysis import above_estimate, child_status, fmt_gib, fmt_s, parse_sizes
from .children import run_child
from .harness import Deadline, Runtime, Stage

CASES: dict[str, tuple[int, dict[str, Any]]] = {
    # name: (steps, further job fields; "noise"/"half" are made in the child: children.job_extras)
    "txt2img": (4, {}),
    "img2img": (4, {"init_image": "noise", "strength": 0.75}),
    "inpaint": (4, {"init_image": "noise", "mask_image": "half", "strength": 1.0}),
    "hires x1.5": (1, {"hires_scale": 1.5, "hires_steps": 2, "hires_strength": 0.5}),
}


def stage_features(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("features", args, deadline, runtimes)
    rt = runtimes[0]
    rows: list[dict[str, Any]] = []
    for w, h in parse_sizes(args.sizes):
        for feature, (steps, extra) in CASES.items():
            name = f"{feature} {w}x{h}"

            def one(
                w: int = w, h: int = h, feature: str = feature, steps: int = steps,
                extra: dict[str, Any] = extra, name: str = name,
            ) -> dict[str, Any]:  # fmt: skip
                gen = {"width": w, "height": h, "steps": steps, "params": extra}
                spec = {"model": args.model, "device": rt.device, "log_level": "none",
                        "gens": [gen]}  # fmt: skip
                env = rt.env()
                st.child_command(spec, env)
                res = run_child(spec, env, deadline.child_timeout(args.case_timeout), gpu=True)
                g = (res.get("gens") or [{}])[0]
                gpu = res.get("gpu") or {}
                row = {
                    "case": name,
                    "feature": feature,
                    "size": f"{w}x{h}",
                    "params": extra,
                    "estimate": g.get("estimate"),
                    "peak_rss": res.get("peak_rss"),
                    "gpu_peak": gpu.get("peak"),
                    "gpu_peak_device_delta": gpu.get("peak_used_delta"),
                    "generate_s": g.get("generate_s"),
                    "warnings": g.get("warnings"),
                    "error": res.get("error") or g.get("error"),
                    **child_status(res),
                }
                rows.append(row)
                return row

            st.case(name, one)
    over = above_estimate(rows, ("peak_rss", "gpu_peak", "gpu_peak_device_delta"))
    st.doc["summary"] = {"above_estimate": over}
    lines = [f"{rt.label} ({Path(args.model).name}): GiB", "case | estimate | GPU peak | RSS | s"]
    for r in rows:
        lines.append(
            f"{r['case']} | {fmt_gib(r['estimate'])} | {fmt_gib(r['gpu_peak'])} | "
            f"{fmt_gib(r['peak_rss'])} | {fmt_s(r['generate_s'], 2)}"
            + (f" | ERROR {r['error']}" if r.get("error") else "")
        )
    for o in over:
        lines.append(
            f"ABOVE ESTIMATE: {o['case']} {o['measure']} {fmt_gib(o['value'])} GiB "
            f"> {fmt_gib(o['estimate'])} GiB ({o['ratio']:.2f}x)"
        )
    st.finish(lines)
