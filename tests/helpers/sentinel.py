"""A Redis that fails over, for tests: a master, a replica and sentinels, each a real
redis-server process (`redis-server CONF --sentinel` is Redis Sentinel: the same binary
sdfarm.localfarm.redis_server finds, so no separate package is needed)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from sdfarm.localfarm.redis_server import RedisServer, _die_with_parent, find_binary, free_port

SERVICE = "sdfarm"


class SentinelGroup:
    """`SentinelGroup.start(dir)`: master + replica + `n` sentinels watching SERVICE with a
    quorum of 1 and a `down_after_ms` down-after (1 s: a killed master is replaced within a few
    seconds; longer than the workers' heartbeat TTL: every heartbeat expires meanwhile)."""

    def __init__(self, master: RedisServer, replica: RedisServer, sentinels: list[tuple]) -> None:
        self.master = master
        self.replica = replica
        self.sentinels = sentinels  # (Popen, port)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for _, port in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    @classmethod
    def start(cls, workdir: Path, n: int = 2, down_after_ms: int = 1000) -> SentinelGroup:
        master = RedisServer.start(appendonly=True, dir=workdir / "master")
        replica = RedisServer.start(appendonly=True, dir=workdir / "replica")
        replica.client().replicaof("127.0.0.1", master.port)
        group = cls(master, replica, [])
        try:
            for i in range(n):
                group.sentinels.append(
                    _start_sentinel(workdir / f"sentinel{i}", master.port, down_after_ms)
                )
            group.wait(lambda: _linked(replica), "the replica to sync")
            group.wait(lambda: group.master_port() == master.port, "the sentinels to agree")
        except BaseException:
            group.stop()
            raise
        return group

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers says, None if none does."""
        for _, port in self.sentinels:
            try:
                client = redis.Redis(port=port, socket_timeout=1)
                try:
                    addr = client.sentinel_get_master_addr_by_name(SERVICE)
                finally:
                    client.close()
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        return None

    @staticmethod
    def wait(ok, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc, _ in self.sentinels:
            proc.terminate()
        for proc, _ in self.sentinels:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.replica.stop()
        self.master.stop()


def _linked(replica: RedisServer) -> bool:
    info = replica.client().info("replication")
    return info.get("master_link_status") == "up"


def _start_sentinel(
    workdir: Path, master_port: int, down_after_ms: int
) -> tuple[subprocess.Popen[bytes], int]:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = workdir / "sentinel.conf"  # sentinels rewrite their config: it must be writable
    conf.write_text(
        f'port {port}\nbind 127.0.0.1\ndaemonize no\ndir "{workdir}"\n'
        'logfile "sentinel.log"\n'
        f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 1\n"
        f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SERVICE} {3 * down_after_ms}\n"
        f"sentinel parallel-syncs {SERVICE} 1\n"
    )
    proc = subprocess.Popen(
        [find_binary(), str(conf), "--sentinel"],
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,  # a killed test run leaves no sentinel behind
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                client.ping()
                return proc, port
            finally:
                client.close()
        except redis.RedisError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = workdir / "sentinel.log"
                text = log.read_text(errors="replace") if log.exists() else ""
                proc.kill()
                raise RuntimeError(f"redis sentinel did not start: {text[-2000:]}") from None
            time.sleep(0.05)
