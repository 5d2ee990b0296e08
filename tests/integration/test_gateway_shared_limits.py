"""The rate limit and the live-jobs quota are one limit for every gateway on a farm: two
`sdfarm gateway` processes on one real redis-server count a token's requests together (the
N+1th across both is a 429 with a Retry-After that is true) and its live jobs together (the
quota+1th is a 429 until one of its jobs ends); another token keeps its own counts; the rate
counters are keys under the store's rate prefix, named by the token's fingerprint, each with a
TTL."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from sdfarm.gateway.auth import fingerprint
from sdfarm.store import keys

from helpers.gateway import free_port

TOKEN_A, TOKEN_B = "shared-limit-a", "shared-limit-b"
PER_MINUTE = 60  # bursts of 10 in any 10 s
BURST = 10
MAX_JOBS = 2


def _start(redis_url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = [sys.executable, "-m", "sdfarm.gateway.cli", "--redis", redis_url, "--port",
            str(port), "--token", TOKEN_A, "--token", TOKEN_B, "--rate-limit", str(PER_MINUTE),
            "--max-jobs", str(MAX_JOBS), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def gateways(redis_url: str) -> Iterator[list[str]]:
    """Two gateway processes on the one redis-server; their base URLs once both answer."""
    procs = [_start(redis_url) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        for proc, url in procs:
            while True:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < deadline, f"{url} did not start"
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
        yield [url for _, url in procs]
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(15)


def _get(url: str, token: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=10)


def test_two_gateways_enforce_one_limit(gateways: list[str], redis_url: str) -> None:
    one, two = gateways
    codes = [_get(gateways[k % 2], TOKEN_A).status_code for k in range(BURST)]
    assert codes == [200] * BURST  # five through each gateway: within the one burst
    over = _get(one, TOKEN_A)
    assert over.status_code == 429, over.text  # the 11th, though `one` saw only 5
    assert over.json()["error"]["code"] == "rate_limited"
    assert _get(two, TOKEN_A).status_code == 429  # and the other gateway agrees
    retry = int(over.headers["Retry-After"])
    assert 1 <= retry <= 10
    assert _get(two, TOKEN_B).status_code == 200  # another token: its own count

    r = redis.Redis.from_url(redis_url)
    try:
        names = [k.decode() for k in r.scan_iter(match=keys.RATE_PREFIX + ":*")]
        assert names and all(TOKEN_A not in n and TOKEN_B not in n for n in names)
        assert any(fingerprint(TOKEN_A) in n for n in names)
        assert all(0 < r.pttl(n) <= 2 * 60 * 1000 for n in names)  # every counter expires
    finally:
        r.close()

    time.sleep(retry)  # Retry-After is true: then a request passes again, on either gateway
    assert _get(two, TOKEN_A).status_code == 200


def _submit(url: str, token: str) -> httpx.Response:
    """A job of a model no worker serves yet: it stays queued (live) until cancelled."""
    body = {"model": "m", "prompt": "x", "width": 64, "height": 64, "steps": 1}
    auth = {"Authorization": f"Bearer {token}"}
    return httpx.post(f"{url}/v1/jobs", json=body, headers=auth, timeout=10)


def test_two_gateways_enforce_one_live_jobs_quota(gateways: list[str]) -> None:
    one, two = gateways
    first, second = _submit(one, TOKEN_A), _submit(two, TOKEN_A)
    assert first.status_code == second.status_code == 202, first.text
    over = _submit(one, TOKEN_A)  # `one` admitted only one of them
    assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
    assert int(over.headers["Retry-After"]) >= 1
    assert _submit(two, TOKEN_A).status_code == 429
    assert _submit(one, TOKEN_B).status_code == 202  # another token: its own quota
    job_id = first.json()["id"]
    auth = {"Authorization": f"Bearer {TOKEN_A}"}
    gone = httpx.delete(f"{two}/v1/jobs/{job_id}", headers=auth, timeout=10)
    assert gone.status_code == 200 and gone.json()["state"] == "cancelled"
    assert _submit(one, TOKEN_A).status_code == 202  # a job ended: room for one more
    assert _submit(two, TOKEN_A).status_code == 429
