"""`sdfarm convert` on the real runtime: the tiny model converted to q8_0 and to a k-quant is a
new model folder the catalog lists, an engine loads and generates from (the same seed, the
same pixels); every refusal comes before any native call and writes nothing; a runtime that
aborts costs only the child process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdfarm.cli.main import EXIT_INVALID, EXIT_LOAD, main
from sdfarm.native import convert as convert_mod
from sdfarm.native.catalog import Catalog
from sdfarm.native.engine import Engine
from sdfarm.native.params import GenerationParams

from helpers.badmodels import make_broken_model

pytestmark = pytest.mark.e2e
SMALL = {"width": 64, "height": 64, "steps": 1}


@pytest.fixture(scope="module")
def mdir(tiny_models: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory of its own holding a copy of tiny-f16 (conversions add folders)."""
    d = tmp_path_factory.mktemp("convert-models")
    shutil.copytree(tiny_models[0], d / "tiny-f16")
    return d


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def sdfarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def pixels(folder: Path, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    with Engine.load(folder) as e:
        a = e.generate(GenerationParams(prompt="a lighthouse", seed=seed, **SMALL)).image
        b = e.generate(GenerationParams(prompt="a lighthouse", seed=seed, **SMALL)).image
    assert a.size == (64, 64)
    return np.asarray(a), np.asarray(b)


def test_q8_0_is_a_new_smaller_model_that_generates(mdir: Path) -> None:
    done = sdfarm("convert", "tiny-f16", "--type", "q8_0", "--models", str(mdir), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    out = mdir / "tiny-f16-q8_0"
    assert doc["model"] == "tiny-f16-q8_0" and Path(doc["folder"]) == out
    manifest = json.loads((out / "model.json").read_text())
    assert manifest["files"] == {
        "diffusion_model": "dit.gguf", "llm": "llm.gguf", "taesd": "taesd.safetensors",
    }  # fmt: skip
    assert doc["bytes_after"] < 0.7 * doc["bytes_before"]
    assert {f["role"]: f["action"] for f in doc["files"]}["taesd"] == "copy"
    est = doc["estimates"][0]
    assert doc["bytes_after"] < est["estimate"] < est["estimate_before"]
    assert "tiny-f16-q8_0" in Catalog([mdir]).names()
    assert str(mdir) not in json.dumps(doc["child"])  # no paths in the records
    a, b = pixels(out)
    assert np.array_equal(a, b)


def test_a_k_quant_converts_and_generates(mdir: Path) -> None:
    p = convert_mod.plan("tiny-f16", "Q4_K", [str(mdir)])
    doc = convert_mod.convert_model(p)
    assert doc["model"] == "tiny-f16-q4_k"
    # Rows must be whole 256-blocks for a k-quant: few of the tiny model's are, so it shrinks
    # a little (q8_0, 32-blocks, converts far more).
    assert doc["bytes_after"] < doc["bytes_before"]
    a, b = pixels(mdir / "tiny-f16-q4_k")
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["tiny-f16", "--type", "q9_9"], EXIT_INVALID, "types: f32, f16"),
        (["tiny-f16", "--type", "q8_1"], EXIT_INVALID, "not a type the runtime converts to"),
        (["../x", "--type", "q8_0"], EXIT_LOAD, "invalid model name"),
        (["tiny-f16", "--type", "q8_0", "--out", "../y"], EXIT_INVALID, "not a model name"),
        (["tiny-f16", "--type", "q8_0", "--out", "tiny-f16"], EXIT_INVALID, "already exists"),
        (["tiny-f16", "--type", "q8_0", "--tensor-type-rules", "dit=q7"], EXIT_INVALID, "q7"),
        (["tiny-f16", "--type", "q8_0", "--tensor-type-rules", "(=f16"], EXIT_INVALID, "compile"),
    ],
)
def test_refusals_come_first_and_write_nothing(
    mdir: Path, capsys: pytest.CaptureFixture, args: list, code: int, words: str
) -> None:
    """Each refusal is the check's own message (no conversion ran to produce it) and the
    models folder is as it was, hidden working folders included."""
    before = listing(mdir)
    assert main(["convert", *args, "--models", str(mdir), "--json"]) == code
    err = json.loads(capsys.readouterr().out)["error"]
    assert words in err["message"]
    assert listing(mdir) == before


def test_a_corrupt_model_file_is_refused_before_the_runtime(
    mdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    make_broken_model(mdir / "tiny-f16", tmp_path / "broken", "truncated")
    before = listing(tmp_path)
    assert main(["convert", "broken", "--type", "q8_0", "--models", str(tmp_path)]) == EXIT_LOAD
    assert "dit.safetensors" in capsys.readouterr().err
    assert listing(tmp_path) == before


def test_a_runtime_abort_costs_the_child_only_and_leaves_nothing(mdir: Path) -> None:
    # A named group compiles in Python but not in the runtime's std::regex (ECMAScript), which
    # throws an uncaught exception inside `convert`: the child dies of SIGABRT.
    before = listing(mdir)
    p = convert_mod.plan("tiny-f16", "q4_0", [str(mdir)], "crashed", rules="(?P<a>x)=f16")
    with pytest.raises(convert_mod.ConversionError, match="SIGABRT"):
        convert_mod.convert_model(p)
    assert listing(mdir) == before
