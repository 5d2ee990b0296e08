"""The local farm as a user runs it: `sdfarm up` in the foreground, then other `sdfarm`
commands that find it through the state file (or $SDFARM_REDIS_URL), then Ctrl-C.

Real processes throughout: redis-server, the scheduler service, a worker per device with the
real runtime and the tiny model. The state file lives in a private $XDG_RUNTIME_DIR so these
tests never see (or clobber) a farm the developer is running.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis

from sdfarm.store import Store

pytestmark = pytest.mark.e2e

SMALL = ["--width", "64", "--height", "64", "--steps", "1"]


def one_json(out: str) -> dict:
    """stdout must be exactly one JSON document."""
    doc, end = json.JSONDecoder().raw_decode(out)
    assert out[end:].strip() == "", f"more than one document on stdout: {out[end:]!r}"
    return doc


def sdfarm(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def private_env(runtime_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SDFARM_REDIS_URL", "SDFARM_MODELS")}
    env["XDG_RUNTIME_DIR"] = str(runtime_dir)
    return env


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise AssertionError(f"`sdfarm up` said nothing in {timeout} s: {proc.stderr.read()}")
    return proc.stdout.readline()


@pytest.fixture(scope="module")
def up(models_dir, tmp_path_factory):
    """`sdfarm up --json` running in the foreground; stopped with Ctrl-C (SIGINT) at the end,
    which must end every process it started and remove its announcement."""
    runtime = tmp_path_factory.mktemp("runtime")
    runtime.chmod(0o700)
    env = private_env(runtime)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdfarm.cli.main", "up", "--models", str(models_dir)]
        + ["--json", "--log-dir", str(runtime / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = read_line(proc, 120)
    assert line, f"`sdfarm up` exited {proc.wait()}: {proc.stderr.read()}"
    doc = json.loads(line)
    yield {"doc": doc, "env": env, "runtime": runtime, "proc": proc}
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, proc.stderr.read()
    assert proc.stdout.read() == "", "stdout must hold only the one document"
    assert not (runtime / "sdfarm" / "local.json").exists()
    time.sleep(0.2)
    alive = [p for p in doc["pids"].values() if psutil.pid_exists(p)]
    alive = [p for p in alive if psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes left behind: {alive}"


def test_up_announces_the_farm_in_the_state_file(up):
    doc = up["doc"]
    url = urlsplit(doc["redis_url"])
    assert (url.scheme, url.hostname) == ("redis", "127.0.0.1") and len(url.password) >= 24
    assert doc["devices"] == ["CPU"]
    state_file = up["runtime"] / "sdfarm" / "local.json"
    assert doc["state_file"] == str(state_file)
    assert oct(state_file.parent.stat().st_mode & 0o777) == "0o700"
    assert oct(state_file.stat().st_mode & 0o777) == "0o600"  # it holds the password
    state = json.loads(state_file.read_text())
    assert state["redis_url"] == doc["redis_url"]
    assert {"owner", "redis", "scheduler", "scheduler:2", "worker:CPU"} <= set(state["pids"])
    client = redis.Redis.from_url(doc["redis_url"])
    assert client.ping() and client.config_get("appendonly") == {"appendonly": "yes"}
    with pytest.raises(redis.AuthenticationError):  # another local user has no password
        redis.Redis(host=url.hostname, port=url.port).ping()
    for pid in (int(p[0]) for role, p in state["pids"].items() if role != "owner"):
        # The password reaches the children through the environment, never their arguments.
        assert url.password not in Path(f"/proc/{pid}/cmdline").read_text()


def test_generate_without_in_process_uses_the_running_farm(up, tmp_path):
    out = tmp_path / "farm.png"
    done = sdfarm(
        "generate", "a red kite", "--model", "tiny-q8_0", "-o", str(out), "--seed", "5",
        *SMALL, "--json", env=up["env"],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = one_json(done.stdout)
    assert doc["redis_url"] == up["doc"]["redis_url"]  # found through the state file
    assert "starting a local one" not in done.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
    store = Store.connect(up["doc"]["redis_url"])
    assert store.state(doc["job"]) == "done"
    store.close()


def test_sdfarm_redis_url_wins_over_the_state_file(up, tmp_path):
    env = {**up["env"], "SDFARM_REDIS_URL": up["doc"]["redis_url"]}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # no state file there
    done = sdfarm(
        "generate", "a blue kite", "--model", "tiny-f16", "-o", str(tmp_path / "b.png"),
        *SMALL, "--json", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert one_json(done.stdout)["redis_url"] == up["doc"]["redis_url"]


def test_status_json_shows_the_worker_and_the_loaded_model(up, tmp_path):
    sdfarm("generate", "warm", "--model", "tiny-q8_0", "-o", str(tmp_path / "w.png"), *SMALL,
           env=up["env"])  # fmt: skip
    done = sdfarm("status", "--json", env=up["env"])
    assert done.returncode == 0, done.stderr
    text = done.stdout
    status = one_json(text)
    assert "CPU" in text and "tiny-q8_0" in text, status
    human = sdfarm("status", env=up["env"])
    assert human.returncode == 0 and "CPU" in human.stdout and "tiny-q8_0" in human.stdout


def test_models_and_cancel_json(up):
    done = sdfarm("models", "--json", env=up["env"])
    assert done.returncode == 0, done.stderr
    assert {"tiny-f16", "tiny-q8_0"} <= set(json.dumps(one_json(done.stdout)).split('"'))
    done = sdfarm("cancel", "0" * 32, "--json", env=up["env"])
    assert done.returncode == 1
    assert "no job" in one_json(done.stdout)["error"]["message"]


def test_a_second_up_refuses_while_the_first_runs(up, models_dir):
    done = sdfarm("up", "--models", str(models_dir), "--json", env=up["env"], timeout=60)
    assert done.returncode != 0
    assert "already running" in one_json(done.stdout)["error"]["message"]


def test_commands_without_a_farm_say_how_to_start_one(tmp_path):
    env = private_env(tmp_path)
    done = sdfarm("status", "--json", env=env)
    assert done.returncode != 0
    assert "sdfarm up" in one_json(done.stdout)["error"]["message"]


def test_localfarm_api_starts_and_stops_everything(models_dir, tmp_path, monkeypatch):
    from sdfarm.localfarm.farm import LocalFarm
    from sdfarm.localfarm.redis_server import port_is_free
    from sdfarm.localfarm.state import find_redis_url, state_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("SDFARM_REDIS_URL", raising=False)
    with LocalFarm([models_dir], threads=1) as farm:
        assert state_path().is_file()
        assert find_redis_url(None) == farm.url
        pids = [p.pid for p in farm.procs.values()] + [farm.redis.pid]
        port = farm.redis.port
        hb = redis.Redis.from_url(farm.url).get("sdfarm:hb:" + f"{farm.host}/CPU")
        assert hb is not None
    assert not state_path().exists()
    assert find_redis_url(None) is None
    assert port_is_free(port)
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_a_worker_that_cannot_start_is_an_error_quoting_its_output(models_dir, tmp_path):
    from sdfarm.localfarm.farm import LocalFarm, LocalFarmError

    farm = LocalFarm([models_dir], devices=["NoSuchDevice9"], announce=False, ready_timeout=60)
    with pytest.raises(LocalFarmError, match="worker:NoSuchDevice9") as info:
        farm.start()
    assert farm.redis is None and farm.procs == {}  # everything it started is stopped
    print(info.value)


def test_cancel_a_queued_and_a_running_job(up):
    from sdfarm.client.farm import Farm, JobCancelled

    farm = Farm(up["doc"]["redis_url"])
    running = farm.submit("tiny-q8_0", "slow", width=512, height=512, steps=40, priority=0)
    queued = farm.submit("tiny-q8_0", "waiting", width=64, height=64, steps=1, priority=0)
    deadline = time.monotonic() + 30
    while running.state() != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    for job in (queued, running):
        done = sdfarm("cancel", job.id, "--json", env=up["env"])
        assert done.returncode == 0, done.stderr
        doc = one_json(done.stdout)
        assert doc["id"] == job.id and doc["cancelled"] is True
    for job in (queued, running):
        with pytest.raises(JobCancelled):
            job.result(60)
    again = sdfarm("cancel", running.id, env=up["env"])
    assert again.returncode == 0 and "already cancelled" in again.stdout


def test_a_stale_state_file_is_ignored(tmp_path, monkeypatch):
    from sdfarm.localfarm.state import LocalState, find_redis_url, pid_entry, write_state

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("SDFARM_REDIS_URL", raising=False)
    url = "redis://127.0.0.1:1/0"
    me = pid_entry(os.getpid())
    write_state(LocalState(url, pids={"owner": me}))
    assert find_redis_url(None) == url
    assert find_redis_url("redis://explicit") == "redis://explicit"
    monkeypatch.setenv("SDFARM_REDIS_URL", "redis://from-env")
    assert find_redis_url(None) == "redis://from-env"
    monkeypatch.delenv("SDFARM_REDIS_URL")
    # A pid reused by another process (other start time), or a dead one: stale.
    write_state(LocalState(url, pids={"owner": [os.getpid(), me[1] - 100]}))
    assert find_redis_url(None) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_state(LocalState(url, pids={"owner": me, "scheduler": [dead.pid, 0.0]}))
    assert find_redis_url(None) is None
    assert oct((tmp_path / "sdfarm").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "sdfarm" / "local.json").stat().st_mode & 0o777) == "0o600"
