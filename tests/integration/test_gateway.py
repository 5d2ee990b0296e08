"""The gateway (sdfarm.gateway) served by uvicorn in a thread on a free port, over a real local
farm (redis-server, scheduler, one CPU worker with the tiny model), spoken to by the real
`openai` package and by httpx: images, errors in OpenAI's shape, SSE progress, metrics."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sdfarm.gateway.bodylimit import MAX_BODY
from sdfarm.native.params import MAX_BATCH, MAX_SIZE
from sdfarm.store import Store

from helpers.gateway import cpu_farm, served_gateway

MODEL = "tiny-q8_0"
TOKEN = "gateway-test-token"
SMALL = {"steps": 1}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def local_farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "gatewayhost") as farm:
        yield farm


@pytest.fixture(scope="module")
def gateway(local_farm: Any) -> Iterator[str]:
    with served_gateway(local_farm.url, [TOKEN], 60.0) as url:
        yield url


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=gateway, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    ) as c:
        yield c


def _error(resp: httpx.Response) -> dict[str, Any]:
    doc = resp.json()
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["message"]
    return doc["error"]


def test_openai_client_gets_b64_png(client: openai.OpenAI) -> None:
    res = client.images.generate(
        model=MODEL, prompt="a red boat", size="64x64", response_format="b64_json", extra_body=SMALL
    )
    assert res.created > 0 and len(res.data) == 1
    png = base64.b64decode(res.data[0].b64_json or "")
    assert png.startswith(PNG)


def test_openai_client_gets_urls_for_n_images(client: openai.OpenAI, gateway: str) -> None:
    res = client.images.generate(
        model=MODEL, prompt="two boats", n=2, size="64x64", response_format="url", user="alice",
        extra_body=SMALL,
    )  # fmt: skip
    assert len(res.data) == 2
    urls = [d.url or "" for d in res.data]
    assert all(u.startswith(f"{gateway}/v1/jobs/") for u in urls)
    for u in urls:  # signed: fetchable without the token, as OpenAI clients do
        got = httpx.get(u, timeout=30)
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        assert got.content.startswith(PNG)
    unsigned = re.sub(r"&sig=[0-9a-f]+", "", urls[0])
    assert httpx.get(unsigned, timeout=30).status_code == 401
    job_id = urls[0].split("/v1/jobs/")[1].split("/")[0]
    doc = httpx.get(
        f"{gateway}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()
    assert doc["submitter"] == "alice" and doc["images"] == 2 and doc["state"] == "done"


def test_models_lists_the_farms_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny-f16", "tiny-q8_0"]
    assert all(m.owned_by == "sdfarm" for m in client.models.list())


def test_openai_errors_have_status_and_shape(client: openai.OpenAI, gateway: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.images.generate(model=MODEL, prompt="x", size="65x64", extra_body=SMALL)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "size"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        client.images.generate(model="no-such-model", prompt="x", size="64x64", extra_body=SMALL)
    assert missing.value.status_code == 404 and "tiny-q8_0" in str(missing.value)
    wrong = openai.OpenAI(base_url=f"{gateway}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        wrong.images.generate(model=MODEL, prompt="x", size="64x64")
    assert auth.value.status_code == 401


def test_raw_error_shapes(http: httpx.Client, gateway: str) -> None:
    body = {"model": MODEL, "prompt": "x", "size": "64x64"}
    e = _error(
        r := http.post("/v1/images/generations", json={**body, "size": f"64x{MAX_SIZE + 8}"})
    )
    assert r.status_code == 400 and e["param"] == "size"
    e = _error(r := http.post("/v1/images/generations", json={**body, "n": MAX_BATCH + 1}))
    assert r.status_code == 400 and e["param"] == "n"
    e = _error(r := http.post("/v1/images/generations", json={**body, "model": "nope"}))
    assert r.status_code == 404 and e["param"] == "model"
    e = _error(r := httpx.post(f"{gateway}/v1/images/generations", json=body))
    assert r.status_code == 401 and e["type"] == "authentication_error"
    e = _error(r := http.post("/v1/jobs", json={**body, "prompt": "x" * (MAX_BODY + 1)}))
    assert r.status_code == 413
    e = _error(r := http.post("/v1/jobs", json={"model": MODEL, "prompt": "x", "width": 60}))
    assert r.status_code == 400 and e["param"] == "width"
    e = _error(r := http.get("/v1/jobs/" + "0" * 32))
    assert r.status_code == 404


def test_queue_full_is_429_with_retry_after(http: httpx.Client, local_farm: Any) -> None:
    store = Store.connect(local_farm.url)
    config = store.queues()["config"]
    store.publish_config(0, int(config["backlog"]))
    try:
        resp = http.post("/v1/jobs", json={"model": MODEL, "prompt": "x", "width": 64,
                                           "height": 64, **SMALL})  # fmt: skip
    finally:
        store.publish_config(int(config["queue_limit"]), int(config["backlog"]))
        store.close()
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) > 0
    assert _error(resp)["code"] == "queue_full"


def test_job_events_stream_ends_with_done(http: httpx.Client) -> None:
    r = http.post(
        "/v1/jobs",
        json={"model": MODEL, "prompt": "sse", "width": 64, "height": 64, "priority": 0, **SMALL},
    )
    assert r.status_code == 202 and r.json()["state"] == "queued"
    job_id = r.json()["id"]
    kinds = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[len("event: ") :])
            elif line.startswith("data: "):
                assert json.loads(line[len("data: ") :])["event"] == kinds[-1]
    assert kinds[0] == "queued" and kinds[-1] == "done", kinds
    assert "placed" in kinds
    doc = http.get(f"/v1/jobs/{job_id}").json()
    assert doc["state"] == "done" and doc["params"]["width"] == 64
    img = http.get(f"/v1/jobs/{job_id}/image.png")
    assert img.status_code == 200 and img.content.startswith(PNG)
    gone = http.delete(f"/v1/jobs/{job_id}").json()  # an ended job: deleted with its image
    assert gone == {"id": job_id, "cancelled": False, "deleted": True, "state": "deleted"}
    assert http.get(f"/v1/jobs/{job_id}").status_code == 404
    assert http.get(f"/v1/jobs/{job_id}/image.png").status_code == 404


def test_devices_health_and_metrics(http: httpx.Client, gateway: str) -> None:
    assert httpx.get(f"{gateway}/healthz").json() == {"ok": True}  # no token needed
    devs = http.get("/v1/devices").json()["data"]
    assert [d["alive"] for d in devs] == [True]
    resp = http.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain; version=")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }
    assert samples[("sdfarm_devices_alive", ())] == 1
    done = (("device", "gatewayhost/CPU"), ("model", MODEL))
    assert samples[("sdfarm_jobs_done_total", done)] >= 1
    assert samples[("sdfarm_job_end_to_end_seconds_count", done)] >= 1
    assert ("sdfarm_queue_depth", (("priority", "0"),)) in samples


def test_a_token_over_its_rate_gets_429_with_retry_after(redis_url: str) -> None:
    from fastapi.testclient import TestClient

    from sdfarm.gateway import create_app

    app = create_app(redis_url, tokens=["tok-a", "tok-b"], rate_per_minute=6)
    with TestClient(app, base_url="http://localhost") as http:
        auth = {"Authorization": "Bearer tok-a"}
        assert http.get("/v1/models", headers=auth).status_code == 200
        over = http.get("/v1/models", headers=auth)
        assert over.status_code == 429
        assert int(over.headers["Retry-After"]) >= 1
        assert over.json()["error"]["code"] == "rate_limited"
        other = http.get("/v1/models", headers={"Authorization": "Bearer tok-b"})
        assert other.status_code == 200
    app.state.farm.close()
