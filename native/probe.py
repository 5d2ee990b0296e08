"""Read this host's device figures in a short-lived subprocess.

The first ggml device query initialises the GPU driver in the calling process, and a process
that will fork (a Celery worker's parent) must never do that; so figures are read by running
`python -m sdfarm.native.probe`, which prints one JSON document and exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

from sdfarm.native.devices import DEVICE_TYPES, Device, HostFigures

DEVICE_ENV = ("SD_VK_DEVICE", "GGML_VK_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def mem_available() -> int | None:
    """MemAvailable on Linux (what the kernel says can be allocated without swapping);
    psutil's `available` elsewhere; None when neither tells."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no figure is a valid answer
        return None


def os_name() -> str:
    return {"win32": "windows", "darwin": "darwin"}.get(sys.platform, "linux")


def read_devices_here(backend: str | None = None) -> list[Device]:
    """ggml's devices as this process sees them (initialises the runtime: probe only)."""
    from sdfarm.native.binding import load

    ffi, lib = load(backend)
    name = ffi.new("char[]", 256)
    desc = ffi.new("char[]", 512)
    typ = ffi.new("int*")
    free = ffi.new("size_t*")
    total = ffi.new("size_t*")
    out = []
    for i in range(lib.sdf_device_count()):
        if lib.sdf_device_info(i, name, 256, desc, 512, typ, free, total) != 0:
            continue
        out.append(
            Device(
                i,
                ffi.string(name).decode(),
                ffi.string(desc).decode(),
                DEVICE_TYPES.get(typ[0], "accel"),
                int(free[0]),
                int(total[0]),
            )
        )
    return out


def figures_from_json(doc: dict) -> HostFigures:
    return HostFigures(
        devices=tuple(Device(**d) for d in doc["devices"]),
        mem_available=doc.get("mem_available"),
        os=doc.get("os", "linux"),
        env=dict(doc.get("env", {})),
    )


def figures_to_json(figs: HostFigures) -> dict:
    return {
        "devices": [d.__dict__ for d in figs.devices],
        "mem_available": figs.mem_available,
        "os": figs.os,
        "env": figs.env,
    }


def read_host_figures(
    backend: str | None = None,
    env: dict[str, str] | None = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
    timeout: float = 120.0,
) -> HostFigures:
    """Run the probe in a child process with `env` (default: ours) and parse its figures."""
    child_env = dict(os.environ if env is None else env)
    if backend:
        child_env["SDFARM_BACKEND"] = backend
    done = run(
        [sys.executable, "-m", "sdfarm.native.probe"],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"device probe failed (exit {done.returncode}): {done.stderr[-1000:]}")
    return figures_from_json(json.loads(done.stdout))


def main() -> int:
    figs = HostFigures(
        devices=tuple(read_devices_here()),
        mem_available=mem_available(),
        os=os_name(),
        env={k: os.environ[k] for k in DEVICE_ENV if k in os.environ},
    )
    json.dump(figures_to_json(figs), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
