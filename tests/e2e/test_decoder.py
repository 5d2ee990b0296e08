"""A job's decoder on the real runtime with the tiny model that has both a full VAE and a
TAESD (`tiny-vae`, sdfarm.native.testmodel.make_vae_test_model): the TAESD decodes another
image from the same latent; the same job and seed give the same pixels in every process (two
CLI processes, the farm's worker); the result and the PNG's JSON chunk say which decoder made
the image; a model without a TAESD file is refused by name before any native call (by the
engine, the in-process CLI and the farm's client), and every door takes the field."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
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

from sdfarm.client.farm import Farm
from sdfarm.native.engine import Engine
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.model import Model
from sdfarm.native.png import read_params
from sdfarm.native.testmodel import VAE_VARIANT, make_vae_test_model
from sdfarm.store import keys

from helpers.gateway import served_gateway

pytestmark = pytest.mark.e2e

BARE = "tiny-vae-bare"
ONLY = "tiny-taesd-only"
SMALL = {"width": 64, "height": 64, "steps": 1, "seed": 31}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory: `tiny-vae` (VAE + TAESD), `tiny-vae-bare` (the same files without
    the TAESD) and `tiny-taesd-only` (without the VAE); roles detected from the headers."""
    out = tmp_path_factory.mktemp("decoder-models")
    folder = make_vae_test_model(out)
    for name, decoder in ((BARE, "vae"), (ONLY, "taesd")):
        (out / name).mkdir()
        for file in ("dit", "llm", decoder):
            shutil.copy(folder / f"{file}.safetensors", out / name / f"{file}.safetensors")
    return out


def pixels(image: Image.Image | bytes) -> np.ndarray:
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def sdfarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def engine_images(models: Path) -> dict[str, np.ndarray]:
    """{decoder: the in-process engine's image of the same job}: one engine per decoder,
    as the runtime fixes the decoder when it makes a context."""
    out = {}
    for decoder in ("vae", "taesd"):
        engine = Engine.load(models / VAE_VARIANT, decoder=decoder, threads=2)
        try:
            assert engine.decoder == decoder and engine.preview_mode == "tae"
            result = engine.generate(prompt="a red barn", decoder=decoder, **SMALL)
            again = engine.generate(prompt="a red barn", decoder=decoder, **SMALL)
            assert result.metadata["decoder"] == result.params.decoder == decoder
            assert engine.last_call["decoder"] == decoder  # read back from the context's struct
            assert (pixels(result.image) == pixels(again.image)).all()
            out[decoder] = pixels(result.image)
            if decoder == "vae":  # the default engine of a model with a VAE is this one
                with pytest.raises(InvalidParameterError, match="loaded with vae"):
                    engine.generate(prompt="x", decoder="taesd", **SMALL)
        finally:
            engine.dispose()
    return out


def test_the_taesd_decodes_another_image_of_the_same_latent(engine_images) -> None:
    vae, taesd = engine_images["vae"], engine_images["taesd"]
    assert vae.shape == taesd.shape == (64, 64, 3)
    # Random weights: the two decoders share nothing but the latent, so the images differ
    # everywhere (bench/decoder_quality.py measures by how much).
    assert np.abs(vae - taesd).mean() > 10


def test_same_job_and_seed_give_the_same_pixels_in_two_processes(
    models: Path, engine_images, tmp_path: Path
) -> None:
    outs = []
    for i in range(2):
        out = tmp_path / f"{i}.png"
        done = sdfarm(
            "generate", "a red barn", "--in-process", "--models", str(models), "--model",
            VAE_VARIANT, "--decoder", "taesd", "--width", "64", "--height", "64", "--steps",
            "1", "--seed", "31", "--threads", "2", "-o", str(out), "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["decoder"] == "taesd"
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]  # the same PNG bytes
    assert (pixels(outs[0]) == engine_images["taesd"]).all()  # and this process's pixels
    assert read_params(outs[0])["decoder"] == "taesd"


def test_a_model_without_a_taesd_is_refused_before_any_native_call(models: Path, tmp_path):
    with pytest.raises(InvalidParameterError) as info:
        Engine.load(models / BARE, decoder="taesd")
    assert info.value.parameter == "decoder"
    assert "has no TAESD file (role taesd): it decodes with vae" in str(info.value)
    engine = Engine.load(models / BARE, threads=2)  # its own decoder is fine
    try:
        assert engine.decoder == "vae" and engine.preview_mode == "proj"
        before = engine.native_calls
        with pytest.raises(InvalidParameterError, match="no TAESD file"):
            engine.generate(prompt="x", decoder="taesd", **SMALL)
        assert engine.native_calls == before
    finally:
        engine.dispose()
    done = sdfarm(
        "generate", "x", "--in-process", "--models", str(models), "--model", BARE,
        "--decoder", "taesd", "-o", str(tmp_path / "x.png"), "--json",
    )  # fmt: skip
    assert done.returncode != 0
    assert "no TAESD file" in done.stdout + done.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.fixture(scope="module")
def farm(models: Path) -> Iterator[Any]:
    from sdfarm.localfarm.farm import LocalFarm

    f = LocalFarm([models], devices=["CPU"], threads=2, host="dechost", announce=False,
                  worker_args=["--memory-limit", "4GiB"], env=dict(os.environ))  # fmt: skip
    with f:
        yield f


@pytest.fixture(scope="module")
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="decoder-tests") as f:
        yield f


def test_the_farm_runs_a_taesd_job_on_its_own_engine(client: Farm, engine_images) -> None:
    plain = client.submit(VAE_VARIANT, "a red barn", **SMALL).result(300)
    fast = client.submit(VAE_VARIANT, "a red barn", decoder="taesd", **SMALL).result(300)
    assert plain.metadata["decoder"] == "vae" and fast.metadata["decoder"] == "taesd"
    assert fast.metadata["engine"] == f"{VAE_VARIANT}+decoder:taesd"
    assert fast.metadata["model"] == VAE_VARIANT
    # The worker's pixels are the in-process engine's: the same job, another process.
    assert (pixels(plain.png) == engine_images["vae"]).all()
    assert (pixels(fast.png) == engine_images["taesd"]).all()
    assert read_params(fast.png)["decoder"] == "taesd"
    assert read_params(plain.png)["decoder"] == "vae"
    # Both engines are listed by the heartbeat, which lags a load by up to an interval.
    want = {VAE_VARIANT, f"{VAE_VARIANT}+decoder:taesd"}
    settle = time.monotonic() + 3 * keys.HEARTBEAT_INTERVAL
    while not want <= (loaded := _loaded(client)):
        assert time.monotonic() < settle, f"the heartbeat lists {loaded}, not {want}"
        time.sleep(0.2)


def _loaded(client: Farm) -> set[str]:
    return {m["name"] for d in client.status()["devices"] for m in d.get("loaded") or []}


def test_the_farm_refuses_a_decoder_the_model_lacks_at_submit(client: Farm) -> None:
    with pytest.raises(InvalidParameterError, match="no TAESD file") as info:
        client.submit(BARE, "x", decoder="taesd", **SMALL)
    assert info.value.parameter == "decoder"
    with pytest.raises(InvalidParameterError, match="no full VAE: it decodes with taesd"):
        client.submit(ONLY, "x", decoder="vae", **SMALL)
    # Its own decoder is its TAESD: a job that names it runs (on an engine of its own key).
    assert (
        client.submit(ONLY, "x", decoder="taesd", **SMALL).result(300).metadata["decoder"]
        == "taesd"
    )


def test_the_cli_batch_and_gateway_take_the_decoder(farm: Any, client: Farm, tmp_path) -> None:
    line = {"name": "j", "prompt": "a red barn", **SMALL, "decoder": "taesd"}
    (tmp_path / "items.jsonl").write_text(json.dumps(line) + "\n")
    out = tmp_path / "out"
    done = sdfarm("batch", str(tmp_path / "items.jsonl"), "--out", str(out), "--model",
                  VAE_VARIANT, "--redis", farm.url, "--json")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (image,) = out.glob("*.png")
    assert read_params(image.read_bytes())["decoder"] == "taesd"
    done = sdfarm("generate", "a red barn", "--model", VAE_VARIANT, "--redis", farm.url,
                  "--decoder", "taesd", "--width", "64", "--height", "64", "--steps", "1",
                  "--seed", "31", "-o", str(tmp_path / "cli.png"), "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decoder"] == "taesd"
    with served_gateway(farm.url, [], 300) as base:
        body = {"model": VAE_VARIANT, "prompt": "a red barn", **SMALL, "decoder": "taesd"}
        created = httpx.post(f"{base}/v1/jobs", json=body, timeout=30)
        assert created.status_code == 202, created.text
        assert client.job(created.json()["id"]).result(300).metadata["decoder"] == "taesd"
        bad = httpx.post(f"{base}/v1/jobs", json={**body, "model": BARE}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "decoder", bad.text
        # The OpenAI door takes it too, as an extra field beside OpenAI's own.
        openai = {"model": VAE_VARIANT, "prompt": "a red barn", "size": "64x64", "steps": 1,
                  "seed": 31, "decoder": "taesd", "response_format": "b64_json"}  # fmt: skip
        r = httpx.post(f"{base}/v1/images/generations", json=openai, timeout=300)
        assert r.status_code == 200, r.text
        made = base64.b64decode(r.json()["data"][0]["b64_json"])
        assert read_params(made)["decoder"] == "taesd"


def test_make_test_model_writes_the_vae_variant(tmp_path: Path) -> None:
    done = sdfarm("make-test-model", str(tmp_path), "--vae", "--json")
    assert done.returncode == 0, done.stderr
    (folder,) = [Path(d) for d in json.loads(done.stdout)["models"] if d.endswith(VAE_VARIANT)]
    assert Model.from_dir(folder).decoders == ("vae", "taesd")
