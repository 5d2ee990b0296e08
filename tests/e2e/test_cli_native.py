"""`sdfarm generate --in-process`, `sdfarm devices` and `sdfarm make-test-model` as a user
runs them: separate processes, JSON on stdout, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.badmodels import make_sparse_huge_model

SMALL = ["--width", "64", "--height", "64", "--steps", "1"]


def sdfarm(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def one_json(out: str) -> dict:
    """stdout must be exactly one JSON document."""
    doc, end = json.JSONDecoder().raw_decode(out)
    assert out[end:].strip() == ""
    return doc


def test_same_seed_gives_the_same_png_bytes_across_processes(tiny_models, tmp_path):
    outs = []
    for i, seed in enumerate(["42", "42", "43"]):
        out = tmp_path / f"{i}.png"
        done = sdfarm(
            "generate",
            "--in-process",
            "--model",
            str(tiny_models[0]),
            "a red kite",
            "--seed",
            seed,
            "-o",
            str(out),
            *SMALL,
            "--json",
        )
        assert done.returncode == 0, done.stderr
        assert one_json(done.stdout)["seed"] == int(seed)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_debug_json_records_are_prefixed_scrubbed_and_stdout_is_one_document(tiny_models, tmp_path):
    prompt = "an axolotl reading tax forms"
    base = [
        "generate",
        "--in-process",
        "--model",
        str(tiny_models[0]),
        prompt,
        "--seed",
        "1",
        "-o",
        str(tmp_path / "x.png"),
        *SMALL,
        "--json",
        "--log-level",
        "debug",
    ]
    doc = one_json(sdfarm(*base).stdout)
    records = doc["records"]
    assert len(records) > 20
    assert all(r["message"].startswith("stable_diffusion: ") for r in records)
    text = json.dumps(records)
    assert str(tiny_models[0]) not in text and str(tiny_models[0].parent) not in text
    assert "axolotl" not in text and "tax forms" not in text
    opted = one_json(sdfarm(*base, "--log-prompts").stdout)
    assert "axolotl" in json.dumps(opted["records"])


@pytest.mark.parametrize(
    ("flags", "param"),
    [
        (["--width", "0"], "width"),
        (["--height", "-8"], "height"),
        (["--steps", "0"], "steps"),
        (["--steps", "-1"], "steps"),
        (["--width", "100000", "--height", "100000"], "width"),
        (["--sampler", "warp_drive"], "sampler"),
    ],
)
def test_bad_parameters_are_refused_before_the_model_is_even_looked_at(flags, param, tmp_path):
    done = sdfarm(
        "generate",
        "--in-process",
        "--model",
        str(tmp_path / "no-such-model"),
        "p",
        *flags,
        "--json",
    )
    assert done.returncode == 2
    err = one_json(done.stdout)["error"]
    assert err["type"] == "InvalidParameterError" and err["parameter"] == param
    assert param in err["message"]


def test_huge_model_refused_then_load_error_without_the_check(tiny_models, tmp_path):
    huge = make_sparse_huge_model(tiny_models[0], tmp_path / "huge")
    args = [
        "generate",
        "--in-process",
        "--model",
        str(huge),
        "p",
        *SMALL,
        "--json",
        "-o",
        str(tmp_path / "h.png"),
    ]
    refused = sdfarm(*args)
    assert refused.returncode == 3
    err = one_json(refused.stdout)["error"]
    assert err["type"] == "ModelTooLargeError" and err["estimate"] > 200 * 10**9
    assert "MemAvailable" in err["message"] and "MemAvailable" in err["figures"]
    failed = sdfarm(*args, "--no-check-memory")
    assert failed.returncode == 4
    err = one_json(failed.stdout)["error"]
    assert err["type"] == "ModelLoadError" and "wrong shape" in err["message"]
    assert not (tmp_path / "h.png").exists()


def test_devices_json_lists_the_cpu_and_the_choices():
    done = sdfarm("devices", "--json")
    assert done.returncode == 0, done.stderr
    doc = one_json(done.stdout)
    names = [d["name"] for d in doc["devices"]]
    assert "CPU" in names
    assert doc["mem_available"] > 0
    assert doc["choice"]["cpu"] == "CPU" and doc["choice"]["auto"] in names
    assert doc["sd_version"] == "master-596-90e87bc"


def test_a_runtime_built_elsewhere_loads_through_sdfarm_runtime_dir(tmp_path):
    """SDFARM_RUNTIME_DIR: a build carried from another machine (library, headers and
    build.json only) is used as it is, with an empty cache and nothing built but our shim; a
    backend that contradicts it is refused by name."""
    import os
    import shutil

    from sdfarm.native.build import ensure_runtime

    built = Path(ensure_runtime("cpu").directory)
    carried = tmp_path / "carried"
    carried.mkdir()
    for name in ("build.json", "include", *[p.name for p in built.glob("libstable-diffusion.*")]):
        src = built / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, carried / name)
    cache = tmp_path / "empty-cache"
    env = {**os.environ, "SDFARM_RUNTIME_DIR": str(carried), "SDFARM_CACHE": str(cache)}
    env.pop("SDFARM_BACKEND", None)
    run = [sys.executable, "-m", "sdfarm.cli.main", "devices", "--json"]
    done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "CPU" in [d["name"] for d in one_json(done.stdout)["devices"]]
    assert not (cache / "runtime").exists()  # nothing was built or downloaded
    assert list(carried.glob("shim-*"))  # only the shim, compiled next to the runtime
    env["SDFARM_BACKEND"] = "cuda"
    done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    assert "holds a cpu build, not cuda" in done.stdout + done.stderr


def test_make_test_model_writes_both_formats(tmp_path):
    done = sdfarm("make-test-model", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    dirs = [Path(d) for d in one_json(done.stdout)["models"]]
    assert sorted(p.name for p in dirs[0].iterdir()) == [
        "dit.safetensors",
        "llm.safetensors",
        "model.json",
        "taesd.safetensors",
    ]
    assert sorted(p.name for p in dirs[1].iterdir()) == [
        "dit.gguf",
        "llm.gguf",
        "model.json",
        "taesd.gguf",
    ]
