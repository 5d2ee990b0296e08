"""Every measurement in a fresh child process: `run_child` starts `python bench/gpu_suite
_child SPEC` in its own session (polling GPU memory through NVML meanwhile), `child_main` is
that child (one engine, its generations, reported line by line), `merge_parts` puts the
report back together; the children still running are killed when the suite stops."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from .analysis import parse_generate_seconds, parse_phase_seconds
from .harness import SCRIPT, CaseError, _tail, error_text, vmhwm

PROMPT = "a lighthouse on a cliff at dusk, oil painting"
SEED = 42
MARK = "@@gpu_suite "
"""What starts each line of a child's report (`child_main`, `merge_parts`)."""


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


def run_child(
    spec: dict[str, Any], env: dict[str, str], timeout: float, gpu: bool = False
) -> dict[str, Any]:
    """`python bench/gpu_suite _child SPEC` in its own session: one JSON result."""
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
            decoder=spec.get("decoder", "default"),
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
            decoder=engine.decoder,
            **job_extras(g.get("params") or {}, w, h),
        )
        row: dict[str, Any] = {
            "group": g.get("group"),
            "width": w,
            "height": h,
            "steps": params.steps,
            "batch_count": params.batch_count,
            "estimate": engine.estimate_for(*params.final_size, params.encodes),
        }
        if g.get("params"):
            row["params"] = g["params"]
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


def job_extras(extra: dict[str, Any], w: int, h: int) -> dict[str, Any]:
    """A generation's further job fields as JSON carries them: `init_image: "noise"` and
    `mask_image: "half"` become a seeded noise PNG and a mask whose left half is redrawn, both
    w x h (the stage's spec stays JSON; the pixels are made in the child)."""
    import io

    import numpy as np
    from PIL import Image

    def png(img: Image.Image) -> bytes:
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return buf.getvalue()

    out = dict(extra)
    if out.get("init_image") == "noise":
        rng = np.random.default_rng(7)
        out["init_image"] = png(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    if out.get("mask_image") == "half":
        mask = np.zeros((h, w), dtype=np.uint8)
        mask[:, : w // 2] = 255
        out["mask_image"] = png(Image.fromarray(mask, mode="L"))
    return out


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
