"""Webhooks on a real farm: redis-server, two scheduler services (a leader and a standby,
each running a deliverer), a CPU worker with the real runtime and the tiny model, and a
receiver: an HTTP server on 127.0.0.1 in this test. The farm's processes and the submitting
CLI allow 127.0.0.1 ($SDFARM_WEBHOOK_ALLOW_PRIVATE) and share a secret
($SDFARM_WEBHOOK_SECRET); this test process keeps the default policy, so its own submits
show the refusal.

- a job's webhook arrives once (not once per scheduler), signed, and verifies with
  sdfarm.client.webhooks.verify;
- a receiver that answers 500 twice gets the same event a third time, after the backoff;
- a webhook to 10.0.0.1 or 127.0.0.1 is refused at submit under the default policy, at
  every door (Farm.submit, the gateway's jobs JSON, the CLI), naming `webhook`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from sdfarm.client.farm import Farm
from sdfarm.client.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, verify
from sdfarm.native.errors import InvalidParameterError
from sdfarm.store import Store

from helpers.gateway import served_gateway

pytestmark = pytest.mark.e2e

SECRET = "whsec-e2e-8c1d0f"
MODEL = "tiny-f16"
PROMPT = "a kite that must not leave the farm"
SMALL = ["--width", "64", "--height", "64", "--steps", "1"]
ALLOW = "SDFARM_WEBHOOK_ALLOW_PRIVATE"


class Receiver:
    """An HTTP server on 127.0.0.1 that records every POST (time, headers, body) and answers
    with the statuses of `answers` in turn (200 once they are used up)."""

    def __init__(self, answers: list[int] | None = None) -> None:
        self.answers = list(answers or [])
        self.got: list[tuple[float, dict[str, str], bytes]] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = receiver.answers.pop(0) if receiver.answers else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()
                with receiver.arrived:
                    receiver.got.append((time.monotonic(), dict(self.headers.items()), body))
                    receiver.arrived.notify_all()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/sdfarm?x=1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, n: int, timeout: float) -> list[tuple[float, dict[str, str], bytes]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.got) >= n, timeout), (
                f"{len(self.got)} of {n} webhooks arrived in {timeout} s"
            )
            return list(self.got)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def farm(models_dir: Path) -> Iterator[Any]:
    from sdfarm.localfarm.farm import LocalFarm

    env = {**os.environ, ALLOW: "127.0.0.1", "SDFARM_WEBHOOK_SECRET": SECRET}
    with LocalFarm(
        [models_dir],
        devices=["CPU"],
        threads=1,
        host="hooks",
        announce=False,
        worker_args=["--memory-limit", "4GiB"],
        env=env,
        schedulers=2,  # a leader and a standby: only the leader's deliverer sends
    ) as f:
        yield f


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def generate(farm: Any, tmp_path: Path, webhook: str, *, allow: bool = True) -> Any:
    """`sdfarm generate --webhook URL` on the farm, as its user would run it."""
    env = {**os.environ, "SDFARM_REDIS_URL": farm.url}
    env.pop(ALLOW, None)
    if allow:
        env[ALLOW] = "127.0.0.1"
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "generate", PROMPT, "--model", MODEL,
         "-o", str(tmp_path / "out.png"), *SMALL, "--webhook", webhook, "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def webhook_events(store: Store, job_id: str, n: int, timeout: float = 10) -> list[dict]:
    """The job's `webhook` events, once there are `n` (the settle follows the answer)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [e for e in store.events(job_id) if e["event"] == "webhook"]
        if len(events) >= n or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def test_a_webhook_arrives_signed_and_verifies(farm: Any, receiver: Receiver, tmp_path) -> None:
    done = generate(farm, tmp_path, receiver.url)
    assert done.returncode == 0, done.stderr
    job_id = json.loads(done.stdout)["job"]
    [(_, headers, body)] = receiver.wait_for(1, timeout=30)
    verify(SECRET, headers, body)  # raises WebhookSignatureError otherwise
    with pytest.raises(ValueError):
        verify(SECRET, headers, body.replace(b'"done"', b'"failed"'))
    event = json.loads(body)
    assert event["id"] == headers[DELIVERY_HEADER] == f"whd_{job_id}"
    assert event["type"] == "job.done" and headers["Content-Type"] == "application/json"
    job = event["job"]
    assert (job["id"], job["state"], job["model"], job["images"]) == (job_id, "done", MODEL, 1)
    assert job["error"] == "" and job["created"] <= job["started"] <= job["ended"]
    assert PROMPT not in body.decode() and "prompt" not in job  # log_prompts was not given
    store = Store.connect(farm.url)
    try:
        [settled] = webhook_events(store, job_id, 1)
        assert (settled["outcome"], settled["tries"], settled["status"]) == ("delivered", 1, 200)
        assert store.record(job_id)["webhook_state"] == "delivered"
        assert job_id not in store.webhooks_queued()
    finally:
        store.close()
    time.sleep(1.5)  # a delivered event is not sent again
    assert len(receiver.got) == 1


def test_a_receiver_failing_twice_gets_it_on_the_third_try(farm: Any, tmp_path) -> None:
    receiver = Receiver(answers=[500, 500])
    try:
        done = generate(farm, tmp_path, receiver.url)
        assert done.returncode == 0, done.stderr
        job_id = json.loads(done.stdout)["job"]
        got = receiver.wait_for(3, timeout=60)
    finally:
        receiver.close()
    assert len(got) == 3
    ids = {json.loads(body)["id"] for _, _, body in got}
    assert ids == {f"whd_{job_id}"}  # one event, the same delivery id on every try
    for _, headers, body in got:
        verify(SECRET, headers, body)
        assert headers[SIGNATURE_HEADER].startswith("t=")
    gaps = [got[1][0] - got[0][0], got[2][0] - got[1][0]]
    assert gaps[0] >= 0.9 and gaps[1] >= 1.9, gaps  # backoff 1 s, then 2 s
    store = Store.connect(farm.url)
    try:
        events = webhook_events(store, job_id, 3)
        assert [(e["outcome"], e["tries"], e["status"]) for e in events] == [
            ("retry", 1, 500),
            ("retry", 2, 500),
            ("delivered", 3, 200),
        ]
        assert events[0]["error"] == "HTTP 500" and events[0]["retry_in"] == 1.0
    finally:
        store.close()


@pytest.mark.parametrize("url", ["http://10.0.0.1/hook", "http://127.0.0.1:9/hook"])
def test_a_private_webhook_is_refused_at_submit_by_default(
    farm: Any, tmp_path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.delenv(ALLOW, raising=False)  # this process: the default policy
    store = Store.connect(farm.url)
    before = store.count_by_state()
    try:
        with Farm(farm.url) as client, pytest.raises(InvalidParameterError) as info:
            client.submit(MODEL, PROMPT, width=64, height=64, steps=1, webhook=url)
        assert info.value.parameter == "webhook" and "private" in str(info.value)

        with served_gateway(farm.url, [], 30) as base:
            r = httpx.post(f"{base}/v1/jobs", json={"model": MODEL, "prompt": PROMPT,
                                                    "webhook": url}, timeout=30)  # fmt: skip
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "webhook", r.text
        assert "SDFARM_WEBHOOK_ALLOW_PRIVATE" in error["message"]

        done = generate(farm, tmp_path, url, allow=False)
        assert done.returncode == 2 and "webhook" in done.stderr + done.stdout, done.stderr
        assert store.count_by_state() == before  # nothing was queued
    finally:
        store.close()
