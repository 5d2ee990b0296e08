"""The Redis result store's caps against a real redis-server: a result past the per-result
cap, results together past the total cap, and the total following deletes and expiry; the
folder store's keys never leave its folder."""

from __future__ import annotations

import time

import pytest

from sdfarm.store import JobSpec, Store, keys
from sdfarm.store.results import RedisResults, ResultRefused, delete_job, where
from sdfarm.store.results_file import FileResults


@pytest.fixture
def store(redis_url: str):
    s = Store.connect(redis_url)
    yield s
    s.close()


def test_the_per_result_cap_refuses_before_anything_is_reserved(store: Store) -> None:
    results = RedisResults(store, max_bytes=10, total_max=1000)
    with pytest.raises(ResultRefused, match="result too large.*SDFARM_RESULT_MAX_BYTES"):
        results.put("a" * 32, [b"x" * 11])
    assert store.results_held() == 0


def test_the_total_cap_counts_every_result_until_it_is_deleted_or_expires(store: Store) -> None:
    results = RedisResults(store, max_bytes=100, total_max=100)
    first, second = "1" * 32, "2" * 32
    assert results.put(first, [b"x" * 30, b"y" * 30]) == ["png:0", "png:1"]
    assert store.results_held() == 60
    with pytest.raises(ResultRefused, match="Redis result store is full.*60 B"):
        results.put(second, [b"z" * 50])
    assert store.results_held() == 60
    assert results.put(first, [b"x" * 40]) == ["png:0"]  # a retry replaces its own reservation
    assert store.results_held() == 40
    results.delete(first, ["png:0"])  # given back (the job was not ours after all)
    assert store.results_held() == 0
    results.put(first, [b"x" * 60])
    # a result whose time is up is uncounted at the next reserve
    store.r.zadd(keys.RESULTS_EXPIRY_KEY, {first: 1})
    results.put(second, [b"z" * 50])
    assert store.results_held() == 50


def test_deleting_an_ended_job_gives_its_share_back_and_a_live_one_is_kept(store: Store) -> None:
    job_id, _, _ = store.submit(JobSpec(model="m", params={"prompt": "p"}), 100)
    assert job_id
    RedisResults(store, total_max=1000).put(job_id, [b"x" * 70])
    assert delete_job(store, job_id) == -1  # queued: live, nothing deleted
    assert store.record(job_id) and store.results_held() == 70
    assert store.cancel(job_id) == 1
    store.r.hset(keys.job_key(job_id), "results", where("redis", ["png:0"]))
    assert delete_job(store, job_id) == 1
    assert store.record(job_id) == {} and store.results_held() == 0
    assert not any(store.r.exists(k) for k in keys.job_keys(job_id))
    assert delete_job(store, job_id) == 0


def test_a_folder_store_reads_and_deletes_only_its_own_keys(tmp_path) -> None:
    results = FileResults(str(tmp_path / "shared"))
    results.check()
    job_id = "f" * 32
    keys_ = results.put(job_id, [b"one", b"two"])
    assert keys_ == [f"{job_id}/0.png", f"{job_id}/1.png"]
    assert results.get(job_id, keys_[1]) == b"two"
    (tmp_path / "secret.png").write_bytes(b"s")
    for bad in ("../secret.png", "/etc/passwd", f"{job_id}/../../secret.png"):
        with pytest.raises(ValueError, match="not an image key"):
            results.get(job_id, bad)
    results.delete(job_id, keys_)
    assert not (tmp_path / "shared" / job_id).exists()
    assert (tmp_path / "secret.png").exists()
    results.put(job_id, [b"old"])
    assert results.sweep(3600) == []  # young: kept
    assert results.sweep(0, now=9e9) == [job_id]


def _running_job(store: Store, device: str) -> tuple[str, str]:
    """A job placed on `device` and claimed, as the scheduler and a worker would: (id,
    dispatch)."""
    from sdfarm.store import transport
    from sdfarm.store.records import new_dispatch_id

    job_id, _, _ = store.submit(JobSpec(model="m", params={"prompt": "p"}), 100)
    assert job_id and store.take_lease("t", 60_000)
    dispatch = new_dispatch_id()
    held = (transport.queue_name("held/none"), "{}")
    assert store.place("t", job_id, 5, device, dispatch, 0, "test", (), held) == 1
    assert store.claim(job_id, dispatch, "inc", "w") is not None
    return job_id, dispatch


@pytest.mark.parametrize("kind", ["redis", "file"])
def test_a_late_run_of_a_job_never_touches_the_images_of_the_run_that_ended_it(
    store: Store, tmp_path, kind: str
) -> None:
    from PIL import Image

    from sdfarm.store.records import new_dispatch_id
    from sdfarm.store.results import located, read_pngs
    from sdfarm.worker.results import Finished, Uploader

    device = "late-host/CPU"
    results = RedisResults(store) if kind == "redis" else FileResults(str(tmp_path / "shared"))
    up = Uploader(store, device, results=results)
    job_id, dispatch = _running_job(store, device)
    red, blue = Image.new("RGB", (16, 16), (200, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 200))
    assert up.write(Finished(job_id, dispatch, "done", meta={"prompt": "p"}, images=[red]))
    record = store.record(job_id)
    pngs = read_pngs(record, store.ended(job_id).pngs, store)
    held = store.results_held()
    assert len(pngs) == 1 and (held > 0) == (kind == "redis")
    # the same job's earlier run, thought lost, ends late with its own image: not ours
    late = Finished(job_id, new_dispatch_id(), "done", meta={"prompt": "p"}, images=[blue])
    assert not up.write(late)
    assert read_pngs(store.record(job_id), store.ended(job_id).pngs, store) == pngs
    assert store.results_held() == held
    if kind == "file":
        _, keys_ = located(record, store)
        left = sorted(str(p.relative_to(tmp_path / "shared")) for p in
                      (tmp_path / "shared").rglob("*.png"))  # fmt: skip
        assert left == keys_  # the late run's image was deleted again, only it


def test_a_result_outlasting_a_redis_outage_is_kept_whole_and_written_after(
    redis_url: str,
) -> None:
    """Redis away for longer than the uploader's retry budget (a Sentinel failover took 30 s
    once in CI): the finished image is kept, not turned into a failure, and written as done
    once Redis takes writes again. Writes are held back with CLIENT PAUSE ... WRITE."""
    import redis
    from PIL import Image

    from sdfarm.store.results import read_pngs
    from sdfarm.worker.results import KEPT_WHOLE, Finished, Uploader

    store = Store.connect(redis_url, socket_timeout=0.3)
    device = "away-host/CPU"
    job_id, dispatch = _running_job(store, device)
    up = Uploader(store, device, retry_s=0.5)
    up.start()
    try:
        admin = redis.Redis.from_url(redis_url)
        admin.execute_command("CLIENT", "PAUSE", "2500", "WRITE")
        image = Image.new("RGB", (16, 16), (0, 120, 0))
        up.submit(Finished(job_id, dispatch, "done", meta={"prompt": "p"}, images=[image]))
        assert up.flush(10)
        assert up.unwritten[job_id][1] == "" and store.state(job_id) == "running"
        from sdfarm.worker.heartbeat import unwritten_of

        assert unwritten_of(up) == {job_id: KEPT_WHOLE}
        deadline = time.monotonic() + 20
        while store.state(job_id) == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.state(job_id) == "done" and job_id not in up.unwritten
        record = store.record(job_id)
        assert len(read_pngs(record, store.ended(job_id).pngs, store)) == 1
    finally:
        up.stop()
