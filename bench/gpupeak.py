"""A child process's GPU memory peak, for the memory benchmarks on CUDA (`python bench/X.py`
puts this folder on sys.path, so they import it as `gpupeak`): nvidia-smi's memory.used,
sampled every 50 ms while the child runs, less its reading before. Without nvidia-smi or on
another device, the child runs unsampled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any


def gpu_index(device: str) -> str | None:
    """nvidia-smi's index of a CUDA device name ("CUDA1" -> "1"), None for others. A Vulkan
    device ("Vulkan0") maps to the same index: right on a host with one NVIDIA GPU (where the
    benchmarks run it), not promised on a host with several (Vulkan may order them otherwise)."""
    prefix = next((p for p in ("CUDA", "VULKAN") if device.upper().startswith(p)), None)
    if prefix is None or shutil.which("nvidia-smi") is None:
        return None
    n = int(device[len(prefix) :] or 0)
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    return visible[n] if n < len(visible) else str(n)


def gpu_used_mib(index: str) -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
             "-i", index],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        return int(out.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def sampled(
    cmd: list[str], device: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], int | None]:
    """Run `cmd` (output captured, any exit status); (the finished process, its GPU peak in
    bytes above the reading before, None when `device` is no CUDA device nvidia-smi sees)."""
    index = gpu_index(device)
    base = gpu_used_mib(index) if index is not None else None
    peak = [base or 0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            used = gpu_used_mib(index) if index is not None else None
            if used is not None:
                peak[0] = max(peak[0], used)

    sampler = threading.Thread(target=sample, daemon=True)
    if base is not None:
        sampler.start()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        stop.set()
    return done, (peak[0] - base) * 2**20 if base is not None else None


def run_sampled(cmd: list[str], device: str) -> tuple[str, int | None]:
    """Run `cmd` (check=True); (its stdout, its GPU peak in bytes above the reading before,
    None when `device` is no CUDA device nvidia-smi sees)."""
    done, peak = sampled(cmd, device)
    done.check_returncode()
    return done.stdout, peak


def run_row(cmd: list[str], device: str, failed: dict[str, Any]) -> dict[str, Any]:
    """One memory case: run `cmd` (a child that prints its row as JSON on its last line, with
    `peak_rss` and `estimate`) sampled on `device`. On a GPU the device's peak becomes the
    row's `peak_rss` (the figure the estimate is for there; the host's moves to
    `peak_rss_host`, also kept as `peak_gpu`), with `covered` and `estimate_over_peak`
    recomputed. A child that fails gives `failed` with `"failed": True, "covered": False`,
    its error's tail printed."""
    try:
        stdout, peak_gpu = run_sampled(cmd, device)
    except subprocess.CalledProcessError as exc:
        print(f"{failed}: failed: {(exc.stderr or '')[-800:]}", flush=True)
        return {**failed, "failed": True, "covered": False}
    row = json.loads(stdout.strip().splitlines()[-1])
    if peak_gpu is not None:
        row["peak_rss_host"], row["peak_rss"], row["peak_gpu"] = row["peak_rss"], peak_gpu, peak_gpu
        row["covered"] = row["estimate"] >= peak_gpu
        row["estimate_over_peak"] = round(row["estimate"] / max(1, peak_gpu), 2)
    return row


def finish(doc: dict[str, Any], rows: list[dict[str, Any]], out: str | None) -> int:
    """A memory bench's end: `doc` with its `rows` and whether every estimate covered its
    peak (`all_covered`), written as JSON to `out` when given; the exit status (0: all
    covered)."""
    doc = {**doc, "rows": rows, "all_covered": all(r["covered"] for r in rows)}
    if out:
        Path(out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if doc["all_covered"] else 1
