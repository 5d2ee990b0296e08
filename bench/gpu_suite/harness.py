"""What every stage stands on: the deadline, the runtimes a measurement computes under (their
environment), the machine's probes (nvidia-smi, /proc/meminfo, VmHWM) and the stage document
(gpu-STAGE.json, rewritten after every case)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent.parent
SCRIPT = PACKAGE
"""What a child runs: `python bench/gpu_suite _child SPEC` (the package's __main__)."""


class Deadline:
    """Stop starting cases `seconds` after creation (None: never). `child_timeout` caps a
    child so that it cannot run far past the deadline either."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.seconds = seconds
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float | None:
        return None if self.seconds is None else self.seconds - self.elapsed()

    def expired(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0

    def child_timeout(self, limit: float, grace: float = 45.0, floor: float = 20.0) -> float:
        left = self.remaining()
        if left is None:
            return limit
        return max(floor, min(limit, left + grace))


@dataclass
class Runtime:
    """Where one set of measurements computes: `label` cuda/vulkan/cpu, the runtime build's
    folder (None: the cached build of `label`), its backend (from build.json)."""

    label: str
    directory: str | None = None
    build_backend: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    alias: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, label: str, directory: str | None) -> Runtime:
        rt = cls(label, str(Path(directory).resolve()) if directory else None)
        if rt.directory:
            try:
                rt.facts = json.loads((Path(rt.directory) / "build.json").read_text())
            except (OSError, ValueError) as e:
                rt.facts = {"error": f"{type(e).__name__}: {e}"}
        rt.build_backend = rt.facts.get("backend") or (label if label != "cpu" else "cpu")
        return rt

    @property
    def device(self) -> str:
        return "cpu" if self.label == "cpu" else "auto"

    @property
    def worker_device(self) -> str:
        return {"cuda": "CUDA0", "vulkan": "Vulkan0"}.get(self.label, "CPU")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SDFARM_BACKEND"] = self.build_backend
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.directory:
            env["SDFARM_RUNTIME_DIR"] = self.directory
        if self.label == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["GGML_VK_VISIBLE_DEVICES"] = ""
        return env

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "directory": self.directory,
            "build_backend": self.build_backend,
            "build": self.facts,
            "alias": self.alias,
        }


def alias_runtime(rt: Runtime) -> dict[str, Any]:
    """Make the cached build that `binding.load(backend)` looks for (default flags) point at
    `rt.directory`, unless a build is already there: the GPU runtimes are built with
    different flags (--with-cli, the CUDA architecture) or elsewhere (Vulkan), and a
    binding that does not honour SDFARM_RUNTIME_DIR would otherwise start a build."""
    if not rt.directory:
        return {}
    from sdfarm.native import build

    backend = rt.build_backend
    flags = build._cmake_flags(backend, False, False, [])
    key = build._key(build.SOURCES["sha256"], backend, build.compiler_id(), *flags)
    link = build.cache_root() / "runtime" / key
    if link.exists() or link.is_symlink():
        return {"path": str(link), "created": False, "target": os.path.realpath(link)}
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(rt.directory, target_is_directory=True)
    return {"path": str(link), "created": True, "target": rt.directory}


def meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def nvidia_smi() -> list[dict[str, Any]] | str:
    """nvidia-smi's view of the GPUs (MiB), or why there is none."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return "nvidia-smi not found"
    q = "index,name,memory.total,memory.used,memory.free,driver_version"
    try:
        done = subprocess.run(
            [exe, f"--query-gpu={q}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    if done.returncode != 0:
        return f"nvidia-smi exit {done.returncode}: {done.stderr.strip()[-500:]}"
    rows = []
    for line in done.stdout.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 6:
            rows.append(
                {
                    "index": int(f[0]),
                    "name": f[1],
                    "total_mib": int(f[2]),
                    "used_mib": int(f[3]),
                    "free_mib": int(f[4]),
                    "driver": f[5],
                }
            )
    return rows


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cpus": os.cpu_count(),
        "mem_total": meminfo("MemTotal"),
        "mem_available": meminfo("MemAvailable"),
        "gpus": nvidia_smi(),
    }
    for mod in ("torch", "pynvml"):
        info[mod] = importlib.util.find_spec(mod) is not None
    return info


def vmhwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class CaseError(RuntimeError):
    pass


def _tail(text: str | None, n: int = 2500) -> str:
    return (text or "")[-n:]


class Stage:
    """One stage's JSON document, rewritten after every case."""

    def __init__(
        self, name: str, args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]
    ) -> None:
        self.name = name
        self.args = args
        self.deadline = deadline
        self.path = Path(args.out) / f"gpu-{name}.json"
        self.t0 = time.perf_counter()
        self.doc: dict[str, Any] = {
            "stage": name,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "machine": machine_info(),
            "argv": sys.argv,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "runtimes": [rt.describe() for rt in runtimes],
            "commands": [],
            "cases": [],
            "skipped": [],
            "errors": [],
            "summary": {},
        }
        self.save()

    def command(self, cmd: Sequence[str] | str, env: dict[str, str] | None = None) -> None:
        text = cmd if isinstance(cmd, str) else shlex.join(str(c) for c in cmd)
        if env:
            keys = (
                "SDFARM_BACKEND",
                "SDFARM_RUNTIME_DIR",
                "CUDA_VISIBLE_DEVICES",
                "GGML_VK_VISIBLE_DEVICES",
                "__GL_SHADER_DISK_CACHE_PATH",
                "LD_LIBRARY_PATH",
            )
            pre = " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if k in env)
            text = f"{pre} {text}".strip()
        if text not in self.doc["commands"]:
            self.doc["commands"].append(text)

    def child_command(self, spec: dict[str, Any], env: dict[str, str]) -> None:
        short = {k: v for k, v in spec.items() if k != "gens"}
        gens = spec.get("gens", [])
        if gens:
            short["gens"] = f"{len(gens)} x {gens[0]['width']}x{gens[0]['height']}"
        self.command(f"python bench/gpu_suite _child '{json.dumps(short)}'", env)

    def case(self, name: str, fn: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """Run one case unless past the deadline; its error is recorded, never raised."""
        if self.deadline.expired():
            self.skip(name, "deadline")
            return None
        t = time.perf_counter()
        print(f"[{self.name}] {name} ...", file=sys.stderr, flush=True)
        row: dict[str, Any] = {"case": name}
        try:
            row.update(fn() or {})
            row.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 - one case's failure never stops a stage
            row["ok"] = False
            row["error"] = error_text(e)
            row["traceback"] = traceback.format_exc()[-3000:]
            self.doc["errors"].append({"case": name, "error": error_text(e)})
            print(f"[{self.name}] {name}: {error_text(e)}", file=sys.stderr, flush=True)
        row["seconds"] = round(time.perf_counter() - t, 3)
        self.doc["cases"].append(row)
        self.save()
        return row

    def skip(self, name: str, reason: str) -> None:
        self.doc["skipped"].append({"case": name, "reason": reason})
        self.save()

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def finish(self, lines: list[str]) -> None:
        self.doc["table"] = lines
        self.save()
        print(f"== {self.name} ({self.doc['elapsed_s']:.0f} s) -> {self.path}")
        for line in lines:
            print(line)
        if self.doc["skipped"]:
            print(
                "skipped: " + ", ".join(f"{s['case']} ({s['reason']})" for s in self.doc["skipped"])
            )
        if self.doc["errors"]:
            print(f"errors: {len(self.doc['errors'])} (see {self.path.name})")
        sys.stdout.flush()


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row and row.get("ok"))
