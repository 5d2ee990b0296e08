"""One job schema, every door: each generation parameter, set to a value that is not its
default, goes in through the CLI's flags (in-process and on a farm), a JSONL and a CSV batch
line, `Farm.submit`, the gateway's jobs JSON and its OpenAI body, and comes out in the metadata
the engine wrote and in the PNG's text chunk. In-process, the engine's native call is read back
from the runtime's own struct, so each parameter is shown to reach stable-diffusion.cpp.

VALUES must name every field of GenerationParams: a new parameter fails here until it is given
a value, and then it is walked through every door with the others.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sdfarm.client.farm import Farm
from sdfarm.native.engine import Engine
from sdfarm.native.params import NAMES, PARAMS, GenerationParams
from sdfarm.native.png import read_params

from helpers.gateway import cpu_farm, served_gateway

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"
VALUES: dict[str, Any] = {
    "prompt": "a schema walking through every door",
    "negative_prompt": "blurry, low quality",
    "width": 72,
    "height": 64,
    "steps": 2,
    "seed": 1234,
    "cfg_scale": 2.5,
    "sampler": "euler_a",
    "scheduler": "karras",
    "batch_count": 2,
    "clip_skip": 2,
}


def test_every_parameter_has_a_value_that_is_not_its_default() -> None:
    assert set(VALUES) == set(NAMES)
    for p in PARAMS:
        assert VALUES[p.name] != p.default, p.name
        assert p.check(VALUES[p.name]) == VALUES[p.name], p.name


def assert_recorded(meta: dict[str, Any], png: bytes, door: str) -> None:
    """The engine's metadata and the first PNG's text chunk carry every parameter."""
    chunk = read_params(png)
    for name, value in VALUES.items():
        assert meta[name] == value, f"{door}: metadata {name}={meta[name]!r}, sent {value!r}"
        assert chunk[name] == value, f"{door}: PNG chunk {name}={chunk[name]!r}, sent {value!r}"
    assert meta["seeds"] == [VALUES["seed"], VALUES["seed"] + 1], door


def sdfarm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def flags() -> list[str]:
    out = []
    for name, value in VALUES.items():
        if name != "prompt":
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


@pytest.fixture(scope="module")
def farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "schemahost") as f:
        yield f


@pytest.fixture(scope="module")
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="schema-tests") as f:
        yield f


def test_in_process_the_native_call_receives_every_parameter(models_dir: Path) -> None:
    with Engine.load(models_dir / MODEL, threads=1) as engine:
        result = engine.generate(GenerationParams(**VALUES))
        received = engine.last_call
    for name, value in VALUES.items():
        assert (
            received[name] == pytest.approx(value)
            if isinstance(value, float)
            else (received[name] == value)
        ), f"the runtime's struct has {name}={received[name]!r}, sent {value!r}"
    assert len(result.images) == VALUES["batch_count"]
    assert result.image.size == (VALUES["width"], VALUES["height"])


def test_cli_flags_in_process(models_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "in-process.png"
    done = sdfarm("generate", VALUES["prompt"], "--in-process", "--model", str(models_dir / MODEL),
                  *flags(), "--threads", "1", "-o", str(out), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_recorded(json.loads(done.stdout), out.read_bytes(), "generate --in-process")


def test_cli_flags_on_a_farm(farm: Any, tmp_path: Path) -> None:
    out = tmp_path / "farm.png"
    done = sdfarm("generate", VALUES["prompt"], "--model", MODEL, *flags(), "--redis", farm.url,
                  "-o", str(out), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_recorded(json.loads(done.stdout), out.read_bytes(), "generate on a farm")


def test_batch_jsonl_and_csv_lines(farm: Any, tmp_path: Path) -> None:
    jsonl = tmp_path / "items.jsonl"
    jsonl.write_text(json.dumps({"name": "from-jsonl", **VALUES}) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["name", *VALUES])
    writer.writeheader()
    writer.writerow({"name": "from-csv", **VALUES})
    table = tmp_path / "items.csv"
    table.write_text(buf.getvalue())
    for items in (jsonl, table):
        out = tmp_path / items.suffix[1:]
        done = sdfarm("batch", str(items), "--out", str(out), "--model", MODEL,
                      "--redis", farm.url, "--json")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        (png,) = out.glob("*.png")
        sidecar = json.loads(png.with_suffix(".json").read_text())
        assert_recorded(sidecar["metadata"], png.read_bytes(), f"batch {items.suffix}")


def test_farm_submit(client: Farm) -> None:
    result = client.submit(MODEL, **VALUES).result(120)
    assert_recorded(result.metadata, result.png, "Farm.submit")


def test_gateway_jobs_json_and_openai_body(farm: Any, client: Farm) -> None:
    with served_gateway(farm.url, [], 120) as base:
        created = httpx.post(f"{base}/v1/jobs", json={"model": MODEL, **VALUES}, timeout=30)
        assert created.status_code == 202, created.text
        result = client.job(created.json()["id"]).result(120)
        assert_recorded(result.metadata, result.png, "POST /v1/jobs")

        others = {k: v for k, v in VALUES.items() if k not in ("width", "height", "batch_count")}
        body = {"model": MODEL, **others, "size": f"{VALUES['width']}x{VALUES['height']}",
                "n": VALUES["batch_count"], "response_format": "b64_json"}  # fmt: skip
        answered = httpx.post(f"{base}/v1/images/generations", json=body, timeout=120)
        assert answered.status_code == 200, answered.text
    job_id = client.store.recent(1)[0]  # the job that ended last
    assert job_id != created.json()["id"]
    result = client.job(job_id).result(10)
    first = base64.b64decode(answered.json()["data"][0]["b64_json"])
    assert first == result.png
    assert_recorded(result.metadata, first, "POST /v1/images/generations")
