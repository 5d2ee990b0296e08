"""Stage warmup: the first and second generation after a load, with and without the engine's
warm-up (Vulkan also with an empty driver pipeline cache)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from typing import Any

from .analysis import child_status, fmt_s, median, parse_sizes, size_label
from .children import gens_spec, run_child
from .harness import Deadline, Runtime, Stage, _ok


def stage_warmup(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("warmup", args, deadline, runtimes)
    rt = runtimes[0]
    w, h = parse_sizes(args.sizes)[0]
    variants = [
        (wu, cache)
        for wu in (True, False)
        for cache in (("default", "cold") if rt.label == "vulkan" else ("default",))
    ]
    rows: dict[str, list[dict[str, Any]]] = {}
    for run in range(args.runs):
        for wu, cache in variants:
            name = f"warm_up={'on' if wu else 'off'} cache={cache}"

            def one(wu: bool = wu, cache: str = cache, run: int = run) -> dict[str, Any]:
                env = rt.env()
                tmp = None
                if cache == "cold":
                    tmp = tempfile.mkdtemp(prefix="gpu-suite-glcache-", dir=args.work_dir)
                    env["__GL_SHADER_DISK_CACHE_PATH"] = tmp
                    env["__GL_SHADER_DISK_CACHE_SKIP_CLEANUP"] = "1"
                spec = {
                    "model": args.model,
                    "device": rt.device,
                    "warm_up": wu,
                    "log_level": "none",
                    "gens": gens_spec(2, w, h, 1),
                }
                st.child_command(spec, env)
                try:
                    res = run_child(spec, env, deadline.child_timeout(240))
                finally:
                    if tmp:
                        shutil.rmtree(tmp, ignore_errors=True)
                g = res.get("gens") or []
                return {
                    "warm_up": wu,
                    "cache": cache,
                    "run": run,
                    "load_s": res.get("load_s"),
                    "warmup_s": res.get("warmup_s"),
                    "first_s": g[0].get("generate_s") if g else None,
                    "second_s": g[1].get("generate_s") if len(g) > 1 else None,
                    "process_wall_s": res.get("process_wall_s"),
                    "error": res.get("error"),
                    "gen_errors": [x["error"] for x in g if x.get("error")],
                    **child_status(res),
                }

            row = st.case(f"{name} run {run + 1}", one)
            if _ok(row):
                rows.setdefault(name, []).append(row)
    lines = [
        f"{rt.label}, {size_label(w, h, 1)}, medians over runs (seconds)",
        f"{'variant':<28} {'load':>7} {'warm-up':>8} {'1st gen':>8} {'2nd gen':>8} {'process':>8}",
    ]
    summary = {}
    for name, rs in rows.items():
        m = {
            k: median(r.get(k) for r in rs)
            for k in ("load_s", "warmup_s", "first_s", "second_s", "process_wall_s")
        }
        summary[name] = m | {"runs": len(rs)}
        lines.append(
            f"{name:<28} {fmt_s(m['load_s']):>7} {fmt_s(m['warmup_s']):>8} "
            f"{fmt_s(m['first_s']):>8} {fmt_s(m['second_s']):>8} "
            f"{fmt_s(m['process_wall_s'], 2):>8}"
        )
    st.doc["summary"] = summary
    st.finish(lines)
