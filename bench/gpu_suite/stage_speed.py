"""Stage speed: per (size, steps), our `sdfarm generate --in-process` against the runtime's own
sd-cli on the same inputs, alternated; our engine loaded without warm-up; a steady loop; and
optionally one call of N images per fresh process on each side."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .analysis import (
    child_status,
    fmt_s,
    median,
    parse_generate_seconds,
    parse_ints,
    parse_phase_seconds,
    parse_sizes,
    per_second,
    ratio,
    size_label,
    speed_cases,
    within,
)
from .children import PROMPT, SEED, gens_spec, run_child
from .harness import CaseError, Deadline, Runtime, Stage, _tail

ROLE_FLAGS = {
    "checkpoint": "--model",
    "diffusion_model": "--diffusion-model",
    "clip_l": "--clip_l",
    "clip_g": "--clip_g",
    "t5xxl": "--t5xxl",
    "llm": "--llm",
    "vae": "--vae",
    "taesd": "--taesd",
}


def sd_cli_command(
    cli: str,
    files: dict[str, str],
    width: int,
    height: int,
    steps: int,
    seed: int,
    prompt: str,
    threads: int,
    output: str,
    batch_count: int = 1,
) -> list[str]:
    """sd-cli with the inputs and settings of our engine: the model's files by role, cfg 1,
    flash attention in the diffusion model, direct VAE convolution unless TAESD decodes."""
    cmd = [cli]
    for role, path in files.items():
        cmd += [ROLE_FLAGS[role], path]
    cmd += ["-p", prompt, "-W", str(width), "-H", str(height), "--steps", str(steps)]
    cmd += ["--seed", str(seed), "--cfg-scale", "1.0", "-t", str(threads), "--diffusion-fa"]
    from sdfarm.native.estimate import use_vae_conv_direct

    device = "CUDA0" if os.environ.get("SDFARM_SUITE_BACKEND") == "cuda" else "other"
    # sd-cli decodes with the TAESD whenever it is given one (--taesd without
    # --taesd-preview-only).
    if use_vae_conv_direct("taesd" if "taesd" in files else "vae", device):
        cmd.append("--vae-conv-direct")
    if batch_count != 1:
        cmd += ["--batch-count", str(batch_count)]
    return cmd + ["-o", output, "-v"]


def pixel_diff(a: Path, b: Path) -> int | None:
    """The largest channel difference between two images (None when one is missing or the
    sizes differ)."""
    if not (Path(a).exists() and Path(b).exists()):
        return None
    from PIL import Image, ImageChops

    with Image.open(a) as ia, Image.open(b) as ib:
        x, y = ia.convert("RGB"), ib.convert("RGB")
        if x.size != y.size:
            return None
        return max(hi for _, hi in ImageChops.difference(x, y).getextrema())


def model_files(model: str) -> dict[str, str]:
    from sdfarm.native.model import Model

    m = Model.from_dir(Path(model))
    return {role: str(mf.path) for role, mf in m.files.items()}


def ours_cli_run(
    rt: Runtime, model: str, w: int, h: int, steps: int, out: Path, st: Stage, timeout: float
) -> dict[str, Any]:
    env = rt.env()
    cmd = [
        sys.executable,
        "-m",
        "sdfarm.cli.main",
        "generate",
        "--in-process",
        "--model",
        model,
        "--width",
        str(w),
        "--height",
        str(h),
        "--steps",
        str(steps),
        "--seed",
        str(SEED),
        "--cfg-scale",
        "1.0",
        "--device",
        rt.device,
        "--log-level",
        "info",
        "--json",
        "-o",
        str(out),
        PROMPT,
    ]
    st.command(cmd, env)
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - t
    try:
        doc = json.loads(done.stdout)
    except ValueError as e:
        raise CaseError(f"ours exit {done.returncode}, no JSON: {_tail(done.stderr)}") from e
    if done.returncode != 0 or "error" in doc:
        raise CaseError(f"ours exit {done.returncode}: {doc.get('error')}")
    text = "\n".join(r.get("message", "") for r in doc.get("records", []))
    return {
        "generate_s": doc["timings"]["generate_s"],
        "load_s": doc["timings"].get("load_s"),
        "runtime_s": parse_generate_seconds(text),
        "phases": parse_phase_seconds(text),
        "wall_s": round(wall, 4),
        "device": doc.get("device"),
    }


def theirs_cli_run(
    rt: Runtime,
    cli: str,
    files: dict[str, str],
    w: int,
    h: int,
    steps: int,
    out: Path,
    st: Stage,
    timeout: float,
    batch_count: int = 1,
) -> dict[str, Any]:
    env = rt.env()
    # The build folder that sd-cli's rpath named is gone: it finds the library beside it.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(Path(cli).resolve().parent), env.get("LD_LIBRARY_PATH", "")) if p
    )
    cmd = sd_cli_command(
        cli, files, w, h, steps, SEED, PROMPT, os.cpu_count() or 1, str(out), batch_count
    )
    st.command(cmd, env)
    t = time.perf_counter()
    done = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout
    )
    wall = time.perf_counter() - t
    gen = parse_generate_seconds(done.stdout)
    if done.returncode != 0 or gen is None:
        raise CaseError(
            f"sd-cli exit {done.returncode}, generate time "
            f"{'missing' if gen is None else gen}: {_tail(done.stdout)}"
        )
    return {"generate_s": gen, "phases": parse_phase_seconds(done.stdout), "wall_s": round(wall, 4)}


def stage_speed(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("speed", args, deadline, runtimes)
    rt = runtimes[0]
    cases = speed_cases(parse_sizes(args.sizes), parse_ints(args.steps))
    cli = args.cli if args.cli and Path(args.cli).exists() else None
    if args.cli and not cli:
        st.doc["errors"].append({"case": "sd-cli", "error": f"{args.cli} does not exist"})
    if not cli:
        st.skip("sd-cli runs", "no --cli given" if not args.cli else f"{args.cli} not found")
    files = model_files(args.model) if cli else {}
    work = Path(tempfile.mkdtemp(prefix="gpu-suite-speed-", dir=args.work_dir))
    data: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        # Steady state first (images/s matter most): one load, one untimed generation,
        # then --steady (default max(runs, 3)) timed ones.
        for w, h, steps in cases:
            label = size_label(w, h, steps)

            def steady(
                w: int = w, h: int = h, steps: int = steps, label: str = label
            ) -> dict[str, Any]:
                spec = {
                    "model": args.model,
                    "device": rt.device,
                    "log_level": "info",
                    "gens": gens_spec(1 + (args.steady or max(args.runs, 3)), w, h, steps),
                }
                env = rt.env()
                st.child_command(spec, env)
                res = run_child(spec, env, deadline.child_timeout(args.case_timeout))
                g = [x for x in (res.get("gens") or [])[1:] if "generate_s" in x]
                if res.get("error") or not g:
                    raise CaseError(
                        str(res.get("error") or res.get("gens") or "no generation")
                        + f" (exit {res.get('returncode')}: {res.get('stderr_tail', '')[-800:]})"
                    )
                med = median(x["generate_s"] for x in g)
                r = {
                    "generate_s": [x["generate_s"] for x in g],
                    "runtime_s": [x.get("runtime_s") for x in g],
                    "median_s": med,
                    "images_per_s": per_second(1, med),
                    **child_status(res),
                }
                data.setdefault(label, {})["steady"] = [r]
                return {"size": label, **r}

            st.case(f"{label} steady", steady)
        # Alternated fresh processes: ours, sd-cli, (ours without warm-up); order flips.
        for run in range(args.runs):
            for w, h, steps in cases:
                label = size_label(w, h, steps)
                order = ["ours", "theirs"] if run % 2 == 0 else ["theirs", "ours"]
                if not cli:
                    order = ["ours"]
                if not args.no_nowarm and rt.label != "cpu":
                    order.append("ours-nowarm")
                if args.speed_batch > 1 and cli:
                    # Like for like without a first-image lottery: one generate call of
                    # speed_batch images in a fresh process each side (no warm-up on ours).
                    order += (
                        ["ours-batch", "theirs-batch"]
                        if run % 2 == 0
                        else ["theirs-batch", "ours-batch"]
                    )
                for who in order:

                    def one(
                        who: str = who,
                        w: int = w,
                        h: int = h,
                        steps: int = steps,
                        label: str = label,
                        run: int = run,
                    ) -> dict[str, Any]:
                        out = work / f"{who}-{w}x{h}-{steps}.png"
                        tmo = deadline.child_timeout(args.case_timeout)
                        if who == "ours":
                            r = ours_cli_run(rt, args.model, w, h, steps, out, st, tmo)
                        elif who == "theirs":
                            assert cli is not None
                            r = theirs_cli_run(rt, cli, files, w, h, steps, out, st, tmo)
                        elif who == "theirs-batch":
                            assert cli is not None
                            r = theirs_cli_run(
                                rt, cli, files, w, h, steps, out, st, tmo, args.speed_batch
                            )
                        else:
                            bc = args.speed_batch if who == "ours-batch" else 1
                            spec = {
                                "model": args.model,
                                "device": rt.device,
                                "warm_up": False,
                                "log_level": "info",
                                "gens": gens_spec(1, w, h, steps, batch_count=bc),
                            }
                            env = rt.env()
                            st.child_command(spec, env)
                            res = run_child(spec, env, tmo)
                            g = (res.get("gens") or [{}])[0]
                            if res.get("error") or g.get("error") or "generate_s" not in g:
                                raise CaseError(str(res.get("error") or g.get("error")))
                            r = {
                                "generate_s": g["generate_s"],
                                "runtime_s": g.get("runtime_s"),
                                "load_s": res.get("load_s"),
                                "wall_s": res["process_wall_s"],
                                **child_status(res),
                            }
                        if who in ("ours", "theirs"):
                            other = (
                                work
                                / f"{'theirs' if who == 'ours' else 'ours'}-{w}x{h}-{steps}.png"
                            )
                            r["pixel_diff_vs_other"] = pixel_diff(out, other)
                        data.setdefault(label, {}).setdefault(who, []).append(r)
                        return {"who": who, "size": label, "run": run, **r}

                    st.case(f"{label} {who} run {run + 1}", one)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = [
        f"{rt.label}: medians (s); ratio = ours / sd-cli; target generate ratio <= 1.02",
        f"{'case':<17} {'ours gen':>9} {'rt log':>7} {'cli gen':>8} {'ratio':>6} {'ok':>3} "
        f"{'nowarm':>7} {'ratio':>6} {'ours wall':>9} {'cli wall':>9} {'ratio':>6} "
        f"{'img/s':>7} {'px':>3}",
    ]
    summary = {}
    for label, d in data.items():
        og = median(r["generate_s"] for r in d.get("ours", []))
        ort = median(r.get("runtime_s") for r in d.get("ours", []))
        tg = median(r["generate_s"] for r in d.get("theirs", []))
        ng = median(r["generate_s"] for r in d.get("ours-nowarm", []))
        ow = median(r["wall_s"] for r in d.get("ours", []))
        tw = median(r["wall_s"] for r in d.get("theirs", []))
        steady = (d.get("steady") or [{}])[0]
        ob = median(r["generate_s"] for r in d.get("ours-batch", []))
        tb = median(r["generate_s"] for r in d.get("theirs-batch", []))
        s = {
            "runs": {k: len(v) for k, v in d.items()},
            "ours_generate_s": og,
            "ours_runtime_log_s": ort,
            "theirs_generate_s": tg,
            "ratio_generate": ratio(og, tg),
            "within_2pct": within(ratio(og, tg), 0.02),
            "ours_nowarm_generate_s": ng,
            "ratio_nowarm": ratio(ng, tg),
            "within_2pct_nowarm": within(ratio(ng, tg), 0.02),
            "ours_wall_s": ow,
            "theirs_wall_s": tw,
            "ratio_wall": ratio(ow, tw),
            "speed_batch": args.speed_batch if ob is not None else None,
            "ours_batch_generate_s": ob,
            "theirs_batch_generate_s": tb,
            "ratio_batch": ratio(ob, tb),
            "within_2pct_batch": within(ratio(ob, tb), 0.02),
            "steady_median_s": steady.get("median_s"),
            "images_per_s": steady.get("images_per_s"),
            # Same inputs, same pixels? Max channel difference of ours against sd-cli's PNG.
            "pixel_diff_max": max(
                (
                    r["pixel_diff_vs_other"]
                    for r in d.get("ours", []) + d.get("theirs", [])
                    if r.get("pixel_diff_vs_other") is not None
                ),
                default=None,
            ),
        }
        summary[label] = s
        ok = s["within_2pct"]
        lines.append(
            f"{label:<17} {fmt_s(og):>9} {fmt_s(ort, 2):>7} {fmt_s(tg, 2):>8} "
            f"{fmt_s(s['ratio_generate']):>6} {'-' if ok is None else ('yes' if ok else 'NO'):>3} "
            f"{fmt_s(ng):>7} {fmt_s(s['ratio_nowarm']):>6} {fmt_s(ow, 2):>9} "
            f"{fmt_s(tw, 2):>9} {fmt_s(s['ratio_wall']):>6} {fmt_s(s['images_per_s'], 2):>7} "
            f"{'-' if s['pixel_diff_max'] is None else s['pixel_diff_max']:>3}"
        )
    for label, s in summary.items():
        if s["ratio_batch"] is not None:
            lines.append(
                f"{label}: one call of {s['speed_batch']} images in a fresh process: ours "
                f"{fmt_s(s['ours_batch_generate_s'])} s, "
                f"sd-cli {fmt_s(s['theirs_batch_generate_s'])} s, "
                f"ratio {fmt_s(s['ratio_batch'])} "
                f"({'within' if s['within_2pct_batch'] else 'NOT within'} 2%)"
            )
    lines.append(
        "rt log: the runtime's own generate_image time inside our process; nowarm: our engine "
        "loaded without warm-up (first generation, as sd-cli's); px: max pixel difference"
    )
    st.doc["summary"] = summary
    st.finish(lines)
