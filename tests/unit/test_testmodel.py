"""The tiny test model: names, shapes, dtypes and roles as specified, the same bytes every run."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.numpy import load_file

from sdfarm.native.headers import validate_header
from sdfarm.native.model import Model
from sdfarm.native.roles import detect_role
from sdfarm.native.testmodel import (
    PARTS,
    TENSORS_JSON,
    init_weight,
    make_test_model,
    tae_encoder_specs,
    tensor_specs,
)

SHARED_JSON = Path(__file__).resolve().parents[3] / "shared" / "data" / "ovis-tiny-tensors.json"
SPEC = {part: {n: list(s) for n, s in d.items()} for part, d in tensor_specs().items()}


def test_the_taesd_gains_an_encoder_as_the_runtime_builds_it() -> None:
    """The shipped tensors (the shared data) are the decoder's; the encoder follows
    TinyEncoder of master-596: layers 0..14 (3 blocks after each of 3 stride-2 convs)."""
    enc = tae_encoder_specs()
    assert set(SPEC["tae"]) == set(json.loads(TENSORS_JSON.read_text())["tae"]) | set(enc)
    layers = {int(n.split(".")[2]) for n in enc}
    assert layers == set(range(15))
    assert enc["encoder.layers.0.weight"] == (64, 3, 3, 3)
    assert enc["encoder.layers.14.weight"] == (16, 64, 3, 3)
    assert "encoder.layers.2.bias" not in enc  # the stride-2 convs have no bias
    assert enc["encoder.layers.13.conv.4.weight"] == (64, 64, 3, 3)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("tiny")
    start = time.perf_counter()
    dirs = make_test_model(out)
    assert time.perf_counter() - start < 5.0
    return dirs


def digests(folders: list[Path]) -> dict[str, str]:
    return {
        f"{folder.name}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in folders
        for p in sorted(folder.iterdir())
    }


def test_shipped_json_matches_shared_copy() -> None:
    if not SHARED_JSON.exists():
        pytest.skip("no shared checkout next to this repository")
    assert TENSORS_JSON.read_bytes() == SHARED_JSON.read_bytes()


def test_layout(model_dirs: list[Path]) -> None:
    assert [d.name for d in model_dirs] == ["tiny-f16", "tiny-q8_0"]
    assert sorted(p.name for p in model_dirs[0].iterdir()) == [
        "dit.safetensors",
        "llm.safetensors",
        "model.json",
        "taesd.safetensors",
    ]
    assert sorted(p.name for p in model_dirs[1].iterdir()) == [
        "dit.gguf",
        "llm.gguf",
        "model.json",
        "taesd.gguf",
    ]
    manifest = json.loads((model_dirs[1] / "model.json").read_text())
    assert manifest == {
        "files": {"diffusion_model": "dit.gguf", "llm": "llm.gguf", "taesd": "taesd.gguf"},
        "native_size": [256, 256],
    }


def test_safetensors_names_shapes_dtypes(model_dirs: list[Path]) -> None:
    for part, (stem, _role) in PARTS.items():
        tensors = load_file(str(model_dirs[0] / f"{stem}.safetensors"))
        assert {n: list(t.shape) for n, t in tensors.items()} == SPEC[part]
        for name, t in tensors.items():
            assert t.dtype == (np.float16 if t.ndim >= 2 else np.float32), name


def test_gguf_names_shapes_dtypes(model_dirs: list[Path]) -> None:
    quantized = 0
    expected = sum(len(s) >= 2 for part in ("dit", "llm") for s in SPEC[part].values())
    for part, (stem, _role) in PARTS.items():
        reader = GGUFReader(str(model_dirs[1] / f"{stem}.gguf"))
        # ggml stores dims innermost first: reversed, they equal the PyTorch shapes.
        shapes = {t.name: list(reversed(t.shape.tolist())) for t in reader.tensors}
        assert shapes == SPEC[part]
        for t in reader.tensors:
            shape = SPEC[part][t.name]
            if len(shape) == 1:
                want = GGMLQuantizationType.F32
            elif shape[-1] % 32 == 0:
                want = GGMLQuantizationType.Q8_0
            else:
                want = GGMLQuantizationType.F16
            assert t.tensor_type == want, t.name
            quantized += want == GGMLQuantizationType.Q8_0
    assert quantized == expected  # every 2-D weight of the DiT and the LLM (rows of 64+)


def test_gguf_and_safetensors_hold_the_same_weights(model_dirs: list[Path]) -> None:
    from gguf.quants import dequantize

    st = load_file(str(model_dirs[0] / "llm.safetensors"))
    reader = GGUFReader(str(model_dirs[1] / "llm.gguf"))
    for t in reader.tensors:
        ref = st[t.name].astype(np.float32)
        got = dequantize(t.data, t.tensor_type).reshape(ref.shape)
        assert np.allclose(got, ref, atol=0.02 * float(np.abs(ref).max()) + 1e-6), t.name


def test_weights_initialisation() -> None:
    assert (init_weight("dit", "txt_norm.scale", (64,)) == 1).all()
    assert (init_weight("llm", "model.layers.0.input_layernorm.weight", (64,)) == 1).all()
    assert (init_weight("dit", "img_in.bias", (128,)) == 0).all()
    w = init_weight("llm", "model.embed_tokens.weight", (151936, 64))
    assert abs(float(w.std()) - 1 / 8) < 0.002  # N(0, 1/fan_in), fan_in 64
    conv = init_weight("tae", "decoder.layers.0.weight", (64, 16, 3, 3))
    assert abs(float(conv.std()) - 1 / 12) < 0.005  # fan_in 16 * 3 * 3
    assert np.array_equal(w, init_weight("llm", "model.embed_tokens.weight", (151936, 64)))


def test_roles_from_headers_equal_manifest(model_dirs: list[Path]) -> None:
    for folder in model_dirs:
        manifest = json.loads((folder / "model.json").read_text())
        for role, fname in manifest["files"].items():
            assert detect_role(validate_header(folder / fname, role)) == role
        model = Model.from_dir(folder)
        assert model.native_size == (256, 256)
        assert set(model.files) == {"diffusion_model", "llm", "taesd"}


def test_sizes(model_dirs: list[Path]) -> None:
    f16 = Model.from_dir(model_dirs[0]).total_bytes
    q8 = Model.from_dir(model_dirs[1]).total_bytes
    assert 27_500_000 < f16 < 28_500_000  # measured 28.0 MB for a model that loads
    assert 17_000_000 < q8 < 17_500_000  # measured 17.2 MB


def test_idempotent(model_dirs: list[Path], tmp_path: Path) -> None:
    first = digests(model_dirs)
    assert digests(make_test_model(model_dirs[0].parent)) == first  # overwrite in place
    assert digests(make_test_model(tmp_path)) == first  # and in a fresh folder
    assert not [p for d in model_dirs for p in d.iterdir() if p.name.startswith(".")]


def _slow_write(path: str, marker: str) -> None:
    """One process's atomic write of `path`: 20 chunks with a pause between, so that two
    processes' writes overlap."""
    import time

    from sdfarm.native.testmodel import _write_atomically

    def write(tmp: Path) -> None:
        with tmp.open("w") as f:
            for _ in range(20):
                f.write(marker * 1000)
                f.flush()
                time.sleep(0.01)

    _write_atomically(Path(path), write)


def test_two_processes_writing_one_model_file_at_once_both_succeed(tmp_path: Path) -> None:
    """Two test workers on a fresh cache once wrote one file through the same temporary name:
    one renamed the other's half-written file away and the other failed (FileNotFoundError).
    Each writer now has its own, and the file is one writer's whole output."""
    import multiprocessing

    target = tmp_path / "model.gguf"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_slow_write, args=(str(target), m)) for m in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    text = target.read_text()
    assert text in ("a" * 20000, "b" * 20000)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["model.gguf"]  # no temporary left
