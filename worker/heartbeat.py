"""Heartbeats: what the scheduler knows about a device, refreshed every HEARTBEAT_INTERVAL.

The scheduler places jobs from these documents alone (no RPC to workers), so each carries the
device's figures, what the worker holds (loaded engines and their estimates) and every model
it can load with the facts needed for an estimate. A heartbeat that stops (TTL) means the
worker is gone; a new `incarnation` means its process was replaced and lost its running job.

The figures:
- capacity: the device's figure when our engines hold nothing, capped by --memory-limit. A GPU
  uses its figure read at startup (nothing was loaded yet); the CPU and integrated GPUs use
  MemAvailable now plus what our engines hold.
- compute_figure: capacity minus our loaded estimates (what a new model can use next to them).
- slow_figure: the slower path, for a GPU this device's remaining figure plus MemAvailable (the
  worker is pinned to one GPU, so the engine's own check counts only it), for the CPU the
  compute figure.

The device figures come from the parent's startup probe (a subprocess: querying a GPU would
initialise the driver); MemAvailable is re-read every beat, which is cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from sdfarm.native.devices import gpu_figure
from sdfarm.native.estimate import model_facts, upscaler_facts
from sdfarm.native.probe import mem_available
from sdfarm.native.videofile import encodable_formats
from sdfarm.store import keys

if TYPE_CHECKING:
    from sdfarm.worker.hooks import Context, WorkerConfig

log = logging.getLogger("sdfarm.worker")

MODELS_RESCAN_S = 10.0


def _uses_gpu_memory(device_type: str) -> bool:
    return device_type in ("gpu", "accel")


def _cap(value: int, limit: int | None) -> int:
    return value if limit is None else min(value, limit)


def device_figures(config: WorkerConfig, mem_avail: int | None, held: int) -> dict[str, int]:
    """capacity, compute_figure and slow_figure for this worker (see the module docstring)."""
    dev, limit = config.device, config.memory_limit
    mem = mem_avail or 0
    if _uses_gpu_memory(dev.type):
        figure = gpu_figure(dev)
        capacity = _cap(figure if figure is not None else mem, limit)
        compute = max(0, capacity - held)
        slow = compute + mem
        if limit is not None:
            slow = min(slow, max(0, limit - held))
    else:
        base = mem + held
        if dev.total > 0:
            base = min(base, dev.total)
        capacity = _cap(base, limit)
        compute = max(0, capacity - held)
        slow = compute
    return {"capacity": capacity, "compute_figure": compute, "slow_figure": slow}


def cache_limits(config: WorkerConfig) -> tuple[int, int | None]:
    """The engine cache's capacity and its overflow (the slower path a single big model may
    take on a GPU), from the startup figures."""
    figs = device_figures(config, config.figures.mem_available, 0)
    if _uses_gpu_memory(config.device.type) and figs["slow_figure"] > figs["capacity"]:
        return figs["capacity"], figs["slow_figure"]
    return figs["capacity"], None


def version() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from sdfarm.native.build import SOURCES

    try:
        ours = dist_version("sdfarm")
    except PackageNotFoundError:
        ours = "unknown"
    return {"sdfarm": ours, "sd": SOURCES["sd_version"]}


class ModelFacts:
    """{name: {"bytes", "native_size", "decode_per_pixel"}} for every model in the catalog,
    re-read only when a model's folder changes (headers of big models are not free to parse
    every second): `sdfarm.native.estimate.ModelFacts`, from which the scheduler makes a job's
    estimate exactly as this worker's engine would."""

    def __init__(self, catalog: Any, device: Any, loras: Any = None, upscalers: Any = None) -> None:
        self._catalog = catalog
        self._lora_catalog = loras
        self._upscaler_catalog = upscalers
        self.loras: dict[str, int] = {}
        self.upscalers: dict[str, dict[str, Any]] = {}
        self._device = device
        self._known: dict[str, tuple[float, dict[str, Any]]] = {}
        self.bad: dict[str, str] = {}
        self._scanned = 0.0
        self._facts: dict[str, dict[str, Any]] = {}

    def get(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        if self._scanned and now - self._scanned < MODELS_RESCAN_S:
            return self._facts
        self._scanned = now
        facts: dict[str, dict[str, Any]] = {}
        bad: dict[str, str] = {}
        for name in self._catalog.names():
            try:
                path = self._catalog.path(name)
                stamp = max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.iterdir()])
                known = self._known.get(name)
                if known is None or known[0] != stamp:
                    model = self._catalog.load(name)
                    known = (stamp, model_facts(model, self._device).as_json())
                    self._known[name] = known
                facts[name] = known[1]
            except Exception as exc:  # noqa: BLE001 - a broken model is reported, not fatal
                bad[name] = str(exc)
        self._facts, self.bad = facts, bad
        if self._lora_catalog is not None:
            self.loras = self._lora_catalog.sizes()
        if self._upscaler_catalog is not None:
            self.upscalers = {
                name: upscaler_facts(f.size, f.scale, self._device.name).as_json()
                for name, f in self._upscaler_catalog.all().items()
            }
        return facts


class Heartbeat:
    """A daemon thread in the process that runs jobs: the device's heartbeat (Store.beat) every
    HEARTBEAT_INTERVAL. It never waits on the runtime.

    It speaks for the whole worker, so it also watches the Celery main process that feeds this
    pool process its messages: when the main is gone (killed; this process was orphaned) this
    process ends, and while the main is frozen (SIGSTOP) no heartbeat is written, so the device
    expires and the scheduler re-places its jobs instead of sending more to a queue nobody
    reads."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._publish_lock = threading.Lock()
        self._models = ModelFacts(ctx.catalog, ctx.config.device, ctx.loras, ctx.upscalers)
        self._version = version()
        self._thread = threading.Thread(target=self._run, name="sdfarm-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, withdraw: bool = False) -> None:
        self._stop.set()
        self._thread.join(5)
        if withdraw:
            with contextlib.suppress(Exception):  # Redis may be gone at shutdown
                self._ctx.store.withdraw(self._ctx.config.device_key)

    def payload(self, held: int | None = None) -> dict[str, Any]:
        ctx, cfg = self._ctx, self._ctx.config
        dev = cfg.device
        mem = mem_available()
        held = ctx.cache.held_bytes() if held is None else held
        state = ctx.state
        if ctx.cache.loading:
            state = "loading"
        return {
            "host": cfg.host,
            "device": dev.name,
            "key": cfg.device_key,
            "backend": _backend_family(dev.name),
            "type": dev.type,
            "description": dev.description,
            "free": dev.free,
            "total": dev.total,
            **device_figures(cfg, mem, held),
            "mem_available": mem,
            "loaded": ctx.cache.snapshot(),
            "loading": ctx.cache.loading,
            "models": self._models.get(),
            "bad_models": self._models.bad,
            "loras": self._models.loras,
            "upscalers": self._models.upscalers,
            # ControlNets ({name: bytes as loaded}) and embeddings ({name: bytes}): the
            # scheduler adds them to an engine key's model (sdfarm.native.enginekey).
            "controlnets": {n: f.resident_bytes for n, f in ctx.controlnets.all().items()},
            "embeddings": ctx.embeddings.sizes(),
            # The video files this worker can encode (mp4 needs the `video` extra): Farm.video
            # refuses a format a worker with the model lacks.
            "video_formats": encodable_formats(),
            "queue": ctx.store.queue_length(cfg.device_key),
            "state": state,
            "current_job": ctx.current_job,
            "unwritten": unwritten_of(ctx.uploader),
            "version": self._version,
            "incarnation": ctx.incarnation,
            "pid": os.getpid(),
            "memory_limit": cfg.memory_limit,
            "keep_alive": cfg.keep_alive,
            "slots": cfg.engines,
            "ts": time.time(),
        }

    def slot_doc(self) -> dict[str, Any]:
        """This pool process's part of the device (its slot's file, sdfarm.worker.slots)."""
        ctx = self._ctx
        loading = ctx.cache.loading
        return {
            "slot": ctx.slot,
            "pid": os.getpid(),
            "incarnation": ctx.incarnation,
            "state": "loading" if loading else ctx.state,
            "current_job": ctx.current_job,
            "loaded": [{**e, "slot": ctx.slot} for e in ctx.cache.snapshot()],
            "loading": loading,
            "loading_estimate": ctx.cache.loading_estimate if loading else 0,
            "held": ctx.cache.held_bytes(),
            "unwritten": unwritten_of(ctx.uploader),
        }

    def publish(self) -> dict[str, Any]:
        """Write this slot's file now (N > 1), made and written under one lock: the job
        thread and this thread both write it, and an older document must never land after a
        newer one (another slot's load would not count an engine just loaded)."""
        with self._publish_lock:
            doc = self.slot_doc()
            self._ctx.board.write(self._ctx.slot, doc)
            return doc

    def device_payload(self, slots: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The device's heartbeat made of every live slot's document (N > 1): the engines and
        loads of all slots against the one figure, the worker's incarnation (a replaced slot
        is not a restart of the device) and the live slots' incarnations (what a running
        job's claim is checked against)."""
        cfg = self._ctx.config
        doc = self.payload(held=sum(int(d.get("held") or 0) for d in slots.values()))
        order = [slots[i] for i in sorted(slots)]
        states = {d.get("state") for d in order}
        jobs = [d["current_job"] for d in order if d.get("current_job")]
        loading = next((d["loading"] for d in order if d.get("loading")), None)
        unwritten: dict[str, Any] = {}
        for d in order:
            unwritten.update(d.get("unwritten") or {})
        doc.update(
            loaded=sorted(
                (e for d in order for e in d.get("loaded") or []),
                key=lambda e: (e.get("name", ""), e.get("slot", 0)),
            ),
            loading=loading,
            state="busy" if "busy" in states else "loading" if loading else "idle",
            current_job=jobs[0] if jobs else None,
            current_jobs=jobs,
            unwritten=dict(list(unwritten.items())[:20]),
            incarnation=cfg.worker_id,
            incarnations=[d.get("incarnation") for d in order],
            pid=self._parent,
            pids=[d.get("pid") for d in order],
        )
        return doc

    def beat(self) -> None:
        ctx = self._ctx
        if ctx.board is None:
            ctx.store.beat(ctx.config.device_key, self.payload(), keys.HEARTBEAT_TTL)
            return
        own = self.publish()
        slots = ctx.board.live()
        slots[ctx.slot] = own
        if min(slots) != ctx.slot or ctx.board.stopping:
            return  # the lowest live slot speaks for the device
        ctx.store.beat(ctx.config.device_key, self.device_payload(slots), keys.HEARTBEAT_TTL)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            if os.getppid() != self._parent:
                log.error("the worker's main process %d is gone: ending", self._parent)
                with contextlib.suppress(Exception):
                    self._ctx.store.withdraw(self._ctx.config.device_key)
                os._exit(1)
            try:
                if not _stopped(self._parent):
                    self.beat()
            except Exception as exc:  # noqa: BLE001 - keep beating through Redis restarts
                log.warning("heartbeat failed: %s", exc)
            self._stop.wait(max(0.05, keys.HEARTBEAT_INTERVAL - (time.monotonic() - t)))


def _stopped(pid: int) -> bool:
    """True when process `pid` is stopped (SIGSTOP, a debugger): it reads no messages."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _backend_family(device_name: str) -> str:
    """ "Vulkan1" -> "Vulkan", "CUDA0" -> "CUDA", "CPU" -> "CPU"."""
    return device_name.rstrip("0123456789") or device_name


def unwritten_of(uploader: Any) -> dict[str, str]:
    """Up to 20 jobs whose end the uploader still holds, with why."""
    from sdfarm.worker.results import KEPT_WHOLE

    return {j: e or KEPT_WHOLE for j, (_, e) in list(uploader.unwritten.items())[:20]}
