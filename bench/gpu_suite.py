"""The engine and the farm on a real GPU: figures, memory rules, warm-up, speed, memory, farm.

    python bench/gpu_suite.py STAGE --out DIR [--backend cuda|vulkan|cpu] [--runtime-dir DIR]
        [--also-runtime BACKEND=DIR ...] [--model DIR] [--taesd-model DIR] [--cli SD_CLI]
        [--runs N] [--sizes 512,1024] [--steps 1,4] [--jobs N] [--deadline SECONDS]

STAGE is one of devices, rules, warmup, speed, memory, farm, or all (in that order). Each
stage writes DIR/gpu-STAGE.json (machine, date, commands, figures; rewritten after every
case, so a stage killed from outside still leaves what it measured) and prints a short table.

- devices: `sdfarm devices --json` under each runtime, next to nvidia-smi.
- rules: another process (torch) holds most of the GPU; the figures under each runtime, the
  full-size model's load (its one warn record and the fit plan), a sparse huge model's
  refusal, then the over-budget case (the GPU held to the last MiB).
- warmup: first and second generation after a load, with and without the engine's warm-up
  (Vulkan also with an empty driver pipeline cache).
- speed: per (size, steps): our `sdfarm generate --in-process` against the runtime's own
  sd-cli on the same inputs, alternated; our engine loaded without warm-up; a steady loop.
- memory: per model and size: estimate, peak RSS (VmHWM), peak GPU memory (NVML, polled from
  this process every 20 ms).
- farm: a local farm (private redis-server, scheduler, one worker) against the in-process
  loop on the same jobs; GPU efficiency; batch_count against separate calls.

Every measurement runs in a fresh child process (`_child`), so nothing leaks between cases.
A case that fails is recorded with its error and the stage goes on; past --deadline no new
case starts (the skipped ones are listed). --backend picks where it computes: cuda and vulkan
load the runtime in --runtime-dir (through SDFARM_RUNTIME_DIR, SDFARM_BACKEND and an alias of
the cache key); cpu computes on the CPU, with the GPUs hidden when --runtime-dir is a GPU
build (so a GPU host needs no separate CPU build).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import queue
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPT = Path(__file__).resolve()
GiB = 1 << 30
MiB = 1 << 20
STAGES = ("devices", "rules", "warmup", "speed", "memory", "farm")
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 42
MARK = "@@gpu_suite "
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
HOLDER = r"""
import os, sys, time
import torch
parent = os.getppid()
hold, leave = float(sys.argv[1]), float(sys.argv[2])
free, total = torch.cuda.mem_get_info()
n = int(hold * 2**30) if hold > 0 else int(free - leave * 2**30)
n -= n % (2 << 20)
held = []
while n > 0:
    try:
        held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        break
    except RuntimeError:
        n -= 256 << 20
if leave <= 0 and hold <= 0:
    for chunk in (64 << 20, 2 << 20):
        while True:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except RuntimeError:
                break
after, _ = torch.cuda.mem_get_info()
print("held", sum(x.numel() for x in held), after, total, flush=True)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end and os.getppid() == parent:  # never outlive the suite
    time.sleep(0.5)
"""


# =============================================================================================
# Pure parts (tests/unit/test_gpu_suite.py)

GENERATE_RE = re.compile(r"generate_image completed in\s+([0-9]+(?:\.[0-9]+)?)\s*s")
PHASE_RE = re.compile(
    r"([A-Za-z_][\w ]*?)\s+completed,?\s+(?:in|taking)\s+([0-9]+(?:\.[0-9]+)?)\s*s\b"
)


def parse_generate_seconds(text: str) -> float | None:
    """The runtime's own generate time from its log ("generate_image completed in 0.31s");
    the last one when several generations are in the text, None when absent."""
    found = GENERATE_RE.findall(text or "")
    return float(found[-1]) if found else None


def parse_phase_seconds(text: str) -> dict[str, float]:
    """Every "X completed, taking N.NNs" / "X completed in N.NNs" of the runtime's log, by X
    (the last of each): loading tensors, get_learned_condition, sampling, decode_first_stage,
    generate_image ..."""
    out: dict[str, float] = {}
    for name, value in PHASE_RE.findall(text or ""):
        out[name.strip().split("] ")[-1].strip()] = float(value)
    return out


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs


def within(r: float | None, tolerance: float) -> bool | None:
    """Ours within `tolerance` of theirs: ratio <= 1 + tolerance (faster is always fine)."""
    return None if r is None else r <= 1.0 + tolerance


def gpu_efficiency(generate_s: Sequence[float], workers: int, makespan: float) -> float | None:
    """sum of the runtime's generate times / (workers x makespan): the share of the GPUs'
    time spent generating."""
    if workers <= 0 or makespan <= 0:
        return None
    return sum(generate_s) / (workers * makespan)


def per_second(count: float, seconds: float | None) -> float | None:
    return None if not seconds or seconds <= 0 else count / seconds


def added_per_job(farm_wall: float, baseline_wall: float, jobs: int) -> float | None:
    """What the farm adds to each job of a batch, against the in-process loop of the same
    jobs (both walls from first submit/generation to last result)."""
    return None if jobs <= 0 else (farm_wall - baseline_wall) / jobs


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


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """ "512,1024" or "512x768,1024" -> [(512, 512), (1024, 1024)] / [(512, 768), ...]."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "x" in part.lower():
            w, h = part.lower().split("x", 1)
            out.append((int(w), int(h)))
        else:
            out.append((int(part), int(part)))
    if not out:
        raise ValueError(f"no sizes in {text!r}")
    return out


def parse_ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def speed_cases(
    sizes: Sequence[tuple[int, int]], steps: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(width, height, steps): every size at the first step count, then the first size at
    each further step count: 512,1024 x 1,4 -> 512x1, 1024x1, 512x4."""
    first = steps[0]
    cases = [(w, h, first) for w, h in sizes]
    cases += [(sizes[0][0], sizes[0][1], k) for k in steps[1:] if k != first]
    return cases


def size_label(w: int, h: int, steps: int | None = None) -> str:
    return f"{w}x{h}" + (f" {steps} step{'s' if steps != 1 else ''}" if steps else "")


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
    from sdfarm.native.engine import use_vae_conv_direct

    device = "CUDA0" if os.environ.get("SDFARM_SUITE_BACKEND") == "cuda" else "other"
    if use_vae_conv_direct(files, device):
        cmd.append("--vae-conv-direct")
    if batch_count != 1:
        cmd += ["--batch-count", str(batch_count)]
    return cmd + ["-o", output, "-v"]


def compare_with_smi(
    reports: dict[str, dict[str, Any]], smi: list[dict[str, Any]] | str
) -> dict[str, list[dict[str, Any]]]:
    """Each runtime's GPUs (in listing order) against nvidia-smi's (in index order): free and
    total in MiB and their differences (ggml - nvidia-smi)."""
    out: dict[str, list[dict[str, Any]]] = {}
    if not isinstance(smi, list):
        return out
    for label, rep in reports.items():
        gpus = [d for d in rep.get("devices", []) if d.get("type") in ("gpu", "igpu")]
        rows = []
        for d, g in zip(gpus, smi, strict=False):
            free, total = d["free"] // MiB, d["total"] // MiB
            rows.append(
                {
                    "name": d["name"],
                    "smi_index": g["index"],
                    "ggml_free_mib": free,
                    "ggml_total_mib": total,
                    "smi_free_mib": g["free_mib"],
                    "smi_total_mib": g["total_mib"],
                    "free_diff_mib": free - g["free_mib"],
                    "total_diff_mib": total - g["total_mib"],
                }
            )
        out[label] = rows
    return out


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


def huge_apparent_bytes(gpu_totals: Sequence[int], mem_available: int | None) -> int:
    """A model size whose estimate is far above every GPU plus MemAvailable (at least 200 GB,
    the tests' huge model)."""
    base = sum(gpu_totals) + (mem_available or 0)
    want = max(200 * 10**9, int(base * 1.5))
    return want - want % 256


def above_estimate(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Every (row, measure) whose value exceeds the row's estimate."""
    out = []
    for row in rows:
        est = row.get("estimate")
        for k in keys:
            v = row.get(k)
            if est and v is not None and v > est:
                out.append(
                    {
                        "case": row.get("case"),
                        "measure": k,
                        "value": v,
                        "estimate": est,
                        "ratio": v / est,
                    }
                )
    return out


def holder_split(line: str) -> dict[str, int] | None:
    """The holder's 'held BYTES FREE_AFTER TOTAL' line."""
    parts = line.split()
    if len(parts) != 4 or parts[0] != "held":
        return None
    held, free, total = (int(p) for p in parts[1:])
    return {"held": held, "free_after": free, "total": total}


def fmt_s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_gib(v: float | None) -> str:
    return "-" if v is None else f"{v / GiB:.2f}"


def fmt_mib(v: float | None) -> str:
    return "-" if v is None else f"{v / MiB:.0f}"


# =============================================================================================
# Runtimes, environment, machine


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


# =============================================================================================
# GPU memory polling (NVML from this process)


class GpuPoller:
    """Polls NVML every `interval` s: the memory NVML attributes to `pid` (compute and graphics
    processes, both lists; the larger per device) and the device's used memory over the idle
    baseline read at creation (before the child starts). Unavailable without pynvml or a GPU:
    `reason` says why."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.pid: int | None = None
        self.reason: str | None = None
        self.samples = 0
        self.peak_process: int | None = None
        self.peak_used: int | None = None
        self.baseline: int | None = None
        self.process_listed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nv: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
            if not self.handles:
                raise RuntimeError("NVML lists no GPU")
            self.baseline = self._used()
        except Exception as e:  # noqa: BLE001 - no NVML is a recorded reason, not a failure
            self.reason = error_text(e)
            self.nv = None

    def _used(self) -> int:
        return sum(int(self.nv.nvmlDeviceGetMemoryInfo(h).used) for h in self.handles)

    def _process_bytes(self) -> int | None:
        total, seen = 0, False
        for h in self.handles:
            best: int | None = None
            for fn in (
                self.nv.nvmlDeviceGetComputeRunningProcesses,
                self.nv.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                try:
                    procs = fn(h)
                except Exception:  # noqa: BLE001 - one list may be unsupported
                    continue
                for p in procs:
                    if p.pid == self.pid and p.usedGpuMemory is not None:
                        best = max(best or 0, int(p.usedGpuMemory))
            if best is not None:
                total += best
                seen = True
        return total if seen else None

    def sample(self) -> None:
        used = self._used()
        self.peak_used = used if self.peak_used is None else max(self.peak_used, used)
        if self.pid is not None:
            mine = self._process_bytes()
            if mine is not None:
                self.process_listed = True
                self.peak_process = (
                    mine if self.peak_process is None else max(self.peak_process, mine)
                )
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001
                self.reason = error_text(e)
                return
            self._stop.wait(self.interval)

    def start(self, pid: int) -> None:
        self.pid = pid
        if self.nv is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.nv is not None:
            with contextlib.suppress(Exception):
                self.nv.nvmlShutdown()

    def summary(self) -> dict[str, Any]:
        if self.nv is None and self.samples == 0:
            return {"available": False, "reason": self.reason}
        delta = None
        if self.peak_used is not None and self.baseline is not None:
            delta = self.peak_used - self.baseline
        return {
            "available": True,
            "reason": self.reason,
            "samples": self.samples,
            "interval_s": self.interval,
            "baseline_used": self.baseline,
            "peak_used": self.peak_used,
            "peak_used_delta": delta,
            "peak_process": self.peak_process,
            "per_process": self.process_listed,
            # What the memory table compares: NVML's figure for the process when it lists
            # it (containers often hide pids), else the device's growth over idle.
            "peak": self.peak_process if self.process_listed else delta,
        }


# =============================================================================================
# Children


class CaseError(RuntimeError):
    pass


def _tail(text: str | None, n: int = 2500) -> str:
    return (text or "")[-n:]


def run_child(
    spec: dict[str, Any], env: dict[str, str], timeout: float, gpu: bool = False
) -> dict[str, Any]:
    """`python bench/gpu_suite.py _child SPEC` in its own session: one JSON result."""
    cmd = [sys.executable, str(SCRIPT), "_child", json.dumps(spec)]
    poller = GpuPoller() if gpu else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    _LIVE.add(proc)
    if poller is not None:
        poller.start(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise CaseError(
            f"child timed out after {timeout:.0f} s; stderr: {_tail(err, 1500)}"
        ) from None
    except BaseException:  # stopped from outside (SIGTERM, Ctrl-C): the child goes too
        _kill_group(proc)
        raise
    finally:
        _LIVE.discard(proc)
        if poller is not None:
            poller.stop()
    wall = time.perf_counter() - t0
    result = merge_parts(out.splitlines())
    if result is None:
        raise CaseError(f"child exited {proc.returncode} without a result: {_tail(err)}")
    result["process_wall_s"] = round(wall, 4)
    result["returncode"] = proc.returncode
    if proc.returncode != 0:
        result["stderr_tail"] = _tail(err)
    if poller is not None:
        result["gpu"] = poller.summary()
    return result


_LIVE: set[subprocess.Popen[Any]] = set()
"""Children in their own sessions that are running now: killed if the suite is stopped."""


def _kill_live() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            _kill_group(proc)
        _LIVE.discard(proc)


def _on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """The child and what it started (its session), by the child's own id."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(10)


def child_main(spec: dict[str, Any]) -> int:
    """Load one engine, run the generations of `spec`; reports as it goes (a line after the
    load, one per generation, one before and one after dispose), so a process that dies in
    the runtime still leaves what it measured (`merge_parts` puts them together)."""
    out: dict[str, Any] = {"pid": os.getpid()}

    def part(doc: dict[str, Any]) -> None:
        print(MARK + json.dumps(doc, default=str), flush=True)

    def emit() -> int:
        out["peak_rss"] = vmhwm()
        part(out)
        return 0

    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.params import GenerationParams
    from sdfarm.native.png import png_bytes

    t0 = time.perf_counter()
    try:
        engine = Engine.load(
            spec["model"],
            device=spec.get("device", "auto"),
            check_memory=spec.get("check_memory", True),
            log=LogConfig(level=spec.get("log_level", "info")),
            warm_up=spec.get("warm_up"),
        )
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        out["error"] = _error_doc(e)
        out["failed_at"] = "load"
        return emit()
    out["load_wall_s"] = round(time.perf_counter() - t0, 4)
    out["load_s"] = round(engine.load_seconds, 4)
    out["warmup_s"] = round(engine.warmup_seconds, 4)
    out["capabilities"] = engine.capabilities.as_dict()
    out["load_records"] = [r.as_dict() for r in engine.drain_load_records()]
    part(out)
    out = {"stage": "generations"}
    t_all = time.perf_counter()
    for g in spec.get("gens", []):
        w, h = g.get("width", 512), g.get("height", 512)
        params = GenerationParams(
            prompt=g.get("prompt", PROMPT),
            width=w,
            height=h,
            steps=g.get("steps", 1),
            seed=g.get("seed", SEED),
            batch_count=g.get("batch_count", 1),
            cfg_scale=1.0,
        )
        row: dict[str, Any] = {
            "group": g.get("group"),
            "width": w,
            "height": h,
            "steps": params.steps,
            "batch_count": params.batch_count,
            "estimate": engine.estimate_for(w, h),
        }
        t = time.perf_counter()
        try:
            r = engine.generate(params)
        except Exception as e:  # noqa: BLE001
            row["error"] = _error_doc(e)
            part({"gen": row})
            out["failed_at"] = "generate"
            break
        row["generate_s"] = r.metadata["timings"]["generate_s"]
        text = "\n".join(rec.message for rec in r.records)
        row["runtime_s"] = parse_generate_seconds(text)
        row["phases"] = parse_phase_seconds(text)
        row["images"] = len(r.images)
        row["warnings"] = r.metadata.get("warnings", [])
        if g.get("png"):
            tp = time.perf_counter()
            for img in r.images:
                png_bytes(img, r.metadata)
            row["png_s"] = round(time.perf_counter() - tp, 4)
        row["wall_s"] = round(time.perf_counter() - t, 4)
        part({"gen": row})
    out["gens_wall_s"] = round(time.perf_counter() - t_all, 4)
    emit()
    try:
        engine.dispose()
        part({"disposed": True})
    except Exception as e:  # noqa: BLE001
        part({"disposed": False, "dispose_error": _error_doc(e)})
    return 0


def merge_parts(lines: Iterable[str]) -> dict[str, Any] | None:
    """The child's report lines as one document: later keys win, generations in order
    under "gens"; None when the child reported nothing."""
    doc: dict[str, Any] | None = None
    gens: list[dict[str, Any]] = []
    for line in lines:
        if not line.startswith(MARK):
            continue
        part = json.loads(line[len(MARK) :])
        doc = doc or {}
        if "gen" in part:
            gens.append(part["gen"])
        else:
            doc.update(part)
    if doc is not None:
        doc.pop("stage", None)
        doc["gens"] = gens
    return doc


def child_status(res: dict[str, Any]) -> dict[str, Any]:
    """How the child ended: its exit code, whether dispose returned, the stderr of a crash."""
    out: dict[str, Any] = {"returncode": res.get("returncode"), "disposed": res.get("disposed")}
    if res.get("returncode"):
        out["crashed"] = True
        out["stderr_tail"] = res.get("stderr_tail", "")[-1500:]
    return out


def _error_doc(e: BaseException) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
    for attr in ("estimate", "figures", "records"):
        if getattr(e, attr, None) not in (None, [], {}):
            doc[attr] = getattr(e, attr)
    return doc


def gens_spec(
    n: int,
    w: int,
    h: int,
    steps: int,
    *,
    group: str | None = None,
    png: bool = False,
    seed0: int = SEED,
    prompt: str | None = None,
    batch_count: int = 1,
) -> list[dict[str, Any]]:
    return [
        {
            "width": w,
            "height": h,
            "steps": steps,
            "seed": seed0 + i,
            "group": group,
            "png": png,
            "prompt": prompt or PROMPT,
            "batch_count": batch_count,
        }
        for i in range(n)
    ]


# =============================================================================================
# The stage document


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
        self.command(f"python bench/gpu_suite.py _child '{json.dumps(short)}'", env)

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


# =============================================================================================
# Stage: devices


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
            cmd = [sys.executable, "-m", "sdfarm.scheduler.cli", "devices", "--json"]
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


# =============================================================================================
# Stage: rules


class Holder:
    """Another process holding GPU memory through torch (the `HOLDER` script)."""

    def __init__(
        self,
        python: str,
        hold_gib: float,
        leave_gib: float,
        st: Stage,
        wait: float = 120.0,
        sleep: float = 900.0,
    ) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {"hold_gib": hold_gib, "leave_gib": leave_gib}
        cmd = [python, "-c", HOLDER, str(hold_gib), str(leave_gib), str(sleep)]
        st.command(
            f"{python} -c '<HOLDER: torch.empty(N, uint8, cuda); print held; sleep>' "
            f"{hold_gib} {leave_gib} {sleep:.0f}"
        )
        self.errfile = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives with the holder
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.errfile,
            text=True,
            start_new_session=True,
        )
        _LIVE.add(self.proc)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            got = holder_split(line.strip())
            if got:
                self.info.update(got)
                return
        self.stop()
        self.errfile.seek(0)
        err = self.errfile.read()
        raise CaseError(
            f"the holder did not report 'held' within {wait:.0f} s: "
            f"{_tail(err, 1500) or 'no output'}"
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        _LIVE.discard(self.proc)
        self.proc = None
        time.sleep(1.0)  # let the driver release the memory before the next probe


def holder_available(python: str) -> str | None:
    """None when `python` has torch with CUDA; else why not."""
    try:
        done = subprocess.run(
            [python, "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA device'"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return error_text(e)
    if done.returncode != 0:
        return (
            _tail(done.stderr, 300).strip().splitlines()[-1]
            if done.stderr.strip()
            else (f"exit {done.returncode}")
        )
    return None


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


def load_summary(res: dict[str, Any], label: str) -> dict[str, Any]:
    """A load child's result in brief: the verdict, the engine's warn records and whether the
    first names the device, the estimate and the figure (by their byte counts)."""
    caps = res.get("capabilities") or {}
    recs = res.get("load_records") or []
    warn = [r for r in recs if r.get("source") == "engine" and r.get("level") == "warn"]
    summary: dict[str, Any] = {
        "runtime": label,
        "memory_check": caps.get("memory_check"),
        "device": caps.get("device"),
        "estimate": caps.get("estimate"),
        "figures": caps.get("figures"),
        "fit_plan": caps.get("fit_plan"),
        "engine_warnings": [r.get("message") for r in warn],
        "warn_records": len(warn),
        "runtime_warn_records": len([r for r in recs if r.get("source") != "engine"]),
        "load_s": res.get("load_s"),
        "gens": res.get("gens"),
        "error": res.get("error"),
        "gpu": res.get("gpu"),
        "peak_rss": res.get("peak_rss"),
        **child_status(res),
    }
    if warn and caps:
        msg = warn[0].get("message", "")
        summary["warning_names_device"] = bool(caps.get("device")) and caps["device"] in msg
        summary["warning_names_estimate"] = f"({caps.get('estimate')} bytes)" in msg
        figure = (caps.get("figures") or {}).get(
            next((k for k in caps.get("figures") or {} if k.startswith(caps["device"] + " ")), "")
        )
        summary["warning_names_figure"] = figure is not None and f"({figure} bytes)" in msg
    return summary


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


def rules_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdicts in brief: every load (check, warn records, what the warning names, the fit
    plan, whether the generation ran), the figures' drop under the holder, the refusal."""
    out: dict[str, Any] = {"loads": [], "figure_drop": {}, "huge_refused": None}
    for c in cases:
        name = c.get("case", "")
        if name.startswith("load full-size") and c.get("ok"):
            g = (c.get("gens") or [{}])[0]
            out["loads"].append(
                {
                    "case": name,
                    "memory_check": c.get("memory_check"),
                    "warn_records": c.get("warn_records"),
                    "names_device": c.get("warning_names_device"),
                    "names_estimate": c.get("warning_names_estimate"),
                    "names_figure": c.get("warning_names_figure"),
                    "fit_plan": (c.get("fit_plan") or {}).get("summary"),
                    "generate_s": g.get("generate_s"),
                    "error": (c.get("error") or g.get("error") or {}).get("message"),
                    "returncode": c.get("returncode"),
                }
            )
        if c.get("figure_drop"):
            out["figure_drop"][name] = c["figure_drop"]
        if name.startswith("huge model") and c.get("ok"):
            out["huge_refused"] = c.get("refused")
    return out


_HOLDERS: list[Holder] = []


def _start_holder(args: argparse.Namespace, st: Stage, hold: float, leave: float) -> dict:
    h = Holder(args.holder_python, hold, leave, st)
    _HOLDERS.append(h)
    return h.info


def _plan_text(fp: dict[str, Any]) -> str:
    keys = ("keep_clip_on_cpu", "keep_vae_on_cpu", "offload_params_to_cpu", "max_vram")
    return ", ".join(f"{k}={fp.get(k)}" for k in keys if k in fp) or json.dumps(fp)[:120]


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


# =============================================================================================
# Stage: warmup


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


# =============================================================================================
# Stage: speed


def model_files(model: str) -> dict[str, str]:
    from sdfarm.native.models import Model

    m = Model.from_dir(Path(model))
    return {role: str(mf.path) for role, mf in m.files.items()}


def ours_cli_run(
    rt: Runtime, model: str, w: int, h: int, steps: int, out: Path, st: Stage, timeout: float
) -> dict[str, Any]:
    env = rt.env()
    cmd = [
        sys.executable,
        "-m",
        "sdfarm.scheduler.cli",
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


# =============================================================================================
# Stage: memory


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


# =============================================================================================
# Stage: farm


def stage_farm(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("farm", args, deadline, runtimes)
    rt = runtimes[0]
    w, h = parse_sizes(args.sizes)[0]
    jobs, bc = args.jobs, args.batch_count
    model_dir = Path(args.model).resolve()
    name = model_dir.name
    common = {"width": w, "height": h, "steps": 1}
    s: dict[str, Any] = {
        "jobs": jobs,
        "size": f"{w}x{h}",
        "steps": 1,
        "workers": 1,
        "batch_count": bc,
        "device": rt.worker_device,
    }
    st.doc["summary"] = s

    def inproc() -> dict[str, Any]:
        gens = (
            gens_spec(1, w, h, 1, group="warm", png=True)
            + gens_spec(jobs, w, h, 1, group="jobs", png=True, seed0=1000)
            + gens_spec(
                1,
                w,
                h,
                1,
                group="batch",
                png=True,
                seed0=5000,
                prompt="same prompt",
                batch_count=bc,
            )
            + gens_spec(bc, w, h, 1, group="calls", png=True, seed0=5000, prompt="same prompt")
        )
        spec = {"model": str(model_dir), "device": rt.device, "log_level": "none", "gens": gens}
        env = rt.env()
        st.child_command(spec, env)
        res = run_child(spec, env, deadline.child_timeout(args.case_timeout * 2))
        g = res.get("gens") or []
        errs = [x["error"] for x in g if x.get("error")] + (
            [res["error"]] if res.get("error") else []
        )
        if errs:
            raise CaseError(str(errs[0]))
        if len(g) < len(gens):
            raise CaseError(
                f"only {len(g)} of {len(gens)} generations (exit {res.get('returncode')}: "
                f"{res.get('stderr_tail', '')[-800:]})"
            )

        def grp(n: str) -> list[dict[str, Any]]:
            return [x for x in g if x.get("group") == n]

        jw = sum(x["wall_s"] for x in grp("jobs"))
        jg = [x["generate_s"] for x in grp("jobs")]
        bw = sum(x["wall_s"] for x in grp("batch"))
        cw = sum(x["wall_s"] for x in grp("calls"))
        out = {
            "jobs_wall_s": jw,
            "jobs_generate_sum_s": sum(jg),
            "jobs_generate_median_s": median(jg),
            "images_per_s": per_second(len(jg), jw),
            "efficiency": gpu_efficiency(jg, 1, jw),
            "batch_wall_s": bw,
            "batch_images": sum(x["images"] for x in grp("batch")),
            "calls_wall_s": cw,
            "batch_images_per_s": per_second(sum(x["images"] for x in grp("batch")), bw),
            "calls_images_per_s": per_second(len(grp("calls")), cw),
            "load_s": res.get("load_s"),
            "warmup_s": res.get("warmup_s"),
            **child_status(res),
        }
        s["in_process"] = out
        return out

    st.case(f"in-process: {jobs} jobs + batch_count {bc}", inproc)

    from sdfarm.scheduler.client import Farm, FarmBusyError
    from sdfarm.scheduler.localfarm import LocalFarm

    if deadline.expired():
        st.skip("farm", "deadline")
        _farm_table(st, s)
        return
    log_dir = Path(args.farm_log_dir or Path(args.out) / "farm-logs")
    env = rt.env()
    worker_args = ["--pin", name]
    st.command(
        f"LocalFarm([{model_dir.parent}], devices=[{rt.worker_device}], "
        f"worker_args={worker_args}) (redis-server, python -m sdfarm.scheduler.service, "
        f"python -m sdfarm.worker.main --device {rt.worker_device} --pin {name})",
        env,
    )
    local = LocalFarm(
        [model_dir.parent],
        devices=[rt.worker_device],
        announce=False,
        log_dir=log_dir,
        env=env,
        worker_args=worker_args,
        ready_timeout=deadline.child_timeout(240),
    )
    t = time.perf_counter()
    try:
        local.start()
    except Exception as e:  # noqa: BLE001
        st.doc["errors"].append({"case": "start farm", "error": error_text(e)})
        st.doc["cases"].append({"case": "start farm", "ok": False, "error": error_text(e)})
        _farm_table(st, s)
        return
    s["farm_start_s"] = round(time.perf_counter() - t, 3)
    tmo = args.case_timeout
    try:
        with Farm(local.url) as farm:

            def warm() -> dict[str, Any]:
                r = [
                    farm.submit(name, "warm", seed=i, **common).result(timeout=tmo)
                    for i in range(2)
                ]
                return {"timings": [x.metadata.get("timings") for x in r]}

            st.case("farm warm-up jobs", warm)

            def sequential() -> dict[str, Any]:
                lat, gen = [], []
                for i in range(min(jobs, args.seq_jobs)):
                    t0 = time.perf_counter()
                    r = farm.submit(name, f"seq {i}", seed=100 + i, **common).result(timeout=tmo)
                    lat.append(time.perf_counter() - t0)
                    gen.append(r.metadata["timings"]["generate_s"])
                added = [a - g for a, g in zip(lat, gen, strict=True)]
                out = {
                    "n": len(lat),
                    "latency_median_s": median(lat),
                    "generate_median_s": median(gen),
                    "added_median_s": median(added),
                    "added_max_s": max(added) if added else None,
                }
                s["sequential"] = out
                return out

            st.case(f"farm sequential {min(jobs, args.seq_jobs)} jobs", sequential)

            def batch() -> dict[str, Any]:
                t0 = time.perf_counter()
                pending: deque[Any] = deque()
                results = []
                for i in range(jobs):
                    while True:
                        try:
                            pending.append(
                                farm.submit(name, f"farm job {i}", seed=1000 + i, **common)
                            )
                            break
                        except FarmBusyError:
                            if not pending:
                                raise
                            results.append(pending.popleft().result(timeout=tmo))
                submitted = time.perf_counter() - t0
                while pending:
                    results.append(pending.popleft().result(timeout=tmo))
                makespan = time.perf_counter() - t0
                tim = [r.metadata.get("timings", {}) for r in results]
                gen = [x["generate_s"] for x in tim]
                out = {
                    "n": len(results),
                    "makespan_s": makespan,
                    "submit_s": submitted,
                    "generate_sum_s": sum(gen),
                    "generate_median_s": median(gen),
                    "efficiency": gpu_efficiency(gen, 1, makespan),
                    "images_per_s": per_second(len(results), makespan),
                    "encode_median_s": median(x.get("encode_s") for x in tim),
                    "queued_median_s": median(x.get("queued_s") for x in tim),
                }
                base = s.get("in_process") or {}
                if base.get("jobs_wall_s"):
                    out["added_per_job_s"] = added_per_job(makespan, base["jobs_wall_s"], jobs)
                    out["throughput_vs_in_process"] = ratio(
                        out["images_per_s"], base["images_per_s"]
                    )
                s["farm"] = out
                return out

            st.case(f"farm batch {jobs} jobs", batch)

            def batch_count() -> dict[str, Any]:
                t0 = time.perf_counter()
                r = farm.submit(name, "same prompt", seed=5000, batch_count=bc, **common).result(
                    timeout=tmo
                )
                one_wall = time.perf_counter() - t0
                t1 = time.perf_counter()
                js = [farm.submit(name, "same prompt", seed=5000 + i, **common) for i in range(bc)]
                rs = [j.result(timeout=tmo) for j in js]
                many_wall = time.perf_counter() - t1
                out = {
                    "batch_images": len(r.pngs),
                    "batch_wall_s": one_wall,
                    "batch_generate_s": r.metadata.get("timings", {}).get("generate_s"),
                    "batch_images_per_s": per_second(len(r.pngs), one_wall),
                    "calls_wall_s": many_wall,
                    "calls_generate_sum_s": sum(x.metadata["timings"]["generate_s"] for x in rs),
                    "calls_images_per_s": per_second(len(rs), many_wall),
                }
                s["farm_batch_count"] = out
                return out

            st.case(f"farm batch_count {bc} vs {bc} jobs", batch_count)
    finally:
        local.stop()
    _farm_table(st, s)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _farm_table(st: Stage, s: dict[str, Any]) -> None:
    ip, fm = s.get("in_process") or {}, s.get("farm") or {}
    sq, bc = s.get("sequential") or {}, s.get("farm_batch_count") or {}
    lines = [
        f"{s['jobs']} jobs {s['size']} 1 step on {s['device']}, one worker",
        f"{'':34} {'in-process':>11} {'farm':>11}",
        f"{'wall / makespan s':<34} {fmt_s(ip.get('jobs_wall_s'), 2):>11} "
        f"{fmt_s(fm.get('makespan_s'), 2):>11}",
        f"{'sum of generate_s':<34} {fmt_s(ip.get('jobs_generate_sum_s'), 2):>11} "
        f"{fmt_s(fm.get('generate_sum_s'), 2):>11}",
        f"{'images/s':<34} {fmt_s(ip.get('images_per_s'), 2):>11} "
        f"{fmt_s(fm.get('images_per_s'), 2):>11}",
        f"{'GPU efficiency (target >= 0.95)':<34} {fmt_s(ip.get('efficiency')):>11} "
        f"{fmt_s(fm.get('efficiency')):>11}",
        f"{'farm added per job (batch) ms':<34} {'':>11} "
        f"{fmt_s(_ms(fm.get('added_per_job_s')), 1):>11}",
        f"{'sequential added latency p50 ms':<34} {'':>11} "
        f"{fmt_s(_ms(sq.get('added_median_s')), 1):>11}",
        f"{'batch_count images/s':<34} {fmt_s(ip.get('batch_images_per_s'), 2):>11} "
        f"{fmt_s(bc.get('batch_images_per_s'), 2):>11}",
        f"{'same prompt, separate calls img/s':<34} {fmt_s(ip.get('calls_images_per_s'), 2):>11} "
        f"{fmt_s(bc.get('calls_images_per_s'), 2):>11}",
    ]
    st.finish(lines)


# =============================================================================================
# Command line


RUNNERS = {
    "devices": stage_devices,
    "rules": stage_rules,
    "warmup": stage_warmup,
    "speed": stage_speed,
    "memory": stage_memory,
    "farm": stage_farm,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=(*STAGES, "all"))
    p.add_argument("--out", required=True, help="folder for gpu-STAGE.json")
    p.add_argument(
        "--model", default="/tmp/models/sd-turbo-random", help="the full-size model folder"
    )
    p.add_argument("--taesd-model", default=None, help="the same with a TAESD decoder")
    p.add_argument(
        "--backend",
        default="cuda",
        choices=("cuda", "vulkan", "cpu"),
        help="where it computes (cpu hides the GPUs of a GPU runtime)",
    )
    p.add_argument(
        "--runtime-dir", default=None, help="the runtime build to load (a folder with build.json)"
    )
    p.add_argument(
        "--also-runtime",
        action="append",
        default=[],
        metavar="BACKEND=DIR",
        help="further runtimes whose figures devices/rules record (repeatable; "
        "DIR may be empty for the cached build)",
    )
    p.add_argument("--cli", default=None, help="the runtime's sd-cli (speed: the comparison)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sizes", default="512,1024", help="e.g. 512,1024 or 512x768")
    p.add_argument("--steps", default="1,4", help="speed: step counts (first at every size)")
    p.add_argument(
        "--steady",
        type=int,
        default=0,
        help="speed: timed generations of the steady loop (default max(runs, 3))",
    )
    p.add_argument("--jobs", type=int, default=200, help="farm: batch size")
    p.add_argument("--seq-jobs", type=int, default=20, help="farm: sequential latency sample")
    p.add_argument("--batch-count", type=int, default=8)
    p.add_argument(
        "--speed-batch",
        type=int,
        default=0,
        help="speed: also one call of N images per fresh process, ours against sd-cli",
    )
    p.add_argument(
        "--farm-log-dir", default=None, help="farm: the parts' logs (default OUT/farm-logs)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new case this long after the start",
    )
    p.add_argument("--case-timeout", type=float, default=300.0)
    p.add_argument(
        "--hold-gib",
        type=float,
        default=0.0,
        help="rules: GiB the holder takes (0: all but --hold-leave-gib)",
    )
    p.add_argument(
        "--hold-leave-gib",
        type=float,
        default=1.5,
        help="rules: GiB left free by the holder when --hold-gib is 0",
    )
    p.add_argument("--holder-python", default=sys.executable)
    p.add_argument(
        "--no-nowarm",
        action="store_true",
        help="speed: leave out our engine loaded without warm-up",
    )
    p.add_argument("--work-dir", default=None, help="scratch folder (default: the system's)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return child_main(json.loads(argv[1]))
    args = build_parser().parse_args(argv)
    os.environ["SDFARM_SUITE_BACKEND"] = args.backend  # sd-cli gets the engine's settings
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.model = str(Path(args.model).resolve())
    if args.taesd_model:
        args.taesd_model = str(Path(args.taesd_model).resolve())
    runtimes = [Runtime.make(args.backend, args.runtime_dir)]
    for spec in args.also_runtime:
        label, _, directory = spec.partition("=")
        if label not in ("cuda", "vulkan", "cpu"):
            raise SystemExit(f"--also-runtime {spec!r}: BACKEND must be cuda, vulkan or cpu")
        runtimes.append(Runtime.make(label, directory or None))
    for rt in runtimes:
        try:
            rt.alias = alias_runtime(rt)
        except Exception as e:  # noqa: BLE001 - recorded; the child may still load
            rt.alias = {"error": error_text(e)}
    deadline = Deadline(args.deadline)
    signal.signal(signal.SIGTERM, _on_term)
    try:
        run_stages(args, deadline, runtimes)
    finally:
        _kill_live()
    return 0


def run_stages(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    stages = STAGES if args.stage == "all" else (args.stage,)
    for name in stages:
        if deadline.expired():
            print(f"== {name}: skipped (deadline)", flush=True)
            Stage(name, args, deadline, runtimes).skip(name, "deadline")
            continue
        try:
            RUNNERS[name](args, deadline, runtimes)
        except Exception as e:  # noqa: BLE001 - a stage's own failure is recorded, next one runs
            path = Path(args.out) / f"gpu-{name}.json"
            doc = json.loads(path.read_text()) if path.exists() else {"stage": name}
            doc.setdefault("errors", []).append(
                {"case": "(stage)", "error": error_text(e), "traceback": traceback.format_exc()}
            )
            path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            print(f"== {name}: FAILED {error_text(e)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
