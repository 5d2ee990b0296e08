"""Stage rules: another process (torch) holds most of the GPU; the figures under each runtime,
the full-size model's load (its one warn record and the fit plan), a sparse huge model's
refusal, then the over-budget case (the GPU held to the last MiB)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .analysis import (
    _plan_text,
    fmt_gib,
    fmt_mib,
    fmt_s,
    huge_apparent_bytes,
    load_summary,
    parse_sizes,
    rules_summary,
)
from .children import gens_spec, run_child
from .harness import REPO, CaseError, Deadline, Runtime, Stage, _ok, _tail, meminfo
from .holder import Holder, holder_available


def probe_figures(rt: Runtime, st: Stage, timeout: float = 120.0) -> dict[str, Any]:
    """`python -m sdfarm.native.probe` under `rt`: the figures, each GPU's rule figure."""
    from sdfarm.native.devices import gpu_figure
    from sdfarm.native.probe import figures_from_json

    env = rt.env()
    cmd = [sys.executable, "-m", "sdfarm.native.probe"]
    st.command(cmd, env)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise CaseError(f"probe exit {done.returncode}: {_tail(done.stderr, 1500)}")
    doc = json.loads(done.stdout)
    figs = figures_from_json(doc)
    gpus = [
        {
            "name": d.name,
            "description": d.description,
            "type": d.type,
            "free": d.free,
            "total": d.total,
            "figure": gpu_figure(d),
        }
        for d in figs.devices
        if d.type != "cpu"
    ]
    return {"runtime": rt.label, "figures": doc, "gpus": gpus, "mem_available": figs.mem_available}


def load_case(
    rt: Runtime,
    model: str,
    st: Stage,
    deadline: Deadline,
    gens: list[dict],
    log_level: str = "warn",
    limit: float = 240.0,
) -> dict[str, Any]:
    """Load `model` under `rt` in a child (memory check on) and summarise the verdict."""
    spec = {"model": model, "device": rt.device, "log_level": log_level, "gens": gens}
    env = rt.env()
    st.child_command(spec, env)
    res = run_child(spec, env, deadline.child_timeout(limit), gpu=True)
    return load_summary(res, rt.label)


def stage_rules(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("rules", args, deadline, runtimes)
    main = runtimes[0]
    lines: list[str] = []
    w, h = parse_sizes(args.sizes)[0]
    gen = gens_spec(1, w, h, 1)

    def fig_line(tag: str, row: dict[str, Any] | None) -> None:
        if not _ok(row):
            lines.append(f"{tag:<28} {row.get('error') if row else 'skipped'}")
            return
        for g in row["gpus"]:
            lines.append(
                f"{tag:<28} {row['runtime']:<6} {g['name']:<8} free "
                f"{fmt_mib(g['free']):>7} of {fmt_mib(g['total']):>7} MiB -> figure "
                f"{fmt_mib(g['figure']):>7} MiB"
            )
        if not row["gpus"]:
            lines.append(
                f"{tag:<28} {row['runtime']:<6} no GPU listed; MemAvailable "
                f"{fmt_gib(row['mem_available'])} GiB"
            )

    def load_line(tag: str, row: dict[str, Any] | None) -> None:
        if not _ok(row):
            lines.append(f"{tag:<28} {row.get('error') if row else 'skipped'}")
            return
        if row.get("error"):
            e = row["error"]
            lines.append(f"{tag:<28} {row['runtime']:<6} {e['type']}: {e['message'][:160]}")
            return
        fp = row.get("fit_plan") or {}
        g = (row.get("gens") or [{}])[0]
        lines.append(
            f"{tag:<28} {row['runtime']:<6} check {row['memory_check']}, {row['warn_records']} "
            f"warn record(s), fit: {fp.get('summary') or _plan_text(fp)}; gen "
            f"{fmt_s(g.get('generate_s'))} s"
            + (f" ERROR {g['error']['message'][:80]}" if g.get("error") else "")
        )

    baseline: dict[str, dict[str, Any]] = {}
    for rt in runtimes:
        row = st.case(f"figures idle ({rt.label})", lambda rt=rt: probe_figures(rt, st))
        fig_line("idle", row)
        if _ok(row):
            baseline[rt.label] = row

    reason = holder_available(args.holder_python)
    st.doc["holder"] = {"python": args.holder_python, "unavailable": reason}
    holder: Holder | None = None
    if reason is None:
        row = st.case(
            "hold most of the GPU",
            lambda: {"holder": _start_holder(args, st, args.hold_gib, args.hold_leave_gib)},
        )
        holder = _HOLDERS.pop() if _ok(row) else None
        if holder is not None:
            lines.append(
                f"holder: {fmt_gib(holder.info.get('held'))} GiB held, CUDA free after "
                f"{fmt_mib(holder.info.get('free_after'))} MiB"
            )
    else:
        st.skip("hold most of the GPU", f"no holder: {reason}")
    tag = "held" if holder else "not held"
    try:
        for rt in runtimes:
            row = st.case(f"figures {tag} ({rt.label})", lambda rt=rt: probe_figures(rt, st))
            fig_line(tag, row)
            if _ok(row) and holder and rt.label in baseline:
                for g0, g1 in zip(baseline[rt.label]["gpus"], row["gpus"], strict=False):
                    row.setdefault("figure_drop", {})[g1["name"]] = (
                        None
                        if g0["figure"] is None or g1["figure"] is None
                        else g0["figure"] - g1["figure"]
                    )
                st.save()
        for rt in runtimes:
            row = st.case(
                f"load full-size, {tag} ({rt.label})",
                lambda rt=rt: load_case(rt, args.model, st, deadline, gen),
            )
            load_line(f"load {tag}", row)
        row = st.case(
            f"huge model refused, {tag} ({main.label})",
            lambda: _huge_case(args, main, st, deadline, baseline),
        )
        if _ok(row):
            e = row.get("error") or {}
            lines.append(
                f"huge model ({fmt_gib(row['apparent'])} GiB file): "
                f"{e.get('type', 'LOADED?!')}: {e.get('message', '')[:300]}"
            )
    finally:
        if holder is not None:
            holder.stop()

    if reason is not None:
        st.skip("over budget (free 0)", f"no holder: {reason}")
    else:
        row = st.case(
            "hold nearly all of the GPU", lambda: {"holder": _start_holder(args, st, 0.0, 0.0)}
        )
        holder = _HOLDERS.pop() if _ok(row) else None
        try:
            if holder is not None:
                lines.append(
                    f"holder (all): {fmt_gib(holder.info.get('held'))} GiB held, "
                    f"CUDA free after {fmt_mib(holder.info.get('free_after'))} MiB"
                )
                provoked = []
                for rt in runtimes:
                    row = st.case(
                        f"figures full ({rt.label})",
                        lambda rt=rt: probe_figures(rt, st, timeout=90),
                    )
                    fig_line("full", row)
                    if _ok(row):
                        provoked += [
                            f"{rt.label}:{g['name']}"
                            for g in row["gpus"]
                            if g["total"] > 0 and g["free"] <= 0
                        ]
                st.doc["summary"]["free0_provoked"] = provoked
                lines.append(f"free 0 against a positive total: {provoked or 'not provoked'}")
                for rt in runtimes:
                    row = st.case(
                        f"load full-size, full ({rt.label})",
                        lambda rt=rt: load_case(rt, args.model, st, deadline, gen, limit=180),
                    )
                    load_line("load full", row)
        finally:
            if holder is not None:
                holder.stop()
    st.doc["summary"].update(rules_summary(st.doc["cases"]))
    st.finish(lines)


_HOLDERS: list[Holder] = []


def _start_holder(args: argparse.Namespace, st: Stage, hold: float, leave: float) -> dict:
    h = Holder(args.holder_python, hold, leave, st)
    _HOLDERS.append(h)
    return h.info


def _huge_case(
    args: argparse.Namespace,
    rt: Runtime,
    st: Stage,
    deadline: Deadline,
    baseline: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The tiny model with one sparse tensor of `huge_apparent_bytes`: must be refused."""
    spec_mod = importlib.util.spec_from_file_location(
        "gpu_suite_badmodels", REPO / "tests" / "helpers" / "badmodels.py"
    )
    assert spec_mod is not None and spec_mod.loader is not None
    badmodels = importlib.util.module_from_spec(spec_mod)
    spec_mod.loader.exec_module(badmodels)
    from sdfarm.native.testmodel import make_test_model

    base = baseline.get(rt.label) or next(iter(baseline.values()), None)
    totals = [g["total"] for g in base["gpus"] if g["type"] == "gpu"] if base else []
    apparent = huge_apparent_bytes(totals, meminfo("MemAvailable"))
    work = Path(tempfile.mkdtemp(prefix="gpu-suite-huge-", dir=args.work_dir))
    try:
        tiny = make_test_model(work / "tiny")[0]
        huge = badmodels.make_sparse_huge_model(tiny, work / "huge-sparse", apparent)
        res = load_case(rt, str(huge), st, deadline, [], limit=120)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["apparent"] = apparent
    res["refused"] = bool(res.get("error")) and res["error"].get("type") == "ModelTooLargeError"
    return res
