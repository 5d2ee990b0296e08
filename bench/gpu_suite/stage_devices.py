"""Stage devices: `sdfarm devices --json` under each runtime, next to nvidia-smi."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from .analysis import compare_with_smi, fmt_gib, fmt_mib
from .harness import CaseError, Deadline, Runtime, Stage, _ok, _tail, nvidia_smi


def stage_devices(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("devices", args, deadline, runtimes)
    lines = []
    smi = nvidia_smi()
    st.command(
        "nvidia-smi --query-gpu=index,name,memory.total,memory.used,memory.free,"
        "driver_version --format=csv,noheader,nounits"
    )
    st.doc["nvidia_smi"] = smi
    for rt in runtimes:

        def one(rt: Runtime = rt) -> dict[str, Any]:
            env = rt.env()
            cmd = [sys.executable, "-m", "sdfarm.cli.main", "devices", "--json"]
            st.command(cmd, env)
            t = time.perf_counter()
            done = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=deadline.child_timeout(180)
            )
            if done.returncode != 0:
                raise CaseError(f"exit {done.returncode}: {_tail(done.stderr, 1500)}")
            return {
                "runtime": rt.label,
                "report": json.loads(done.stdout),
                "seconds_probe": round(time.perf_counter() - t, 3),
            }

        row = st.case(f"sdfarm devices ({rt.label})", one)
        if _ok(row):
            rep = row["report"]
            for d in rep["devices"]:
                lines.append(
                    f"{rt.label:<7} {d['name']:<8} {d['type']:<5} free {fmt_mib(d['free']):>7} "
                    f"MiB of {fmt_mib(d['total']):>7} MiB  figure {fmt_mib(d.get('figure')):>7}"
                    f" MiB  {d['description']}"
                )
            lines.append(
                f"{rt.label:<7} MemAvailable {fmt_gib(rep.get('mem_available'))} GiB;"
                f" auto -> {rep['choice']['auto']}, backend {rep['backend']}"
            )
    st.doc["summary"] = compare_with_smi(
        {c["runtime"]: c["report"] for c in st.doc["cases"] if c.get("ok")}, smi
    )
    for label, rows in st.doc["summary"].items():
        for r in rows:
            lines.append(
                f"{label:<7} {r['name']:<8} vs nvidia-smi GPU{r['smi_index']}: free "
                f"{r['free_diff_mib']:+d} MiB, total {r['total_diff_mib']:+d} MiB"
            )
    if isinstance(smi, list):
        for g in smi:
            lines.append(
                f"nvidia-smi GPU{g['index']} {g['name']}: used {g['used_mib']} MiB, "
                f"free {g['free_mib']} MiB of {g['total_mib']} MiB (driver "
                f"{g['driver']})"
            )
    else:
        lines.append(f"nvidia-smi: {smi}")
    st.finish(lines)
