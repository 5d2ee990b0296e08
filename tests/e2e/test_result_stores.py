"""Result stores on a real farm: a shared folder and an S3-compatible server (moto's standalone
server, started here), each behind a LocalFarm whose worker puts images there.

For each: the images land in the store, Redis holds no image bytes (every value of every key
is scanned for the PNG signature), the client, the batch runner and the gateway read them
back from the store the job's record names (this process has no SDFARM_RESULTS of its own),
and deleting a job removes its images. The Redis store's caps refuse a result clearly.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from sdfarm.client.batch import run_batch
from sdfarm.client.batch_input import parse_items
from sdfarm.client.farm import Farm
from sdfarm.client.job import Job
from sdfarm.gateway import create_app
from sdfarm.localfarm.farm import LocalFarm
from sdfarm.store import JobSpec

pytestmark = pytest.mark.e2e

PNG = b"\x89PNG\r\n\x1a\n"
SMALL = {"width": 64, "height": 64, "steps": 1}
BUCKET = "sdfarm-results"
TOKEN_A, TOKEN_B = "token-a-" + "x" * 24, "token-b-" + "y" * 24
AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's standalone S3 server on a free loopback port, with the AWS settings of this
    process pointing at it (restored after)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in [*AWS, "AWS_ENDPOINT_URL"]}
    os.environ.update(AWS, AWS_ENDPOINT_URL=url)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "moto did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _s3() -> Any:
    import boto3

    return boto3.session.Session().client("s3")


@pytest.fixture(scope="module", params=["file", "s3"])
def stored(request, models_dir, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A one-CPU-worker farm whose worker puts images in a folder, or in the S3 server."""
    if request.param == "file":
        root = tmp_path_factory.mktemp("shared-results")
        url = f"file://{root}"
    else:
        request.getfixturevalue("s3_endpoint")
        _s3().create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/farm-a"
    farm = LocalFarm(
        [models_dir],
        devices=["CPU"],
        threads=1,
        announce=False,
        worker_args=["--memory-limit", "4GiB"],
        env={**os.environ, "SDFARM_TEST_HOOKS": "1"},
        results=url,
    )
    with farm:
        client = Farm(farm.url)
        try:
            yield {"kind": request.param, "url": url, "redis": farm.url, "farm": client}
        finally:
            client.close()


def objects(stored: dict[str, Any]) -> set[str]:
    """Every image key the store holds now."""
    if stored["kind"] == "file":
        root = Path(stored["url"][len("file://") :])
        return {str(p.relative_to(root)) for p in root.rglob("*.png")}
    listed = _s3().list_objects_v2(Bucket=BUCKET).get("Contents") or []
    return {o["Key"] for o in listed}


def redis_image_bytes(url: str) -> list[str]:
    """Every key of Redis holding a value with a PNG signature in it."""
    r = redis.Redis.from_url(url)
    found = []
    try:
        for k in r.scan_iter(count=1000):
            kind = r.type(k).decode()
            if kind == "string":
                values = [r.get(k)]
            elif kind == "hash":
                values = list(r.hgetall(k).values())
            elif kind == "list":
                values = r.lrange(k, 0, -1)
            elif kind in ("set", "zset"):
                values = list(r.smembers(k)) if kind == "set" else r.zrange(k, 0, -1)
            else:
                values = []
            if any(PNG in (v or b"") for v in values):
                found.append(k.decode())
    finally:
        r.close()
    return found


def test_images_land_in_the_store_not_in_redis_and_the_client_reads_them(stored) -> None:
    farm: Farm = stored["farm"]
    before = objects(stored)
    job = farm.submit("tiny-f16", "a red fox", batch_count=2, **SMALL)
    result = job.result(timeout=120)
    assert len(result.pngs) == 2 and all(p.startswith(PNG) for p in result.pngs)
    where = json.loads(job.record()["results"])
    assert where["store"] == stored["url"]
    assert set(where["keys"]) == objects(stored) - before and len(where["keys"]) == 2
    assert redis_image_bytes(stored["redis"]) == []
    assert farm.store.image_count(job.id) == 2


def test_the_gateway_serves_store_images_and_its_delete_removes_them(stored) -> None:
    app = create_app(stored["redis"], tokens=[TOKEN_A, TOKEN_B])
    a = {"Authorization": f"Bearer {TOKEN_A}"}
    b = {"Authorization": f"Bearer {TOKEN_B}"}
    with TestClient(app, base_url="http://localhost", client=("127.0.0.1", 5)) as gw:
        job_id = gw.post("/v1/jobs", json={"model": "tiny-f16", "prompt": "a boat", **SMALL},
                         headers=a).json()["id"]  # fmt: skip
        Job(stored["farm"], job_id).wait(120)
        doc = gw.get(f"/v1/jobs/{job_id}", headers=a).json()
        assert doc["state"] == "done" and doc["images"] == 1
        keys = json.loads(stored["farm"].store.record(job_id)["results"])["keys"]
        got = gw.get(doc["image_urls"][0], headers=a, follow_redirects=False)
        if stored["kind"] == "s3":  # a presigned URL: the bytes never pass the gateway
            assert got.status_code == 307
            presigned = got.headers["location"]
            assert presigned.startswith(os.environ["AWS_ENDPOINT_URL"])
            png = httpx.get(presigned, timeout=10).content
        else:
            assert got.status_code == 200
            png = got.content
        assert png.startswith(PNG)
        assert png == stored["farm"].job(job_id).result(10).png
        assert set(keys) <= objects(stored)
        # another token may not see it, let alone delete it
        assert gw.delete(f"/v1/jobs/{job_id}", headers=b).status_code == 404
        assert set(keys) <= objects(stored)
        gone = gw.delete(f"/v1/jobs/{job_id}", headers=a).json()
        assert gone == {"id": job_id, "cancelled": False, "deleted": True, "state": "deleted"}
        assert not set(keys) & objects(stored)
        assert gw.get(f"/v1/jobs/{job_id}", headers=a).status_code == 404
        assert gw.get(f"/v1/jobs/{job_id}/image.png", headers=a).status_code == 404


def test_batch_reads_from_the_store_and_farm_delete_removes_everything(stored, tmp_path) -> None:
    farm: Farm = stored["farm"]
    items = parse_items("a cat\na dog\na cow\n", "text")
    summary = run_batch(farm, items, tmp_path / "out", "tiny-f16", common=SMALL, in_flight=2)
    assert summary.done == 3 and summary.failed == 0, summary.text()
    for item in items:
        png = (tmp_path / "out" / f"{item.name}.png").read_bytes()
        side = json.loads((tmp_path / "out" / f"{item.name}.json").read_text())
        record = farm.store.record(side["job"])
        assert png.startswith(PNG) and json.loads(record["results"])["store"] == stored["url"]
        keys = json.loads(record["results"])["keys"]
        assert set(keys) <= objects(stored)
        assert farm.delete(side["job"]) is True
        assert not set(keys) & objects(stored)
        assert farm.store.record(side["job"]) == {} and farm.store.events(side["job"]) == []
        assert farm.delete(side["job"]) is False  # gone: nothing to delete
    assert redis_image_bytes(stored["redis"]) == []


def test_map_takes_a_generator_and_keeps_a_bounded_window(stored) -> None:
    farm: Farm = stored["farm"]
    drawn = 0

    def prompts() -> Iterator[str]:
        nonlocal drawn
        for n in itertools.count():  # endless: map must never read it whole
            drawn += 1
            yield f"prompt {n}"

    results = farm.map(prompts(), "tiny-f16", window=2, **SMALL)
    got = [next(results) for _ in range(3)]
    assert [r.png[:8] for r in got] == [PNG] * 3
    assert drawn <= 3 + 2  # the three collected and at most a window more
    results.close()  # cancels what it had in flight


def test_a_live_job_is_cancelled_then_deleted(stored) -> None:
    farm: Farm = stored["farm"]
    spec = JobSpec(model="tiny-f16", params={"prompt": "slow", **SMALL}, test_hook="sleep:60")
    job = farm.submit_spec(spec)
    deadline = time.monotonic() + 60
    while job.state() != "running":
        assert time.monotonic() < deadline, job.record()
        time.sleep(0.05)
    t = time.monotonic()
    assert farm.delete(job.id, timeout=60) is True
    assert time.monotonic() - t < 30  # cancelled, not waited out
    assert job.state() == "" and farm.store.events(job.id) == []


@pytest.fixture(scope="module")
def tight_redis_farm(models_dir) -> Iterator[Farm]:
    """A farm on the Redis result store with a total cap below one tiny image."""
    env = {**os.environ, "SDFARM_RESULTS_REDIS_MAX_BYTES": "100"}
    env.pop("SDFARM_RESULTS", None)
    farm = LocalFarm([models_dir], devices=["CPU"], threads=1, announce=False,
                     worker_args=["--memory-limit", "4GiB"], env=env)  # fmt: skip
    with farm:
        client = Farm(farm.url)
        try:
            yield client
        finally:
            client.close()


def test_the_redis_store_refuses_past_its_total_cap_clearly(tight_redis_farm: Farm) -> None:
    from sdfarm.client.errors import JobFailed

    job = tight_redis_farm.submit("tiny-f16", "too much", **SMALL)
    with pytest.raises(JobFailed) as info:
        job.result(timeout=120)
    assert "Redis result store is full" in str(info.value)
    assert "SDFARM_RESULTS_REDIS_MAX_BYTES" in str(info.value)
    assert tight_redis_farm.store.results_held() == 0


def test_the_cli_deletes_a_job_and_sweeps_a_folder(stored, tmp_path) -> None:
    farm: Farm = stored["farm"]
    job = farm.submit("tiny-f16", "a heron", **SMALL)
    job.result(timeout=120)
    keys = json.loads(job.record()["results"])["keys"]

    def sdfarm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sdfarm.cli.main", *args],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    done = sdfarm("delete", job.id, "--redis", stored["redis"], "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"id": job.id, "deleted": True}
    assert not set(keys) & objects(stored) and job.state() == ""
    again = sdfarm("delete", job.id, "--redis", stored["redis"], "--json")
    assert again.returncode != 0 and "no job" in again.stdout + again.stderr
    if stored["kind"] == "s3":
        refused = sdfarm("results", "sweep", stored["url"])
        assert refused.returncode == 2 and "lifecycle rule" in refused.stderr
        return
    root = tmp_path / "sweep"
    (root / ("a" * 32)).mkdir(parents=True)
    (root / ("a" * 32) / "0.png").write_bytes(PNG)
    (root / "keep.txt").write_text("not a job folder")
    swept = sdfarm("results", "sweep", f"file://{root}", "--older-than", "0", "--json")
    assert swept.returncode == 0, swept.stderr
    assert json.loads(swept.stdout) == {"removed": ["a" * 32]}
    assert sorted(p.name for p in root.iterdir()) == ["keep.txt"]
