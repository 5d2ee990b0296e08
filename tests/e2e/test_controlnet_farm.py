"""ControlNet and embeddings on a real farm (a redis-server, the scheduler, one CPU worker) with
the random-weight SD 1.x model: a job runs on its engine key (the model with its ControlNet and
embeddings), placed by an estimate that counts them, and repeats exactly; every door takes the
fields (Farm.submit, the CLI, JSONL and CSV batch lines with paths relative to the file, the
gateway's jobs JSON); bad input is refused at submit, and a job past the client is refused by
the worker before it loads anything, the worker going on."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from sdfarm.client.farm import Farm, JobFailed
from sdfarm.client.job import Job
from sdfarm.native import images
from sdfarm.native.enginekey import engine_key
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import GenerationParams, detach_images, validate
from sdfarm.native.png import read_params
from sdfarm.store import JobSpec
from sdfarm.store.records import new_job_id

from helpers.gateway import served_gateway

pytestmark = pytest.mark.e2e

MODEL, CN, EMB = "sd1-tiny", "sd1-control", "sd1-emb"
SMALL = {"width": 64, "height": 64, "steps": 1, "seed": 21}
KEY = f"{MODEL}+control:{CN}+embeddings:{EMB}"


def png(seed: int, size: tuple[int, int] = (64, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return buf.getvalue()


def control(seed: int = 1, strength: float = 0.9) -> dict[str, Any]:
    return {"control_net": CN, "control_image": png(seed), "control_strength": strength,
            "embeddings": EMB}  # fmt: skip


@pytest.fixture(scope="module")
def farm(sd1_dir: Path) -> Iterator[Any]:
    """One CPU worker with room for the SD 1.x engine with its ControlNet (about 4 GB by the
    estimate)."""
    from sdfarm.localfarm.farm import LocalFarm

    f = LocalFarm([sd1_dir], devices=["CPU"], threads=2, host="cnhost", announce=False,
                  worker_args=["--memory-limit", "8GiB"], env=dict(os.environ))  # fmt: skip
    with f:
        yield f


@pytest.fixture(scope="module")
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="controlnet-tests") as f:
        yield f


def _loaded(client: Farm) -> list[str]:
    return [m["name"] for d in client.status()["devices"] for m in d.get("loaded") or []]


def test_a_control_job_runs_on_its_engine_key_and_repeats(client: Farm) -> None:
    job = client.submit(MODEL, "a lighthouse sd1-emb", **SMALL, **control())
    first = job.result(300)
    record = client.store.record(job.id)
    assert record["model"] == KEY  # placed, cached and listed as that engine
    assert first.metadata["model"] == MODEL and first.metadata["engine"] == KEY
    assert first.metadata["control_net"] == CN
    assert first.metadata["embeddings"] == EMB
    assert first.metadata["control_image"] == images.digest(png(1))
    assert read_params(first.png)["control_net"] == CN
    again = client.submit(MODEL, "a lighthouse sd1-emb", **SMALL, **control()).result(300)
    assert again.png == first.png  # the same inputs, the same bytes
    other = client.submit(MODEL, "a lighthouse sd1-emb", **SMALL, **control(strength=0.2))
    assert other.result(300).png != first.png
    assert KEY in _loaded(client)
    assert client.controlnets() == [CN] and client.embeddings() == ["sd1-emb", "sd1-emb2"]
    # the estimate counted the ControlNet (as loaded, 0.94 GB) and the embedding's table
    plain = client.submit(MODEL, "a lighthouse", **SMALL)
    assert plain.result(300).png
    assert int(record["estimate"]) - int(client.store.record(plain.id)["estimate"]) > 1 << 30
    assert client.store.record(plain.id)["model"] == MODEL


def test_every_door_takes_the_control_fields(farm: Any, client: Farm, tmp_path: Path) -> None:
    (tmp_path / "edges.png").write_bytes(png(4))
    line = {"prompt": "a door", **SMALL, "control_image": "edges.png", "control_strength": 0.7,
            "control_net": CN, "embeddings": EMB}  # fmt: skip
    (tmp_path / "items.jsonl").write_text(json.dumps({"name": "j", **line}) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["name", *line])
    writer.writeheader()
    writer.writerow({"name": "c", **line})
    (tmp_path / "items.csv").write_text(buf.getvalue())
    want = {"control_net": CN, "embeddings": EMB, "control_strength": 0.7,
            "control_image": images.digest(png(4))}  # fmt: skip
    for items in ("items.jsonl", "items.csv"):  # image paths relative to the batch file
        out = tmp_path / items.replace(".", "-")
        done = subprocess.run(
            [sys.executable, "-m", "sdfarm.cli.main", "batch", str(tmp_path / items), "--out",
             str(out), "--model", MODEL, "--redis", farm.url, "--json"],
            capture_output=True, text=True, timeout=600, cwd="/",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        (image,) = out.glob("*.png")
        meta = json.loads(image.with_suffix(".json").read_text())["metadata"]
        assert {k: meta[k] for k in want} == want, items
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "generate", "a door", "--model", MODEL,
         "--redis", farm.url, "--width", "64", "--height", "64", "--steps", "1", "--seed", "21",
         "--control-image", str(tmp_path / "edges.png"), "--control-strength", "0.7",
         "--control-net", CN, "--embeddings", EMB, "-o", str(tmp_path / "cli.png"), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert {k: json.loads(done.stdout)[k] for k in want} == want
    with served_gateway(farm.url, [], 300) as base:
        body = {"model": MODEL, "prompt": "a door", **SMALL, **want,
                "control_image": base64.b64encode(png(4)).decode()}  # fmt: skip
        created = httpx.post(f"{base}/v1/jobs", json=body, timeout=30)
        assert created.status_code == 202, created.text
        meta = client.job(created.json()["id"]).result(300).metadata
        assert {k: meta[k] for k in want} == want
        r = httpx.post(f"{base}/v1/jobs", json={**body, "control_net": "nope"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "control_net", r.text


def test_bad_input_is_refused_at_submit(client: Farm) -> None:
    before = sum(client.store.count_by_state().values())
    big = np.random.default_rng(0).integers(0, 256, (1800, 1800, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(big, "RGB").save(buf, "PNG", compress_level=0)  # 9.7 MB, over the cap
    cases = {
        "control_image": [
            {**control(), "control_image": b"\x89PNG\r\n\x1a\n garbage"},  # corrupt
            {**control(), "control_image": buf.getvalue()},  # oversized
            {**control(), "control_image": Path("/nonexistent/edges.png")},
            {"control_image": png(1)},  # without a ControlNet
        ],
        "control_net": [
            {**control(), "control_net": "nope"},  # unknown
            {**control(), "control_net": "../controlnets/" + CN},  # a path outside the folders
            {"control_net": CN},  # without a control image
        ],
        "control_strength": [{**control(), "control_strength": 7}],
        "embeddings": [
            {**control(), "embeddings": "nope"},
            {**control(), "embeddings": "../embeddings/sd1-emb"},
            {"embeddings": "sd1-emb,SD1-EMB"},  # one name twice, as the runtime matches
        ],
    }
    for field, bad in cases.items():
        for extra in bad:
            with pytest.raises(InvalidParameterError) as err:
                client.submit(MODEL, "bad", **SMALL, **extra)
            assert err.value.parameter == field, (field, str(err.value))
    assert sum(client.store.count_by_state().values()) == before  # nothing was queued


def past_the_client(client: Farm, spec: JobSpec, inputs: dict[str, bytes]) -> Job:
    """Queue `spec` as it is, without the client's checks (what a stale or hostile client
    could send)."""
    job_id, _, _ = client.store.submit(spec, 1000, new_job_id(), inputs)
    assert job_id is not None
    return Job(client, job_id)


def test_a_job_past_the_client_is_refused_by_the_worker_which_survives(client: Farm) -> None:
    good = validate(GenerationParams(prompt="past the client", **SMALL, **control()))
    doc, inputs = detach_images(good)
    cases = {
        # the worker's folders lack it (a farm where the client's look was stale)
        "unknown ControlNet 'gone'": (f"{MODEL}+control:gone", {**doc, "control_net": "gone"}),
        # the key and the parameters disagree: the worker loads what the parameters say
        "is not": (engine_key(MODEL, {}), doc),
        "invalid control_net": (KEY, {**doc, "control_net": "../x"}),
    }
    for why, (model, params) in cases.items():
        job = past_the_client(client, JobSpec(model=model, params=params), inputs)
        with pytest.raises(JobFailed, match=why):
            job.result(120)
        assert not [e for e in job.events() if e.get("event") == "loading"]  # nothing loaded
    corrupt = past_the_client(client, JobSpec(model=KEY, params=doc), {"control_image": png(9)})
    with pytest.raises(JobFailed, match="invalid control_image"):
        corrupt.result(120)
    out = client.submit(MODEL, "still here", **SMALL, **control()).result(300)
    assert Image.open(io.BytesIO(out.png)).size == (64, 64)  # the same worker goes on
