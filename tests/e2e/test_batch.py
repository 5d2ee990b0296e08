"""`sdfarm batch` on a real local farm with the tiny model: 50 prompts in, 50 PNGs out, a
re-run redoes nothing, a bad item fails alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdfarm.store import Store, keys

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "prompts.txt"
SMALL = ["--width", "64", "--height", "64", "--steps", "1", "--seed", "3"]


def one_json(out: str) -> dict:
    doc, end = json.JSONDecoder().raw_decode(out)
    assert out[end:].strip() == "", f"more than one document on stdout: {out[end:]!r}"
    return doc


@pytest.fixture(scope="module")
def farm(models_dir, tmp_path_factory):
    from sdfarm.localfarm.farm import LocalFarm

    with LocalFarm([models_dir], announce=False) as f:
        yield f


def batch(farm, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "batch", *args, "--redis", farm.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def job_count(farm) -> int:
    """Job records the farm's Redis holds."""
    store = Store.connect(farm.url)
    try:
        return sum(store.count_by_state().values())
    finally:
        store.close()


def test_fifty_prompts_then_a_rerun_that_redoes_nothing(farm, tmp_path):
    out = tmp_path / "out"
    first = batch(farm, str(PROMPTS), "--out", str(out), "--model", "tiny-q8_0", *SMALL, "--json")
    assert first.returncode == 0, first.stderr
    summary = one_json(first.stdout)
    assert (summary["done"], summary["skipped"], summary["failed"]) == (50, 0, 0), summary
    assert summary["submitted"] == 50 and summary["images_per_s"] > 0
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 50 and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    assert pngs[0].name == "00000-a-red-kite-over-a-windy-beach-at-sunset.png"
    sidecar = json.loads(pngs[0].with_suffix(".json").read_text())
    assert sidecar["prompt"] == "a red kite over a windy beach at sunset"
    assert sidecar["metadata"] and "records" in sidecar
    assert not list(out.glob(".*.tmp"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in pngs}

    jobs = job_count(farm)
    again = batch(farm, str(PROMPTS), "--out", str(out), "--model", "tiny-q8_0", *SMALL, "--json")
    assert again.returncode == 0, again.stderr
    summary = one_json(again.stdout)
    assert (summary["done"], summary["skipped"], summary["submitted"]) == (0, 50, 0)
    assert job_count(farm) == jobs  # no new job reached the farm
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")} == mtimes

    # An interrupted run (images missing) resumes with exactly what is missing.
    for p in pngs[10:13]:
        p.unlink()
    resumed = batch(farm, str(PROMPTS), "--out", str(out), "--model", "tiny-q8_0", *SMALL, "--json")
    summary = one_json(resumed.stdout)
    assert (summary["done"], summary["skipped"], summary["submitted"]) == (3, 47, 3)
    assert job_count(farm) == jobs + 3


def test_a_failed_item_does_not_stop_the_batch(farm, tmp_path):
    items = tmp_path / "items.jsonl"
    items.write_text(
        "\n".join(
            json.dumps(row)
            for row in (
                {"prompt": "good one", "name": "good-1"},
                {"prompt": "odd width", "name": "bad-width", "width": 65},
                {"prompt": "odd sampler", "name": "bad-sampler", "sampler": "nope"},
                {"prompt": "good two", "name": "good-2", "seed": 9},
            )
        )
        + "\n"
    )
    out = tmp_path / "out"
    done = batch(farm, str(items), "--out", str(out), "--model", "tiny-f16", *SMALL, "--json")
    assert done.returncode == 1
    summary = one_json(done.stdout)
    assert (summary["done"], summary["failed"]) == (2, 2), summary
    reasons = {f["name"]: f["error"] for f in summary["failures"]}
    assert "width" in reasons["bad-width"] and "sampler" in reasons["bad-sampler"]
    assert sorted(p.name for p in out.glob("*.png")) == ["good-1.png", "good-2.png"]
    assert json.loads((out / "good-2.json").read_text())["metadata"]["seed"] == 9


def test_csv_input_and_an_unknown_model_fail_per_item(farm, tmp_path):
    items = tmp_path / "p.csv"
    items.write_text("prompt,name,steps\na lake,lake,1\na hill,hill,\n")
    out = tmp_path / "out"
    done = batch(farm, str(items), "--out", str(out), "--model", "tiny-q8_0", *SMALL)
    assert done.returncode == 0, done.stderr
    assert "2 done, 0 skipped, 0 failed of 2" in done.stdout
    assert sorted(p.name for p in out.glob("*.png")) == ["hill.png", "lake.png"]

    missing = batch(farm, str(items), "--out", str(tmp_path / "o2"), "--model", "no-such-model",
                    *SMALL, "--json")  # fmt: skip
    assert missing.returncode == 1
    summary = one_json(missing.stdout)
    assert summary["failed"] == 2 and "no-such-model" in summary["failures"][0]["error"]


def test_bad_input_is_refused_before_any_job(farm, tmp_path):
    items = tmp_path / "p.jsonl"
    items.write_text('{"prompt": "a"}\n{broken\n')
    before = job_count(farm)
    done = batch(farm, str(items), "--out", str(tmp_path / "o"), "--model", "tiny-q8_0", "--json")
    assert done.returncode == 2
    assert "line 2" in one_json(done.stdout)["error"]["message"]
    assert job_count(farm) == before


def test_batch_starts_a_local_farm_when_none_runs(models_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SDFARM_REDIS_URL"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    items = tmp_path / "p.txt"
    items.write_text("one\ntwo\n")
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "batch", str(items), "--out",
         str(tmp_path / "o"), "--model", "tiny-q8_0", "--models", str(models_dir), *SMALL,
         "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert one_json(done.stdout)["done"] == 2
    assert "starting a local one" in done.stderr
    assert not (tmp_path / "sdfarm" / "local.json").exists()  # a private farm is not announced


def test_every_key_of_a_finished_batch_expires(farm, tmp_path):
    """A batch of 20 jobs leaves nothing in Redis for ever: every key that holds one of its
    job ids is one of that job's keys, and each has a TTL of at most a day."""
    items = tmp_path / "twenty.txt"
    items.write_text("".join(f"prompt number {i}\n" for i in range(20)))
    out = tmp_path / "out"
    done = batch(farm, str(items), "--out", str(out), "--model", "tiny-q8_0", *SMALL, "--json")
    assert done.returncode == 0, done.stderr
    assert one_json(done.stdout)["done"] == 20
    job_ids = {json.loads(p.read_text())["job"] for p in out.glob("*.json")}
    assert len(job_ids) == 20
    store = Store.connect(farm.url)
    try:
        for job_id in job_ids:
            found = {k.decode() for k in store.r.scan_iter(match=f"*{job_id}*", count=1000)}
            assert found <= set(keys.job_keys(job_id)), found
            assert {keys.job_key(job_id), keys.result_key(job_id), keys.done_key(job_id)} <= found
            ttls = store.ttls(job_id)
            assert set(ttls) == found
            assert all(0 < t <= keys.RESULT_TTL for t in ttls.values()), ttls
    finally:
        store.close()
