"""A local CPU farm and the gateway served by uvicorn in a thread, for the gateway tests."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_farm(models_dir: Path, host: str, *, test_hooks: bool = False) -> Iterator[Any]:
    """A LocalFarm with one CPU worker (one thread, 4 GiB) named `host`; `test_hooks`: its
    worker honours the jobs' test hooks (sdfarm.worker.hooks)."""
    from sdfarm.localfarm.farm import LocalFarm

    env = dict(os.environ)
    if test_hooks:
        env["SDFARM_TEST_HOOKS"] = "1"
    farm = LocalFarm(
        [models_dir],
        devices=["CPU"],
        threads=1,
        host=host,
        announce=False,
        worker_args=["--memory-limit", "4GiB"],
        env=env,
    )
    with farm:
        yield farm


@contextlib.contextmanager
def served_gateway(
    redis_url: str, tokens: Sequence[str], timeout_s: float, **options: Any
) -> Iterator[str]:
    """The gateway app on a free loopback port (`options`: more of create_app's arguments);
    yields its base URL."""
    import uvicorn

    from sdfarm.gateway import create_app

    port = free_port()
    app = create_app(redis_url, tokens=list(tokens), timeout_s=timeout_s, **options)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.farm.close()
