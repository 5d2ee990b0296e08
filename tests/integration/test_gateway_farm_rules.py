"""The gateway's isolation and error rules over a real local farm (redis-server, scheduler, one
CPU worker with the tiny model in a private models folder): the status page shows each token
its own jobs; a worker's real "unknown model" error (which names the model folders) reaches
clients as 500 job_failed, never 507, and without the folder, in the error answer, the job
record and the event stream."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.gateway import cpu_farm, served_gateway

MODEL = "tiny-q8_0"
A, B, OP = "farm-token-a", "farm-token-b", "farm-operator"
SMALL = {"steps": 1, "size": "64x64", "response_format": "b64_json"}


@pytest.fixture(scope="module")
def private_models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("private-model-folder")
    shutil.copytree(models_dir / MODEL, folder / MODEL)
    return folder


@pytest.fixture(scope="module")
def gateway(private_models: Path) -> Iterator[str]:
    with (
        cpu_farm(private_models, "ruleshost") as farm,
        served_gateway(farm.url, [A, B], 60.0, operator_tokens=[OP]) as url,
    ):
        yield url


def http(gateway: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def test_the_status_page_shows_each_token_its_own_jobs(gateway: str) -> None:
    prompts = {A: "the prompt of a", B: "the prompt of b"}
    for token, prompt in prompts.items():
        with http(gateway, token) as c:
            r = c.post("/v1/images/generations", json={"model": MODEL, "prompt": prompt, **SMALL})
            assert r.status_code == 200, r.text
    seen = {}
    for token in (A, B, OP):
        with http(gateway, token) as c:
            doc = c.get("/v1/status").json()
        seen[token] = {x["prompt"] for x in doc["recent"]}
        assert doc["devices"] and doc["devices"][0]["memory"]["total"] > 0  # figures: for all
    assert seen[A] == {prompts[A]} and seen[B] == {prompts[B]}
    assert set(prompts.values()) <= seen[OP]
    assert httpx.get(f"{gateway}/v1/status").status_code == 401  # loopback needs a token too


def test_a_worker_error_naming_the_model_folder_is_500_without_the_folder(
    gateway: str, private_models: Path
) -> None:
    """A model folder removed after the worker listed it: the worker's catalog fails the job
    with "unknown model 'ghost'; models: ... (in <the folder>)". The worker lists its models
    anew every 10 s: the folder appears, is seen, and is removed right after a new listing,
    so the farm still takes jobs for it for a few seconds."""
    ghost = private_models / "ghost"
    with http(gateway, A) as c:
        shutil.copytree(private_models / MODEL, ghost)
        deadline = time.monotonic() + 30
        while "ghost" not in [m["id"] for m in c.get("/v1/models").json()["data"]]:
            assert time.monotonic() < deadline, "the worker never listed the ghost model"
            time.sleep(0.1)
        shutil.rmtree(ghost)

        r = c.post("/v1/jobs", json={"model": "ghost", "prompt": "boo", "steps": 1,
                                     "width": 64, "height": 64})  # fmt: skip
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        r = c.post("/v1/images/generations", json={"model": "ghost", "prompt": "boo", **SMALL})
        events = _events(c, job_id)
        record = c.get(f"/v1/jobs/{job_id}").json()

    folder = str(private_models)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "job_failed", r.text
    assert "unknown model 'ghost'" in err["message"] and "<path>" in err["message"]
    assert folder not in r.text and private_models.name not in r.text
    assert events[-1]["event"] == "failed" and "unknown model 'ghost'" in events[-1]["error"]
    assert folder not in json.dumps(events) and private_models.name not in json.dumps(events)
    assert record["state"] == "failed" and record["estimate"]  # placed: it has an estimate
    assert "unknown model" in record["error"] and private_models.name not in record["error"]


def _events(c: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    out = []
    with c.stream("GET", f"/v1/jobs/{job_id}/events") as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[len("data: ") :]))
    return out
