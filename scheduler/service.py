"""`sdfarm scheduler`: the dispatch loop as leader, or a standby waiting for the lease.

Run as many as you like (one per host for failover); exactly one dispatches, and only its
webhook deliverer (a thread of every service, sdfarm.scheduler.webhooks) sends. SIGTERM and
SIGINT finish the current cycle, release the lease (a standby takes over within half a second
instead of waiting out the TTL) and exit 0. With --json every state change is one JSON line on
stdout (`leader`, `standby`, `requeued`, `poisoned`, `refused`, `stopped`, ...); otherwise the
same lines are human text on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from sdfarm.scheduler.dispatch import DispatchConfig, Dispatcher, NotLeader
from sdfarm.scheduler.leader import DEFAULT_TTL_MS, STANDBY_RETRY_S, LeaderLock
from sdfarm.scheduler.metrics import DEFAULT_PORT, SchedulerMetrics, default_port
from sdfarm.scheduler.registry import DEFAULT_BACKLOG, DEFAULT_QUEUE_LIMIT
from sdfarm.scheduler.webhooks import TIMEOUT_S, Deliverer
from sdfarm.scheduler.webhooks import start as start_webhooks
from sdfarm.store import Store
from sdfarm.store.transport import CeleryOutbox

QUIET_KINDS = frozenset({"placed"})
"""Shown only with --verbose: one line per job would drown the rest on a busy farm."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis",
        default=os.environ.get("SDFARM_REDIS_URL"),
        help="the farm's Redis URL (default $SDFARM_REDIS_URL)",
    )
    p.add_argument(
        "--queue-limit",
        type=int,
        default=DEFAULT_QUEUE_LIMIT,
        help=f"jobs that may wait before submit says busy (default {DEFAULT_QUEUE_LIMIT})",
    )
    p.add_argument(
        "--backlog",
        type=int,
        default=DEFAULT_BACKLOG,
        help=f"jobs sent to one device ahead of completion (default {DEFAULT_BACKLOG})",
    )
    p.add_argument(
        "--lease-ms",
        type=int,
        default=DEFAULT_TTL_MS,
        help=f"leader lease; a dead leader is replaced after it (default {DEFAULT_TTL_MS})",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=default_port(),
        metavar="PORT",
        help="serve Prometheus /metrics on PORT (deploy/ uses "
        f"{DEFAULT_PORT}; default $SDFARM_SCHEDULER_METRICS_PORT, else off)",
    )
    p.add_argument(
        "--metrics-addr",
        default="0.0.0.0",
        help="the address /metrics listens on (default 0.0.0.0)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also log every placement")
    p.add_argument("--json", action="store_true", help="one JSON line per event on stdout")


class Service:
    """The loop with its lease; `run()` blocks until `stop()` (or a signal)."""

    def __init__(
        self,
        redis_url: str,
        config: DispatchConfig | None = None,
        *,
        lease_ms: int = DEFAULT_TTL_MS,
        json_lines: bool = False,
        verbose: bool = False,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.url = redis_url
        self.metrics = metrics or SchedulerMetrics()
        self.store = Store.connect(redis_url, socket_timeout=10, socket_connect_timeout=5)
        self.config = config or DispatchConfig()
        self.lock = LeaderLock(self.store, ttl_ms=lease_ms)
        self.json_lines = json_lines
        self.verbose = verbose
        self.stopping = threading.Event()
        self._dispatcher: Dispatcher | None = None
        self._role = ""
        # Every scheduler runs a deliverer; its take is fenced, so only the leader's sends.
        self.webhooks = Deliverer(self.store, lambda: self.lock.token, log=self.emit)

    def emit(self, kind: str, **fields: Any) -> None:
        self.metrics.events.labels(kind).inc()
        if kind in QUIET_KINDS and not self.verbose:
            return
        doc = {"event": kind, "t": round(time.time(), 3), "scheduler": self.lock.token, **fields}
        if self.json_lines:
            sys.stdout.write(json.dumps(doc, default=str) + "\n")
            sys.stdout.flush()
        else:
            rest = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"sdfarm scheduler {self.lock.token}: {kind} {rest}".rstrip(), file=sys.stderr)

    def _become(self, role: str, **fields: Any) -> None:
        if role != self._role:
            self._role = role
            self.metrics.leader.set(1 if role == "leader" else 0)
            self.emit(role, **fields)

    def dispatcher(self) -> Dispatcher:
        """Built on first leadership: the Celery app connects to the broker lazily."""
        if self._dispatcher is None:
            outbox = CeleryOutbox.for_farm(self.store.r, self.url)
            self._dispatcher = Dispatcher(
                self.store, self.lock.token, outbox, self.config, log=self.emit
            )
        return self._dispatcher

    def step(self) -> None:
        """One turn: acquire or renew the lease, then wait for work and run one cycle."""
        if not self.lock.held:
            if not self.lock.acquire():
                self._become("standby", leader=self.lock.holder())
                self.stopping.wait(STANDBY_RETRY_S)
                return
            if self.lock.fresh or self._role != "leader":  # not a mere local-deadline renewal
                self._role = ""
                self._become(
                    "leader", queue_limit=self.config.queue_limit, backlog=self.config.backlog
                )
                self.dispatcher().start()
        self.dispatcher().wait_for_work()
        if not self.lock.renew_if_due():
            self._become("standby", reason="lease lost")
            return
        with self.metrics.cycle.time():
            self.dispatcher().cycle()

    def run(self) -> int:
        import redis

        webhooks = start_webhooks(
            self.webhooks,
            self.stopping,
            on_error=lambda exc: self.emit("redis-error", error=str(exc), part="webhooks"),
        )
        try:
            while not self.stopping.is_set():
                try:
                    self.step()
                except NotLeader:
                    self.metrics.leader.set(0)
                    self.lock.release()
                    self._become("standby", reason="another scheduler holds the lease")
                except redis.RedisError as exc:  # away, or refusing writes (full): wait
                    self.emit("redis-error", error=str(exc))
                    self.metrics.leader.set(0)
                    self._role = ""
                    self.stopping.wait(STANDBY_RETRY_S)
        finally:
            self.stopping.set()
            webhooks.join(TIMEOUT_S + 1)  # a try in flight ends within its timeout
            with contextlib.suppress(redis.RedisError):
                self.lock.release()  # compare-and-delete: a no-op unless the lease is ours
            self.metrics.leader.set(0)
            self.emit("stopped")
            self.store.close()
        return 0

    def stop(self, *_: Any) -> None:
        self.stopping.set()


def run(args: argparse.Namespace) -> int:
    if not args.redis:
        print("error: give --redis URL (or set SDFARM_REDIS_URL)", file=sys.stderr)
        return 2
    try:
        config = DispatchConfig(backlog=args.backlog, queue_limit=args.queue_limit)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    service = Service(
        args.redis,
        config,
        lease_ms=args.lease_ms,
        json_lines=args.json,
        verbose=args.verbose,
    )
    if args.metrics_port:
        service.metrics.serve(args.metrics_port, args.metrics_addr)
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    return service.run()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="sdfarm scheduler", description="place jobs on the farm's devices"
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
