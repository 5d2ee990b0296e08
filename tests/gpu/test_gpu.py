"""On a GPU host: the engine and the farm on the real device. Skipped, with the reason, where
`sdfarm devices` lists no GPU (CPU-only CI); run on the lent H200 by `bash bench/gpu_run.sh
gputests`.

Every engine load happens in a child process (the CLI, or the farm's worker), as users and
the farm do: on the H200 host, numpy imported before a runtime load crashed it (docs/gpu.md),
and this process imports numpy-free code only. SDFARM_GPU_TEST_MODEL names a model folder to
use instead of the tiny model (written by a child process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sdfarm.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def devices() -> dict:
    done = cli("devices", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def gpu(devices: dict) -> dict:
    found = [d for d in devices["devices"] if d["type"] in ("gpu", "igpu")]
    if not found:
        names = ", ".join(d["name"] for d in devices["devices"])
        pytest.skip(f"no GPU: sdfarm devices lists only {names}")
    return found[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("SDFARM_GPU_TEST_MODEL")
    if given:
        return Path(given).resolve()
    done = cli("make-test-model", str(tmp_path_factory.mktemp("models")), "--json")
    assert done.returncode == 0, done.stderr
    return Path(json.loads(done.stdout)["models"][0])


def test_the_gpu_is_listed_with_its_figures_and_chosen(devices: dict, gpu: dict) -> None:
    assert 0 < gpu["free"] <= gpu["total"]
    assert devices["choice"]["auto"] == gpu["name"]
    assert devices["mem_available"] > 0


def test_a_generation_on_the_gpu_is_deterministic(gpu: dict, model: Path, tmp_path: Path) -> None:
    outs, docs = [], []
    for i, seed in enumerate(("42", "42", "43")):
        out = tmp_path / f"{i}.png"
        done = cli(
            "generate", "--in-process", "--model", str(model), "a red kite", "--seed", seed,
            "--width", "256", "--height", "256", "--steps", "1", "-o", str(out), "--json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        docs.append(json.loads(done.stdout))
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0] != outs[2]
    assert all(d["device"] == gpu["name"] for d in docs), docs[0]


def test_a_farm_job_runs_on_the_gpu_worker(gpu: dict, model: Path) -> None:
    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.farm import LocalFarm

    with LocalFarm([model.parent], announce=False) as local, Farm(local.url) as farm:
        r = farm.submit(model.name, "a red kite", seed=7, width=256, height=256, steps=1)
        result = r.result(timeout=600)
        assert result.metadata["device"] == gpu["name"]
        assert result.png.startswith(b"\x89PNG")
        hb = next(d for d in farm.status()["devices"] if d.get("device") == gpu["name"])
        assert hb["type"] == "gpu"
