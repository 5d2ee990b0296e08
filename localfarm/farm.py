"""A whole farm on this machine: a private redis-server, the scheduler (and a standby) and one
worker process per local device, as `sdfarm up` and the tests run it.

Each part is a real subprocess (`python -m sdfarm.scheduler.service`, `python -m
sdfarm.worker.main`), exactly what a multi-host deployment runs, so the single-machine case
exercises the same code. The device list comes from the probe subprocess (the runtime must not
be initialised in a process that forks). Children run in their own sessions, so a Ctrl-C in
the terminal reaches only the owner, which stops them in order (workers, scheduler, Redis);
on Linux they also get SIGTERM if the owner dies without cleaning up.

The private redis-server keeps an AOF (everysec: a reply a client got is in the file, so a
killed server loses nothing acknowledged) and a generated password, which reaches the children
through the environment (never their command lines, which any local user can read) and the
0600 state file. A supervisor (localfarm/supervise.py) starts again whatever exits or freezes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from sdfarm.localfarm import state as farm_state
from sdfarm.localfarm.redis_server import RedisServer, _die_with_parent
from sdfarm.localfarm.supervise import Supervisor
from sdfarm.scheduler.metrics import PORT_ENV as SCHEDULER_METRICS_PORT_ENV
from sdfarm.worker.metrics import PORT_ENV as WORKER_METRICS_PORT_ENV


class LocalFarmError(RuntimeError):
    """A part of the local farm did not start (the message quotes its stderr)."""


def local_devices(figures: Any = None) -> list[str]:
    """The devices that get a worker: every GPU the probe reports (discrete, integrated or
    accelerator), else the CPU. The CPU is left out when there is a GPU: its cores feed the GPU
    workers, and a CPU worker would compete with them for memory and time."""
    if figures is None:
        from sdfarm.native.probe import read_host_figures

        figures = read_host_figures()
    gpus = [d.name for d in figures.devices if d.type in ("gpu", "igpu", "accel")]
    if gpus:
        return gpus
    cpus = [d.name for d in figures.devices if d.type == "cpu"]
    return cpus[:1] or ["CPU"]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class LocalFarm:
    """Start with `LocalFarm(dirs).start()` or `with LocalFarm(dirs) as farm:`; `farm.url` is
    the Redis URL to give `Farm(...)`."""

    def __init__(
        self,
        models_dirs: Sequence[str | os.PathLike[str]],
        devices: Sequence[str] | None = None,
        redis_url: str | None = None,
        threads: int | None = None,
        *,
        host: str | None = None,
        announce: bool = True,
        log_dir: str | os.PathLike[str] | None = None,
        ready_timeout: float = 120.0,
        grace: float = 10.0,
        worker_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        schedulers: int = 1,
        supervise: bool = True,
        on_event: Any = None,
        metrics_port: int | None = None,
        results: str | None = None,
        engines: int | str | None = None,
    ) -> None:
        self.models_dirs = [str(Path(d).resolve()) for d in models_dirs]
        self.devices = list(devices) if devices else []
        self.external_redis = redis_url
        self.threads = threads
        self.host = host or socket.gethostname()
        self.announce = announce
        self.ready_timeout = ready_timeout
        self.grace = grace
        self.worker_args = list(worker_args)
        if engines is not None:  # engine slots per worker (sdfarm worker --engines)
            self.worker_args += ["--engines", str(engines)]
        self.scheduler_args = list(scheduler_args)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # Several schedulers and workers share this host: one port from the environment
        # would collide. A local farm hands out its own (`metrics_port`) or none.
        for name in (SCHEDULER_METRICS_PORT_ENV, WORKER_METRICS_PORT_ENV):
            self.env.pop(name, None)
        if results:  # the workers' result store (sdfarm.store.results), by environment
            self.env["SDFARM_RESULTS"] = results
        self._own_logs = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.redis: RedisServer | None = None
        self.url = redis_url or ""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, list[str]] = {}
        self.logs: dict[str, Path] = {}
        self.started = 0.0
        self.schedulers = max(1, schedulers)
        self._redis_dir: Path | None = None
        self._on_event = on_event
        self.metrics_port = metrics_port
        self.supervisor = (
            Supervisor(self._children, self._restart, self._event) if supervise else None
        )

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> LocalFarm:
        if self.announce:
            running = farm_state.live_state()
            if running is not None:
                raise LocalFarmError(
                    f"a local farm is already running ({running.redis_url}, owner pid "
                    f"{int(running.pids['owner'][0])}); stop it first or use --redis"
                )
        if not self.devices:
            self.devices = local_devices()
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="sdfarm-farm-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        try:
            if not self.external_redis:
                self._redis_dir = Path(tempfile.mkdtemp(prefix="sdfarm-redis-"))
                self.redis = RedisServer.start(
                    password=secrets.token_urlsafe(24), appendonly=True, dir=self._redis_dir
                )
                self.url = self.redis.url
            self.env["SDFARM_REDIS_URL"] = self.url
            for n in range(self.schedulers):
                role = "scheduler" if n == 0 else f"scheduler:{n + 1}"
                self._spawn(
                    role,
                    ["-m", "sdfarm.scheduler.service", *self._metrics(n), *self.scheduler_args],
                )
            for device in self.devices:
                self._spawn(f"worker:{device}", self._worker_command(device))
            self._wait_ready()
            if self.announce:
                farm_state.write_state(self.state())
            if self.supervisor is not None:
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _children(self) -> dict[str, Any]:
        """What the supervisor watches: every child process, the private Redis included."""
        out: dict[str, Any] = dict(self.procs)
        if self.redis is not None:
            out["redis"] = self.redis.proc
        return out

    def _restart(self, role: str) -> None:
        """Start `role` again (the supervisor killed what was left of it)."""
        if role == "redis":
            assert self.redis is not None
            old = self.redis
            self.redis = RedisServer.start(
                port=old.port, password=old.password, appendonly=True, dir=self._redis_dir
            )
        else:
            self._spawn(role, self.commands[role])
        if self.announce:
            farm_state.write_state(self.state())

    def _event(self, kind: str, role: str, **info: Any) -> None:
        if self._on_event is not None:
            self._on_event(kind, role, **info)

    def _worker_command(self, device: str) -> list[str]:
        cmd = ["-m", "sdfarm.worker.main", "--device", device, "--host", self.host]
        for d in self.models_dirs:
            cmd += ["--models", d]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        return cmd + self._metrics(self.schedulers + self.devices.index(device)) + self.worker_args

    def _metrics(self, index: int) -> list[str]:
        """`--metrics-port` of the index-th child (schedulers first, then the workers in
        device order: `metrics_ports()`), on loopback (a local farm); none without
        `metrics_port`."""
        if self.metrics_port is None:
            return []
        return ["--metrics-port", str(self.metrics_port + index), "--metrics-addr", "127.0.0.1"]

    def metrics_ports(self) -> dict[str, int]:
        """{role: port} of every child's /metrics, from `metrics_port` up; {} without it."""
        if self.metrics_port is None:
            return {}
        roles = ["scheduler" if n == 0 else f"scheduler:{n + 1}" for n in range(self.schedulers)]
        roles += [f"worker:{d}" for d in self.devices]
        return {role: self.metrics_port + i for i, role in enumerate(roles)}

    def _spawn(self, role: str, args: list[str]) -> None:
        assert self.log_dir is not None
        self.commands[role] = args
        log = self.log_dir / (role.replace(":", "-") + ".log")
        with open(log, "ab") as out:
            self.procs[role] = subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.logs[role] = log

    def device_keys(self) -> dict[str, str]:
        """{device: its `{host}/{device}` key in the farm} for the workers started here."""
        from sdfarm.store.keys import device_key

        return {d: device_key(self.host, d) for d in self.devices}

    def _wait_ready(self) -> None:
        """Until every worker's heartbeat is in Redis; an exited child or the timeout is an
        error quoting that child's output."""
        from sdfarm.store import Store

        store = Store.connect(self.url)
        waiting = self.device_keys()
        deadline = time.monotonic() + self.ready_timeout
        try:
            while waiting:
                for role, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise LocalFarmError(
                            f"{role} exited with {proc.returncode} while the farm started:\n"
                            f"{_tail(self.logs[role])}"
                        )
                for device, key in list(waiting.items()):
                    if store.heartbeat(key) is not None:
                        del waiting[device]
                if not waiting:
                    break
                if time.monotonic() > deadline:
                    device = next(iter(waiting))
                    role = f"worker:{device}"
                    raise LocalFarmError(
                        f"no heartbeat from {role} within {self.ready_timeout:.0f} s "
                        f"(device {waiting[device]}):\n{_tail(self.logs[role])}"
                    )
                time.sleep(0.1)
        finally:
            store.close()

    # -- running -------------------------------------------------------------------------------

    def state(self) -> farm_state.LocalState:
        pids = {"owner": farm_state.pid_entry(os.getpid())}
        if self.redis is not None:
            pids["redis"] = farm_state.pid_entry(self.redis.pid)
        for role, proc in self.procs.items():
            pids[role] = farm_state.pid_entry(proc.pid)
        return farm_state.LocalState(
            redis_url=self.url,
            pids=pids,
            models_dirs=self.models_dirs,
            devices=self.devices,
            started=self.started,
        )

    def log_tail(self, role: str) -> str:
        return _tail(self.logs[role]) if role in self.logs else ""

    # -- stopping ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Workers first (they finish or abandon their job), then the scheduler, then Redis:
        SIGTERM, and SIGKILL to the whole process group after the grace period."""
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.announce:
            farm_state.remove_state(os.getpid())
        workers = [r for r in self.procs if r.startswith("worker:")]
        others = [r for r in self.procs if not r.startswith("worker:")]
        for group in (workers, others):
            for role in group:
                self._signal(self.procs[role], signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            for role in group:
                proc = self.procs[role]
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
                # Pool children (Celery prefork) share the group: make sure none outlives us.
                self._signal(proc, signal.SIGKILL, group=True)
                proc.wait()
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._redis_dir is not None:
            shutil.rmtree(self._redis_dir, ignore_errors=True)
            self._redis_dir = None
        if self._own_logs and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int, group: bool = False) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> LocalFarm:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
