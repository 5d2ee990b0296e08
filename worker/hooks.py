"""The worker process's life: what the Celery parent hands to each pool child, what the child
starts (threads only) and stops, and the test hooks.

The parent never initialises the runtime (a GPU driver does not survive a fork), so it only
probes figures in a subprocess and fills a `WorkerConfig`. Each prefork child builds its own
`Context` in `worker_process_init` (Redis client, engine cache, uploader, heartbeat and janitor
threads) and must return within Celery's 4 s limit, so nothing is loaded there: models load on
the first job that needs them. A child that ends itself (a cancel during generation) is
replaced by a fresh one with a new incarnation id and an empty cache.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sdfarm.native.devices import Device, HostFigures
from sdfarm.store import keys, transport
from sdfarm.store.retry import retry_transient
from sdfarm.worker import startmark

log = logging.getLogger("sdfarm.worker")

TEST_HOOKS_ENV = "SDFARM_TEST_HOOKS"


@dataclass
class WorkerConfig:
    """Everything a pool child needs, decided in the parent before the fork."""

    redis_url: str
    host: str
    device: Device  # as the host lists it (the heartbeat's figures)
    engine_device: str  # the name this process's runtime sees after pinning (CUDA: CUDA0)
    models: list[str]
    figures: HostFigures  # the host at startup, read in a subprocess
    memory_limit: int | None = None
    keep_alive: float = 300.0
    pins: list[str] = field(default_factory=list)
    threads: int | None = None
    backend: str | None = None
    engine_log_level: str = "info"
    celery_hostname: str = ""
    lora_dirs: list[str] = field(default_factory=list)  # besides each models dir's loras/
    upscaler_dirs: list[str] = field(default_factory=list)  # besides each one's upscalers/
    controlnet_dirs: list[str] = field(default_factory=list)  # besides each one's controlnets/
    embedding_dirs: list[str] = field(default_factory=list)  # besides each one's embeddings/
    results: str = "redis"  # where images go (sdfarm.store.results)
    engines: int = 1  # engine slots on the device: pool processes running jobs at once
    slots_dir: str | None = None  # the slots' shared folder (sdfarm.worker.slots), N > 1
    stop_file: str | None = None  # touched by the main process on SIGTERM (worker.chain)
    run_dir: str | None = None  # the worker's private folder: stop file, start marks
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the parent's, per start

    @property
    def device_key(self) -> str:
        return keys.device_key(self.host, self.device.name)

    @property
    def queue(self) -> str:
        return transport.queue_name(self.device_key)


_config: WorkerConfig | None = None
_context: Context | None = None


def configure(config: WorkerConfig) -> None:
    """Called in the parent before the pool forks; children inherit it."""
    global _config
    _config = config


def context() -> Context:
    """This process's context (started by worker_process_init, or lazily for the solo pool)."""
    global _context
    if _context is None or _context.pid != os.getpid():
        if _config is None:
            raise RuntimeError("the sdfarm worker is not configured (run sdfarm worker)")
        _context = Context(_config)
        _context.start()
    return _context


class Context:
    """One pool child's state: Redis, the engine cache, the uploader, the heartbeat."""

    def __init__(self, config: WorkerConfig) -> None:
        from sdfarm.native.catalog import Catalog
        from sdfarm.native.controlnets import ControlNetCatalog, controlnet_dirs
        from sdfarm.native.embeddings import EmbeddingCatalog, embedding_dirs
        from sdfarm.native.loras import LoraCatalog, lora_dirs
        from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs
        from sdfarm.store import Store
        from sdfarm.store.results import open_results
        from sdfarm.worker.engine_cache import EngineCache
        from sdfarm.worker.heartbeat import Heartbeat, cache_limits
        from sdfarm.worker.results import Uploader
        from sdfarm.worker.slots import Peers, SlotBoard, slot_index

        self.config = config
        self.pid = os.getpid()
        self.incarnation = uuid.uuid4().hex
        # N > 1 engine slots share the device (sdfarm.worker.slots): this process's slot,
        # the folder the slots share, and what its cache sees of the others.
        self.board = SlotBoard(config.slots_dir) if config.slots_dir else None
        self.slot = slot_index() if self.board else 0
        # Which job's run this process began last (a job claimed ahead: sdfarm.worker.chain).
        self.start_mark = startmark.for_slot(config.run_dir, self.slot, self.incarnation)
        self.worker_name = f"{config.celery_hostname or socket.gethostname()}:{self.pid}"
        # Writes of up to MAX_RESULT_BYTES need more than redis-py 8's default 5 s timeout.
        self.store = Store.connect(config.redis_url, health_check_interval=30, socket_timeout=60)
        self.catalog = Catalog(config.models)
        self.loras = LoraCatalog(lora_dirs(config.models, config.lora_dirs))
        self.upscalers = UpscalerCatalog(upscaler_dirs(config.models, config.upscaler_dirs))
        self.controlnets = ControlNetCatalog(controlnet_dirs(config.models, config.controlnet_dirs))
        self.embeddings = EmbeddingCatalog(embedding_dirs(config.models, config.embedding_dirs))
        capacity, overflow = cache_limits(config)
        self.cache = EngineCache(
            self._load_engine,
            capacity,
            keep_alive=config.keep_alive,
            pinned=set(config.pins),
            overflow_bytes=overflow,
            peers=Peers(self.board, self.slot) if self.board else None,
            on_change=self.publish_slot if self.board else None,
        )
        self.uploader = Uploader(
            self.store, config.device_key, results=open_results(config.results, self.store)
        )
        self.heartbeat = Heartbeat(self)
        self.state = "idle"
        self.current_job: str | None = None
        self.load_records: dict[str, list[dict[str, Any]]] = {}
        # name -> (job id or None, Model or UpscalerFile, estimate): what the loader loads
        self.load_requests: dict[str, tuple[str | None, Any, int]] = {}
        self.last_load: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._janitor = threading.Thread(target=self._expire_loop, name="sdfarm-janitor")
        self._janitor.daemon = True

    def start(self) -> None:
        # Its file first: no claim of this process may come before the heartbeat that the
        # scheduler checks claims against can list its incarnation.
        self.publish_slot()
        self._restore_held()
        self.uploader.start()
        self.heartbeat.start()
        self._janitor.start()
        if self.config.pins:
            threading.Thread(target=self._preload, name="sdfarm-preload", daemon=True).start()

    def _restore_held(self) -> None:
        """Settle what this slot's last process left (sdfarm.worker.chain), which may have
        died: the message it took goes back to the head of the queue, the job it claimed
        ahead is placed again, or charged as a run when its start mark says the run began,
        and the other jobs still running under it are spared an attempt: an abort is the
        marked job's (sdfarm.worker.startmark)."""
        try:
            began = self.start_mark.read()
            put_back, settled, spared = self.store.restore_held(
                self.config.device_key, str(self.slot), began
            )
            if put_back or settled or spared:
                log.warning(
                    "slot %d: settled what its last process left: message %s, job %s, "
                    "%d other job(s) spared",
                    self.slot, "put back" if put_back else "spent", settled or "none", spared,
                )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the scheduler re-places a lost job
            log.warning("slot %d: the held message not settled: %s", self.slot, exc)

    def stop(self) -> None:
        """Graceful end of this child: write every finished result, withdraw the heartbeat
        (the scheduler sees the device gone at once), free the engines."""
        self._stop.set()
        if self.board is not None:
            self.board.mark_stopping()
        self.uploader.flush(30.0)
        self.uploader.stop()
        self.heartbeat.stop(withdraw=True)
        self.cache.clear()

    @property
    def stopping(self) -> bool:
        """This process is shutting down (worker_process_shutdown ran)."""
        return self._stop.is_set()

    def set_state(self, state: str, job_id: str | None = None) -> None:
        self.state = state
        if state == "idle":
            self.current_job = None
        elif job_id is not None:
            self.current_job = job_id
        self.publish_slot()

    def publish_slot(self) -> None:
        """With N > 1 slots: this slot's file on the board (its engines, state, job), which
        the other slots' caches and the device's heartbeat read."""
        if self.board is None or not hasattr(self, "heartbeat"):
            return
        try:
            self.heartbeat.publish()
        except Exception as exc:  # noqa: BLE001 - the next beat writes it again
            log.warning("slot %d: its file not written: %s", self.slot, exc)

    def _load_engine(self, name: str) -> Any:
        """EngineCache's loader: loads the model (or upscaler) the current job resolved
        (through its catalog only) on this worker's pinned device, with events and timing for
        the job."""
        from sdfarm.native.engine import Engine, LogConfig
        from sdfarm.native.upscale import Upscaler
        from sdfarm.native.upscalers import UpscalerFile

        job_id, model, estimate = self.load_requests[name]
        previous = self.state
        self.set_state("loading", job_id)
        if job_id:
            retry_transient(
                lambda: self.store.push_event(job_id, "loading", model=name, estimate=estimate)
            )
        t0 = time.monotonic()
        # An upscale job's engine is an Upscaler (`model` is its checked file).
        kind = Upscaler if isinstance(model, UpscalerFile) else Engine
        try:
            engine = kind.load(
                model,
                device=self.config.engine_device,
                pinned=self.config.engine_device,
                log=LogConfig(level=self.config.engine_log_level),
                threads=self.config.threads,
                backend=self.config.backend,
            )
        finally:
            self.set_state(previous, job_id)
        load_s = time.monotonic() - t0
        self.load_records[name] = [r.as_dict() for r in engine.drain_load_records()]
        self.last_load = {
            "job": job_id,
            "model": name,
            "load_s": round(load_s - engine.warmup_seconds, 4),
            "warmup_s": round(engine.warmup_seconds, 4),
        }
        if job_id:
            timing = {k: self.last_load[k] for k in ("load_s", "warmup_s")}
            retry_transient(lambda: self.store.push_event(job_id, "loaded", model=name, **timing))
        return engine

    def request_engine(
        self, name: str, model: Any, estimate: int, job_id: str | None, need: int | None = None
    ) -> Any:
        """The engine for `model` (loaded under `name` when absent): EngineCache.get with
        what its loader needs. The caller releases it (`cache.release(name)`)."""
        self.load_requests[name] = (job_id, model, max(estimate, need or 0))
        try:
            return self.cache.get(name, estimate, need)
        finally:
            self.load_requests.pop(name, None)

    def _preload(self) -> None:
        """--pin: load pinned models in the background after start (never inside
        worker_process_init, which must return within seconds); jobs wait for the load lock."""
        from sdfarm.native.estimate import model_facts

        for name in self.config.pins:
            try:
                model = self.catalog.load(name)
                resident = model_facts(model, self.config.device).resident()
                self.request_engine(name, model, resident, None)
                self.cache.release(name)
            except Exception as exc:  # noqa: BLE001 - a bad pin is reported, jobs go on
                log.error("could not load pinned model %s: %s", name, exc)

    def _expire_loop(self) -> None:
        """Keep-alive expiry off the heartbeat thread: disposing waits for the runtime's lock,
        which a running generation holds, and a heartbeat must never wait that long."""
        period = max(0.5, min(5.0, self.config.keep_alive / 4))
        tick = 0.1 if self.board is not None else period  # other slots' evictions: at once
        last = time.monotonic()
        while not self._stop.wait(tick):
            try:
                if self.board is not None:
                    for name in self.cache.evict_requested(self.board.take_evictions(self.slot)):
                        self.load_records.pop(name, None)
                        log.info("slot %d: unloaded %s for another slot's load", self.slot, name)
                if time.monotonic() - last < period:
                    continue
                last = time.monotonic()
                for name in self.cache.expire():
                    self.load_records.pop(name, None)
                    log.info("unloaded %s after %.0f s idle", name, self.config.keep_alive)
            except Exception:  # noqa: BLE001 - the janitor must outlive one bad dispose
                log.exception("engine expiry failed")


# -- the pool process's start and stop (sdfarm.store.transport.on_pool_process) ------------


GIL_SWITCH_S = 0.0005
"""The job thread hands each result to the uploader thread while Celery's own bookkeeping
runs on the job thread; with Python's default 5 ms switch interval the uploader waited for
the GIL for milliseconds on the path of every result. Generation itself runs in native code
without the GIL, so a shorter interval costs nothing there."""


def on_process_init(**_: Any) -> None:
    """worker_process_init: start this child's threads (never load a model here)."""
    sys.setswitchinterval(GIL_SWITCH_S)
    context()


def on_process_shutdown(**_: Any) -> None:
    """worker_process_shutdown: nothing finished may be lost."""
    if _context is not None and _context.pid == os.getpid():
        try:
            _context.stop()
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.exception("worker shutdown")


# -- test hooks -------------------------------------------------------------------------------


def test_hooks_enabled(environ: dict[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(TEST_HOOKS_ENV) == "1"


def test_hook(spec: dict[str, Any], environ: dict[str, str] | None = None) -> str | None:
    """The job spec's `test_hook` ("abort" before its run, "abort-running" during it, after
    the lookahead took the next message, "abort-at-start" as the run of a job claimed ahead
    begins, before its start reaches Redis; "sleep:N" before the lookahead, "ahead-sleep:N"
    after it), but only when SDFARM_TEST_HOOKS=1 in the worker's environment; None
    otherwise, always."""
    if not test_hooks_enabled(environ):
        return None
    hook = spec.get("test_hook")
    return hook if isinstance(hook, str) and hook else None


def hook_sleep_seconds(hook: str | None) -> float:
    """N for "sleep:N" and "ahead-sleep:N", else 0."""
    if hook and hook.startswith(("sleep:", "ahead-sleep:")):
        try:
            return max(0.0, float(hook.split(":", 1)[1]))
        except ValueError:
            return 0.0
    return 0.0
