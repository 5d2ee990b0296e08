"""One job schema, every door: each generation parameter (the input images included), set to
a value that is not its default, goes in through the CLI's flags (in-process and on a farm), a
JSONL and a CSV batch line, `Farm.submit`, the gateway's jobs JSON and its OpenAI body, and
comes out in the metadata the engine wrote and in the PNG's text chunk (an image by its
digest). In-process, the engine's native call is read back from the runtime's own struct, so
each parameter is shown to reach stable-diffusion.cpp.

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
from sdfarm.native.images import digest
from sdfarm.native.loras import LoraCatalog, lora_dirs
from sdfarm.native.params import IMAGE_PARAMS, NAMES, PARAMS, GenerationParams
from sdfarm.native.png import read_params
from sdfarm.native.upscalers import UpscalerCatalog, upscaler_dirs

from helpers.gateway import cpu_farm, served_gateway

pytestmark = pytest.mark.e2e

MODEL = "tiny-f16"


def _png(seed: int, size: tuple[int, int], mode: str = "RGB") -> bytes:
    import numpy as np
    from PIL import Image

    channels = 3 if mode == "RGB" else 1
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.squeeze(), mode).save(buf, "PNG")
    return buf.getvalue()


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
    "init_image": _png(1, (72, 64)),
    "strength": 0.25,
    "mask_image": _png(2, (72, 64), "L"),
    "ref_images": (_png(3, (48, 40)),),
    "loras": (("tiny-lora", 0.75),),
    "hires_scale": 1.5,
    "hires_steps": 1,
    "hires_strength": 0.5,
    "hires_upscaler": "tiny-esrgan-x2",
    "hires_tile_size": 64,
    "step_cache": "easycache",
    "vae_tiling": "on",
    # The tiny model's only decoder is its TAESD: the job names it (on an engine of its own
    # key, tiny-f16+decoder:taesd); tests/e2e/test_decoder.py chooses between two decoders.
    "decoder": "taesd",
    "preview_every": 1,
}
SD1_VALUES: dict[str, Any] = {
    "control_image": _png(4, (64, 64)),
    "control_strength": 0.7,
    "control_net": "sd1-control",
    "embeddings": "sd1-emb",
}
"""The parameters the tiny model cannot take (the runtime applies ControlNet and embeddings to
SD 1.x/2.x/XL only): tests/e2e/test_controlnet_farm.py walks them through every door with the
random-weight SD 1.x model, and test_controlnet.py reads them back from the native call."""
IMAGES = {p.name: p.kind for p in IMAGE_PARAMS if p.name in VALUES}


def recorded(name: str) -> Any:
    """What the metadata and the PNG chunk record for VALUES[name]: an image by its digest,
    LoRAs as [name, weight] lists (JSON)."""
    value = VALUES[name]
    if name == "loras":
        return [list(pair) for pair in value]
    if IMAGES.get(name) == "image":
        return digest(value)
    if IMAGES.get(name) == "images":
        return [digest(v) for v in value]
    return value


def as_json(name: str) -> Any:
    """VALUES[name] as a JSON body carries it: an image base64, a LoRA as [name, weight]."""
    value = VALUES[name]
    if name == "loras":
        return [list(pair) for pair in value]
    if IMAGES.get(name) == "image":
        return base64.b64encode(value).decode()
    if IMAGES.get(name) == "images":
        return [base64.b64encode(v).decode() for v in value]
    return value


def test_every_parameter_has_a_value_that_is_not_its_default() -> None:
    assert set(VALUES) | set(SD1_VALUES) == set(NAMES) and not set(VALUES) & set(SD1_VALUES)
    for p in PARAMS:
        value = VALUES[p.name] if p.name in VALUES else SD1_VALUES[p.name]
        assert value != p.default, p.name
        assert p.check(value) == value, p.name


def assert_recorded(meta: dict[str, Any], png: bytes, door: str) -> None:
    """The engine's metadata and the first PNG's text chunk carry every parameter."""
    chunk = read_params(png)
    for name in VALUES:
        want = recorded(name)
        assert meta[name] == want, f"{door}: metadata {name}={meta[name]!r}, sent {want!r}"
        assert chunk[name] == want, f"{door}: PNG chunk {name}={chunk[name]!r}, sent {want!r}"
    assert meta["seeds"] == [VALUES["seed"], VALUES["seed"] + 1], door


def sdfarm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def image_files(folder: Path) -> dict[str, Any]:
    """VALUES's images written as files in `folder`: {name: file name, or names}."""
    out: dict[str, Any] = {}
    for name, kind in IMAGES.items():
        values = VALUES[name] if kind == "images" else [VALUES[name]]
        names = []
        for i, data in enumerate(values):
            (folder / f"{name}-{i}.png").write_bytes(data)
            names.append(f"{name}-{i}.png")
        out[name] = names if kind == "images" else names[0]
    return out


def flags(folder: Path) -> list[str]:
    files = image_files(folder)
    out = []
    for name, value in VALUES.items():
        flag = "--" + name.replace("_", "-")
        if name in IMAGES:
            for f in files[name] if IMAGES[name] == "images" else [files[name]]:
                out += [flag, str(folder / f)]
        elif name == "loras":
            for lora, weight in value:
                out += [flag, f"{lora}:{weight}"]
        elif name != "prompt":
            out += [flag, str(value)]
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
    catalog = LoraCatalog(lora_dirs([models_dir]))
    loras = {name: catalog.load(name) for name, _ in VALUES["loras"]}
    hires = UpscalerCatalog(upscaler_dirs([models_dir])).load(VALUES["hires_upscaler"])
    with Engine.load(models_dir / MODEL, threads=1) as engine:
        previews: list[Any] = []
        result = engine.generate(
            GenerationParams(**VALUES),
            loras=loras,
            upscalers={hires.name: hires},
            preview=previews.append,
        )
        received = engine.last_call
    assert previews and all(p.step >= 1 for p in previews)  # preview_every reached the caller
    shapes = {
        "init_image": "72x64x3",  # the job's size, RGB
        "mask_image": "72x64x1",  # one channel
        "ref_images": ["48x40x3"],  # its own size
        "loras": [["tiny-lora", pytest.approx(0.75)]],  # the file's name, the multiplier
    }
    for name, value in VALUES.items():
        want = shapes.get(name, value)
        got = received[name]
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, (
            f"the runtime's struct has {name}={got!r}, sent {want!r}"
        )
    assert len(result.images) == VALUES["batch_count"]
    assert result.image.size == (112, 96)  # 72x64 times hires_scale 1.5, in 8-pixel cells
    assert received["hires_size"] == "112x96"


def test_cli_flags_in_process(models_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "in-process.png"
    done = sdfarm("generate", VALUES["prompt"], "--in-process", "--model", str(models_dir / MODEL),
                  *flags(tmp_path), "--threads", "1", "-o", str(out), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_recorded(json.loads(done.stdout), out.read_bytes(), "generate --in-process")


def test_cli_flags_on_a_farm(farm: Any, tmp_path: Path) -> None:
    out = tmp_path / "farm.png"
    done = sdfarm("generate", VALUES["prompt"], "--model", MODEL, *flags(tmp_path),
                  "--redis", farm.url, "-o", str(out), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_recorded(json.loads(done.stdout), out.read_bytes(), "generate on a farm")


def test_batch_jsonl_and_csv_lines(farm: Any, tmp_path: Path) -> None:
    files = image_files(tmp_path)  # paths in a batch file are relative to its folder
    line = {**VALUES, **files}
    jsonl = tmp_path / "items.jsonl"
    jsonl.write_text(json.dumps({"name": "from-jsonl", **line}) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["name", *VALUES])
    writer.writeheader()
    writer.writerow({"name": "from-csv", **line, "ref_images": ";".join(files["ref_images"]),
                     "loras": ";".join(f"{n}:{w}" for n, w in VALUES["loras"])})  # fmt: skip
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
        sent = {k: as_json(k) for k in VALUES}
        created = httpx.post(f"{base}/v1/jobs", json={"model": MODEL, **sent}, timeout=30)
        assert created.status_code == 202, created.text
        result = client.job(created.json()["id"]).result(120)
        assert_recorded(result.metadata, result.png, "POST /v1/jobs")

        others = {k: v for k, v in sent.items() if k not in ("width", "height", "batch_count")}
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
