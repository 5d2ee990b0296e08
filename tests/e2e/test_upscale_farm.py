"""Upscale jobs on a real LocalFarm (one CPU worker, the tiny ESRGANs): the result is the input
times the factor, the same input the same bytes, the job record says its kind, the worker's
engine cache holds the upscaler beside a model's engine and its heartbeat lists it; bad input
is refused at submit, and a job that slips past the client is refused by the worker, which
goes on working. The gateway's POST /v1/upscale and `sdfarm upscale` reach the same farm."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from sdfarm.client.errors import JobFailed
from sdfarm.client.farm import Farm
from sdfarm.native import images, upscale_params
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.png import read_params
from sdfarm.store import JobSpec
from sdfarm.store.records import upscaler_key

from helpers.gateway import cpu_farm, served_gateway

pytestmark = pytest.mark.e2e

X2 = "tiny-esrgan-x2"


def png(w: int, h: int, seed: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "upscalehost") as f:
        yield f


@pytest.fixture
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="upscale-tests") as f:
        yield f


def test_an_upscale_job_returns_the_image_times_the_factor(client: Farm, tmp_path: Path) -> None:
    image = png(24, 16)
    (tmp_path / "in.png").write_bytes(image)
    job = client.upscale(tmp_path / "in.png", X2, tile_size=0)
    result = job.result(120)
    out = Image.open(io.BytesIO(result.png))
    assert out.size == (48, 32)
    assert result.metadata["kind"] == "upscale" and result.metadata["factor"] == 2
    assert read_params(result.png)["image"] == images.digest(image)  # named by its digest
    record = client.store.record(job.id)
    assert record["kind"] == "upscale" and record["model"] == upscaler_key(X2)
    assert int(record["estimate"]) > 128 << 20  # placed by the upscaler's estimate
    again = client.upscale(image, X2, tile_size=0).result(120)
    assert again.png == result.png  # the same input, the same bytes
    other = client.upscale(png(24, 16, seed=2), X2, tile_size=0).result(120)
    assert other.png != result.png
    # the upscaler is an engine of the worker, held beside a model's, and listed
    client.submit("tiny-f16", "a cat", width=64, height=64, steps=1, seed=3).result(120)
    ups = client.upscalers()
    assert [u["name"] for u in ups] == sorted([X2, "tiny-esrgan-x4"])
    assert {u["name"]: u["scale"] for u in ups}[X2] == 2
    loaded = _loaded(client)
    assert upscaler_key(X2) in loaded and "tiny-f16" in loaded


def _loaded(client: Farm) -> list[str]:
    """The engines the worker's heartbeat lists, once it lists both (it beats every second)."""
    deadline = time.monotonic() + 10
    while True:
        names = [m["name"] for d in client.status()["devices"] for m in d.get("loaded") or []]
        if {upscaler_key(X2), "tiny-f16"} <= set(names) or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


def test_bad_input_is_refused_at_submit(client: Farm) -> None:
    cases = {
        "upscaler": ("nope", {}),
        "factor": (X2, {"factor": 4}),  # x2 only: the runtime would ignore a 4
        "tile_size": (X2, {"tile_size": 8}),
    }
    for name, (upscaler, extra) in cases.items():
        with pytest.raises(InvalidParameterError) as err:
            client.upscale(png(16, 16), upscaler, **extra)
        assert err.value.parameter == name
    with pytest.raises(InvalidParameterError) as err:
        client.upscale(b"\x89PNG\r\n\x1a\n garbage", X2)
    assert err.value.parameter == "image"
    with pytest.raises(InvalidParameterError) as err:
        client.upscale(png(16, 16), "../upscalers/" + X2)
    assert err.value.parameter == "upscaler"
    with pytest.raises(InvalidParameterError) as err:  # a generation's hires upscaler too
        client.submit("tiny-f16", "x", width=64, height=64, hires_scale=2, hires_upscaler="nope")
    assert err.value.parameter == "hires_upscaler" and "unknown upscaler" in str(err.value)


def test_a_job_past_the_client_is_refused_by_the_worker_which_survives(client: Farm) -> None:
    good = upscale_params.validate(upscale_params.UpscaleParams(image=png(16, 16), upscaler=X2))
    doc, inputs = upscale_params.detach(good)
    bad_specs = {
        "factor": {**doc, "factor": 4},
        "tile_size": {**doc, "tile_size": 3},
        "upscaler": {**doc, "upscaler": "../x"},
    }
    for name, params in bad_specs.items():
        spec = JobSpec(model=upscaler_key(X2), params=params, kind="upscale")
        job = client.submit_spec(spec, inputs)
        with pytest.raises(JobFailed, match=f"invalid {name}"):
            job.result(60)
    corrupt = JobSpec(model=upscaler_key(X2), params=doc, kind="upscale")
    job = client.submit_spec(corrupt, {"image": png(16, 16, seed=9)})  # not the digest's image
    with pytest.raises(JobFailed, match="invalid image"):
        job.result(60)
    out = client.upscale(png(16, 16), X2).result(60)  # the same worker goes on
    assert Image.open(io.BytesIO(out.png)).size == (32, 32)


def test_the_gateway_route_queues_an_upscale_with_the_jobs_api_rules(farm: Any) -> None:
    image = base64.b64encode(png(20, 12)).decode()
    with served_gateway(farm.url, ["token-a", "token-b"], 60) as base:
        a = {"Authorization": "Bearer token-a"}
        b = {"Authorization": "Bearer token-b"}
        r = httpx.post(f"{base}/v1/upscale", json={"image": image, "upscaler": X2}, timeout=30)
        assert r.status_code == 401  # no token, no job
        listed = httpx.get(f"{base}/v1/upscalers", headers=a, timeout=30).json()["data"]
        assert {u["name"]: u["scale"] for u in listed} == {X2: 2, "tiny-esrgan-x4": 4}
        assert httpx.get(f"{base}/v1/upscalers", timeout=30).status_code == 401
        r = httpx.post(
            f"{base}/v1/upscale", json={"image": image, "upscaler": X2, "tile_size": 0},
            headers=a, timeout=30,
        )  # fmt: skip
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        doc: dict[str, Any] = {}
        deadline = time.monotonic() + 60
        while doc.get("state") not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
            doc = httpx.get(f"{base}/v1/jobs/{job_id}", headers=a, timeout=30).json()
        assert doc["state"] == "done" and doc["kind"] == "upscale", doc
        assert doc["model"] == upscaler_key(X2)
        png_out = httpx.get(f"{base}/v1/jobs/{job_id}/image.png", headers=a, timeout=30)
        assert Image.open(io.BytesIO(png_out.content)).size == (40, 24)
        # another owner's token sees no such job, on every route
        assert httpx.get(f"{base}/v1/jobs/{job_id}", headers=b, timeout=30).status_code == 404
        bad = {
            "factor": {"factor": 4},
            "upscaler": {"upscaler": "nope"},
            "image": {"image": "not base64!"},
            "tile_size": {"tile_size": 5},
        }
        for name, change in bad.items():
            body = {"image": image, "upscaler": X2, **change}
            r = httpx.post(f"{base}/v1/upscale", json=body, headers=a, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
        r = httpx.post(f"{base}/v1/upscale", json={"upscaler": X2}, headers=a, timeout=30)
        assert r.status_code == 400 and "image" in r.text
        r = httpx.post(
            f"{base}/v1/upscale", json={"image": image, "upscaler": X2, "prompt": "x"},
            headers=a, timeout=30,
        )  # fmt: skip
        assert r.status_code == 400


def test_the_cli_upscales_on_the_farm(farm: Any, tmp_path: Path) -> None:
    src = tmp_path / "in.png"
    src.write_bytes(png(16, 12))
    out = tmp_path / "out.png"
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "upscale", str(src), "--upscaler", X2,
         "--redis", farm.url, "-o", str(out), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["job"] and doc["output_size"] == [32, 24] and doc["kind"] == "upscale"
    assert Image.open(out).size == (32, 24)
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "models", "--redis", farm.url, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert [u["name"] for u in listed["upscalers"]] == [X2, "tiny-esrgan-x4"]
    assert [m["name"] for m in listed["models"]] == ["tiny-f16", "tiny-q8_0"]
