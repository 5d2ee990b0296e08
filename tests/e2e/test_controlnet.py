"""ControlNet and textual-inversion embeddings on the real runtime, with the random-weight SD 1.x
model (`sd1_dir`: the tiny Ovis model takes neither): the pixels follow the control image, its
strength and the embedding, the same inputs give the same pixels in another process, and what
the runtime cannot take is refused before any native call."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdfarm.native.controlnets import ControlNetCatalog, controlnet_dirs
from sdfarm.native.embeddings import EmbeddingCatalog, embedding_dirs
from sdfarm.native.engine import Engine
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.params import GenerationParams

pytestmark = pytest.mark.e2e

CN, EMB = "sd1-control", "sd1-emb"


def png(seed: int, size: tuple[int, int] = (64, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return buf.getvalue()


CHILD = r"""
import hashlib, io, json, sys
from pathlib import Path
import numpy as np
from PIL import Image
from sdfarm.native.controlnets import ControlNetCatalog, controlnet_dirs
from sdfarm.native.embeddings import EmbeddingCatalog, embedding_dirs
from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.params import GenerationParams

root, only_base = Path(sys.argv[1]), sys.argv[2] == "base"

def png(seed, size=(64, 64)):
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return buf.getvalue()

cn = ControlNetCatalog(controlnet_dirs([root])).load("sd1-control")
emb = EmbeddingCatalog(embedding_dirs([root])).load("sd1-emb")
base = dict(prompt="a lighthouse sd1-emb", seed=5, width=64, height=64, steps=1,
            control_net="sd1-control", control_image=png(1), control_strength=0.9)
variants = {
    "base": {"embeddings": "sd1-emb"},
    "other_image": {"embeddings": "sd1-emb", "control_image": png(2)},
    "other_strength": {"embeddings": "sd1-emb", "control_strength": 0.3},
    "resized": {"embeddings": "sd1-emb", "control_image": png(1, (96, 80))},
}
out = {}

def run(engine, name, extra):
    log = LogConfig(level="debug", log_prompts=True)  # the runtime says when it applies one
    r = engine.generate(GenerationParams(**{**base, **extra}), log=log)
    out[name] = {"sha": hashlib.sha256(r.image.tobytes()).hexdigest(),
                 "mean": float(np.asarray(r.image, dtype=np.float64).mean()),
                 "warnings": r.metadata["warnings"],
                 "applied": [x.message for x in r.records if "applied, custom" in x.message],
                 "call": {
                     k: r.metadata.get(k) for k in ("control_net", "embeddings",
                                                     "control_strength")},
                 "read_back": {k: engine.last_call[k] for k in (
                     "control_image", "control_strength", "control_net", "embeddings")}}

with Engine.load(root / "sd1-tiny", threads=2, control_net=cn, embeddings=[emb]) as e:
    for name, extra in variants.items():
        if name == "base" or not only_base:
            run(e, name, extra)
if not only_base:
    with Engine.load(root / "sd1-tiny", threads=2, control_net=cn) as e:  # no embedding
        run(e, "no_embedding", {})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(sd1_dir: Path) -> list[dict]:
    """Every variant generated in one process, the first again in another."""
    out = []
    for which in ("all", "base"):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(sd1_dir), which], capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def test_the_same_inputs_give_the_same_pixels_in_another_process(runs: list[dict]) -> None:
    first, second = runs
    assert list(second) == ["base"]
    assert first["base"]["sha"] == second["base"]["sha"]


def test_the_pixels_follow_the_control_image_its_strength_and_the_embedding(
    runs: list[dict],
) -> None:
    shas = {name: v["sha"] for name, v in runs[0].items()}
    assert len(set(shas.values())) == len(shas), shas  # every variant differs from the others
    base = runs[0]["base"]
    assert base["read_back"] == {"control_image": "64x64x3", "control_strength": pytest.approx(0.9),
                                 "control_net": CN, "embeddings": EMB}  # fmt: skip
    assert runs[0]["other_strength"]["read_back"]["control_strength"] == pytest.approx(0.3)
    assert runs[0]["no_embedding"]["read_back"]["embeddings"] == ""
    # the runtime read the embedding's 4 vectors for the prompt naming it, and none without
    assert base["applied"] == [
        "stable_diffusion: embedding 'sd1-emb' applied, custom embeddings: 4"
    ]
    assert runs[0]["no_embedding"]["applied"] == []


def test_a_control_image_of_another_size_is_resized_and_the_job_says_so(runs: list[dict]) -> None:
    resized = runs[0]["resized"]
    assert resized["read_back"]["control_image"] == "64x64x3"  # what the runtime received
    assert "control_image was resized to 64x64, the job's size" in resized["warnings"]
    assert not any("resized" in w for w in runs[0]["base"]["warnings"])


def test_what_the_engine_was_not_loaded_with_is_refused_before_any_native_call(
    sd1_dir: Path, tiny_models: list[Path]
) -> None:
    cn = ControlNetCatalog(controlnet_dirs([sd1_dir])).load(CN)
    emb = EmbeddingCatalog(embedding_dirs([sd1_dir])).load(EMB)
    small = {"prompt": "x", "width": 64, "height": 64, "steps": 1, "seed": 1}
    # a model the runtime applies neither to: refused before its context is made
    for kwargs, field in (
        ({"control_net": cn}, "control_net"),
        ({"embeddings": [emb]}, "embeddings"),
    ):
        with pytest.raises(InvalidParameterError) as err:
            Engine.load(tiny_models[0], threads=1, **kwargs)
        assert err.value.parameter == field and "tiny-f16" in str(err.value)
    with Engine.load(sd1_dir / "sd1-tiny", threads=2) as engine:  # the model alone
        calls = engine.native_calls
        cases = {
            "control_net": {"control_net": CN, "control_image": png(1)},  # not loaded with it
            "embeddings": {"embeddings": EMB},
            "control_image": {"control_net": CN, "control_image": b"\x89PNG\r\n\x1a\n garbage"},
            # the runtime's hires pass reuses the first pass's hint: 72x64 x2 aborts it
            "hires_scale": {
                "control_net": CN,
                "control_image": png(1),
                "hires_scale": 2.0,
                "width": 72,
            },  # fmt: skip
        }
        for field, extra in cases.items():
            with pytest.raises(InvalidParameterError) as err:
                engine.generate(GenerationParams(**{**small, **extra}))
            assert err.value.parameter == field, (field, str(err.value))
        assert engine.native_calls == calls  # nothing reached the runtime
        assert engine.generate(GenerationParams(**small)).image.size == (64, 64)  # still usable
    with pytest.raises(ModelLoadError, match="unknown ControlNet 'nope'"):
        ControlNetCatalog(controlnet_dirs([sd1_dir])).load("nope")
    with pytest.raises(ModelLoadError, match="invalid ControlNet name"):
        ControlNetCatalog(controlnet_dirs([sd1_dir])).load("../controlnets/" + CN)


def test_the_cli_in_process_takes_the_control_flags(sd1_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "edges.png").write_bytes(png(3))
    out = tmp_path / "out.png"
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "generate", "a cat sd1-emb", "--in-process",
         "--model", "sd1-tiny", "--models", str(sd1_dir), "--width", "64", "--height", "64",
         "--steps", "1", "--seed", "3", "--control-image", str(tmp_path / "edges.png"),
         "--control-strength", "0.5", "--control-net", CN, "--embeddings", EMB,
         "-o", str(out), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads(done.stdout)
    assert meta["control_net"] == CN and meta["embeddings"] == EMB
    assert meta["control_strength"] == 0.5
    assert meta["control_image"] == "sha256:" + hashlib.sha256(png(3)).hexdigest()
    assert Image.open(out).size == (64, 64)
