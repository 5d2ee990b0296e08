"""A child process's GPU memory peak, for the memory benchmarks on CUDA (`python bench/X.py`
puts this folder on sys.path, so they import it as `gpupeak`): nvidia-smi's memory.used,
sampled every 50 ms while the child runs, less its reading before. Without nvidia-smi or on
another device, the child runs unsampled."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading


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


def run_sampled(cmd: list[str], device: str) -> tuple[str, int | None]:
    """Run `cmd` (check=True); (its stdout, its GPU peak in bytes above the reading before,
    None when `device` is no CUDA device nvidia-smi sees)."""
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
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        stop.set()
    return out.stdout, (peak[0] - base) * 2**20 if base is not None else None
