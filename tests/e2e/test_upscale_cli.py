"""`sdfarm upscale` as a user runs it: a separate process, the image in, the upscaled PNG out,
one JSON document on stdout, a clear error and exit code for bad input; in-process and on a
farm (the farm's own test module drives a LocalFarm: tests/e2e/test_upscale_farm.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdfarm.cli.main import EXIT_INVALID

pytestmark = pytest.mark.e2e


def sdfarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def one_json(out: str) -> dict:
    doc, end = json.JSONDecoder().raw_decode(out)
    assert out[end:].strip() == ""
    return doc


def write_png(path: Path, w: int, h: int, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path, "PNG")
    return path


def test_upscale_in_process(models_dir: Path, tmp_path: Path) -> None:
    image = write_png(tmp_path / "in.png", 20, 12)
    out = tmp_path / "out.png"
    done = sdfarm(
        "upscale", str(image), "--upscaler", "tiny-esrgan-x4", "--models", str(models_dir),
        "--in-process", "--tile-size", "0", "-o", str(out), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = one_json(done.stdout)
    assert doc["output"] == str(out) and doc["factor"] == 4 and doc["output_size"] == [80, 48]
    assert Image.open(io.BytesIO(out.read_bytes())).size == (80, 48)
    assert str(models_dir) not in done.stdout + done.stderr  # paths stay out of the logs


def test_bad_input_gets_a_clear_error_and_exit_code(models_dir: Path, tmp_path: Path) -> None:
    image = write_png(tmp_path / "in.png", 16, 16)
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    cases = {
        "factor": [str(image), "--upscaler", "tiny-esrgan-x2", "--factor", "4"],
        "tile_size": [str(image), "--upscaler", "tiny-esrgan-x2", "--tile-size", "7"],
        "image": [str(tmp_path / "bad.png"), "--upscaler", "tiny-esrgan-x2"],
    }
    for name, args in cases.items():
        done = sdfarm("upscale", *args, "--models", str(models_dir), "--in-process", "--json",
                      "-o", str(tmp_path / "x.png"))  # fmt: skip
        assert done.returncode == EXIT_INVALID, (name, done.stdout, done.stderr)
        doc = one_json(done.stdout)
        assert f"invalid {name}" in doc["error"]["message"], doc
    done = sdfarm("upscale", str(image), "--upscaler", "nope", "--models", str(models_dir),
                  "--in-process", "-o", str(tmp_path / "x.png"))  # fmt: skip
    assert done.returncode != 0 and "unknown upscaler 'nope'" in done.stderr
    assert not (tmp_path / "x.png").exists()
