"""`sdfarm batch` on a real local farm with the tiny model: 50 prompts in, 50 PNGs out, a
re-run redoes nothing, a bad item fails alone; a farm at its queue limit is waited for, the
job options reach every job, bad flags and input are refused before any job, and an output
folder that refuses a write stops the batch cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


# -- reliability: a busy farm, refused flags and input, options, a full disk ----------------------

NO_FARM = "redis://127.0.0.1:1/0"  # nothing listens: a refusal must come before any farm


def refused(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "batch", *args, "--redis", NO_FARM],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_queue_limit_smaller_than_the_batch_still_renders_every_item(farm, tmp_path):
    """The farm refuses a submit past its queue limit (FarmBusyError): the batch waits and
    submits again, collecting its own results meanwhile; no item fails for it."""
    store = Store.connect(farm.url)
    config = store.queues()["config"]
    items = tmp_path / "twelve.txt"
    items.write_text("".join(f"a busy farm {i}\n" for i in range(12)))
    out = tmp_path / "out"
    try:
        # What clients read (submit.lua); the leader republishes only when it takes the lead.
        store.publish_config(queue_limit=1, backlog=int(config.get("backlog") or 2))
        done = batch(farm, str(items), "--out", str(out), "--model", "tiny-q8_0", *SMALL,
                     "--in-flight", "8", "--json")  # fmt: skip
        assert store.queues()["config"]["queue_limit"] in ("1", 1)  # still the limit we set
    finally:
        store.publish_config(
            queue_limit=int(config.get("queue_limit") or 10_000),
            backlog=int(config.get("backlog") or 2),
        )
        store.close()
    assert done.returncode == 0, done.stderr
    summary = one_json(done.stdout)
    assert (summary["done"], summary["failed"], summary["submitted"]) == (12, 0, 12), summary
    assert summary["busy_waits"] > 0, summary  # the limit was really met
    assert summary["stopped"] is None
    assert len(list(out.glob("*.png"))) == 12 and not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("value", ["0", "-2"])
def test_in_flight_below_one_is_refused_with_exit_2(tmp_path, value):
    items = tmp_path / "p.txt"
    items.write_text("one\n")
    args = [str(items), "--out", str(tmp_path / "o"), "--model", "tiny-q8_0"]
    done = refused(*args, "--in-flight", value)
    assert done.returncode == 2, done.stderr
    assert "--in-flight" in done.stderr and "at least 1" in done.stderr
    assert "Traceback" not in done.stderr
    as_json = refused(*args, "--in-flight", value, "--json")
    assert as_json.returncode == 2
    assert "--in-flight" in one_json(as_json.stdout)["error"]["message"]
    assert not (tmp_path / "o").exists()


def test_invalid_utf8_and_an_open_csv_quote_are_refused_with_exit_2(tmp_path):
    text = tmp_path / "p.txt"
    text.write_bytes(b"a kite\nlatin-1 caf\xe9\n")
    done = refused(str(text), "--out", str(tmp_path / "o"), "--model", "tiny-q8_0")
    assert done.returncode == 2, done.stderr
    assert "line 2: not valid UTF-8 (byte 0xe9 at byte offset 18" in done.stderr
    assert "Traceback" not in done.stderr
    as_json = refused(str(text), "--out", str(tmp_path / "o"), "--model", "tiny-q8_0", "--json")
    assert as_json.returncode == 2
    assert one_json(as_json.stdout)["error"]["type"] == "BatchInputError"

    csv_file = tmp_path / "p.csv"
    csv_file.write_text('prompt,seed\na kite,1\n"an owl,2\na fox,3\n')
    done = refused(str(csv_file), "--out", str(tmp_path / "o"), "--model", "tiny-q8_0")
    assert done.returncode == 2, done.stderr
    assert "line 3: a quoted field starts on this line and is not closed" in done.stderr
    assert not (tmp_path / "o").exists()


def test_every_job_option_given_reaches_the_jobs(farm, tmp_path):
    items = tmp_path / "p.txt"
    items.write_text("with options\n")
    out = tmp_path / "out"
    done = batch(farm, str(items), "--out", str(out), "--model", "tiny-q8_0", *SMALL, "--json",
                 "--priority", "4", "--submitter", "batch-ann", "--deadline-s", "120")  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = json.loads(next(out.glob("*.json")).read_text())["job"]
    store = Store.connect(farm.url)
    try:
        record = store.record(job_id)
    finally:
        store.close()
    assert (record["priority"], record["submitter"]) == ("4", "batch-ann")
    assert float(record["deadline"]) == 120.0
    # Without flags a batch queues at priority 9.
    plain = batch(farm, str(items), "--out", str(tmp_path / "o2"), "--model", "tiny-q8_0",
                  *SMALL, "--json")  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    job_id = json.loads(next((tmp_path / "o2").glob("*.json")).read_text())["job"]
    store = Store.connect(farm.url)
    try:
        assert store.record(job_id)["priority"] == "9"
    finally:
        store.close()


def test_an_output_folder_that_refuses_writes_stops_the_batch(farm, tmp_path):
    """A real write failure (a file size limit: EFBIG, as ENOSPC would be) stops the batch at
    once: a clear error naming the folder, exit 7, no `.tmp` file, the images already there
    kept, nothing left queued; with room again the same command finishes the batch."""
    import resource

    items = tmp_path / "p.txt"
    items.write_text("".join(f"a full disk {i}\n" for i in range(6)))
    out = tmp_path / "out"
    first = batch(farm, str(items), "--out", str(out), "--model", "tiny-q8_0", *SMALL, "--json")
    assert first.returncode == 0, first.stderr
    kept = {p.name: p.read_bytes() for p in sorted(out.glob("*.png"))[:2]}
    for p in sorted(out.glob("*"))[4:]:
        p.unlink()  # two items done, four to do

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # CPython ignores SIGXFSZ

    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "batch", str(items), "--out", str(out),
         "--model", "tiny-q8_0", *SMALL, "--json", "--redis", farm.url],
        capture_output=True, text=True, timeout=300, preexec_fn=small_files,
    )  # fmt: skip
    assert done.returncode == 7, (done.stdout, done.stderr)
    doc = one_json(done.stdout)
    message = doc["error"]["message"]
    assert doc["error"]["type"] == "BatchStopped"
    assert f"into {out}: File too large (EFBIG)" in message, message
    assert (doc["done"], doc["skipped"], doc["failed"]) == (0, 2, 0), doc
    assert doc["stopped"] and doc["remaining"] == 4
    assert "Traceback" not in done.stderr
    assert not list(out.glob(".*.tmp"))
    assert {p.name: p.read_bytes() for p in out.glob("*.png")} == kept
    store = Store.connect(farm.url)
    try:
        deadline = time.monotonic() + 30
        while set(store.count_by_state()) & {"queued", "placed", "running"}:
            assert time.monotonic() < deadline, store.count_by_state()
            time.sleep(0.2)
    finally:
        store.close()

    again = batch(farm, str(items), "--out", str(out), "--model", "tiny-q8_0", *SMALL, "--json")
    assert again.returncode == 0, again.stderr
    summary = one_json(again.stdout)
    assert (summary["done"], summary["skipped"]) == (4, 2), summary
    assert {p.name: p.read_bytes() for p in out.glob("*.png") if p.name in kept} == kept
