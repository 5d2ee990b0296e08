"""Video jobs on a real LocalFarm (one CPU worker, the random-weight Wan2.1 T2V test model beside
the tiny image models): the result is the frames as PNGs then the animated WebP, placed by the
video estimate; the same seed through the gateway gives the same frames; bad input (an image
model asked for video, a video model for an image) is refused at submit, and a job that
slips past the client is refused by the worker before any native
call, the worker going on; a Wan model the runtime would abort on is reported bad and never
loaded. `sdfarm video` reaches the same farm. A Wan 2.2 MoE pair's high-noise parameters
reach its engine through the client, the gateway and the CLI alike, and are refused by the
worker for a model without a pair."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from sdfarm.client.errors import JobFailed, UnknownModelError
from sdfarm.client.farm import Farm
from sdfarm.native import video_params
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.estimate import ModelFacts
from sdfarm.native.params import GenerationParams, detach_images, validate
from sdfarm.native.png import read_params
from sdfarm.store import JobSpec

from helpers.gateway import served_gateway
from helpers.videomodels import fake_wan

pytestmark = pytest.mark.e2e

WAN = "wan-t2v-test"
MOE = "wan-moe-test"
SMALL = {"width": 32, "height": 32, "frames": 5, "steps": 1, "cfg_scale": 1.0}


@pytest.fixture(scope="module")
def farm(
    models_dir: Path, wan_model: Path, moe_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from sdfarm.localfarm.farm import LocalFarm

    bad = tmp_path_factory.mktemp("badwan")
    fake_wan(bad / "wan-31", 31)
    farm = LocalFarm(
        [models_dir, wan_model.parent, bad],
        devices=["CPU"],
        threads=2,
        host="videohost",
        announce=False,
        worker_args=["--memory-limit", "6GiB"],
    )
    with farm:
        yield farm


@pytest.fixture
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="video-tests") as f:
        yield f


def png(color: tuple[int, int, int] = (10, 200, 30), size: tuple[int, int] = (32, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def test_a_video_job_returns_its_frames_and_webp(client: Farm, farm: Any, tmp_path: Path) -> None:
    job = client.video(WAN, "a cat", seed=5, fps=8, **SMALL)
    result = job.result(300)
    assert result.metadata["kind"] == "video" and len(result.frames) == 5
    for i, frame in enumerate(result.frames):
        assert Image.open(io.BytesIO(frame)).size == (32, 32)
        stored = read_params(frame)
        assert stored["frame"] == i and stored["frames"] == 5 and stored["seed"] == 5
    assert result.webp is not None
    webp = Image.open(io.BytesIO(result.webp))
    webp.load()
    assert webp.n_frames == 5 and webp.size == (32, 32) and webp.info["duration"] == 125  # 8 fps
    record = client.store.record(job.id)
    assert record["kind"] == "video" and record["model"] == WAN
    hb = next(iter(client._heartbeats(fresh=True).values()))
    facts = ModelFacts.from_json(hb["models"][WAN])
    assert int(record["estimate"]) == facts.video_estimate(32, 32, 5)  # placed as a video
    written = result.save_video(tmp_path / "v")
    assert [p.name for p in written][-2:] == ["frame-0004.png", "video.webp"]
    # the same seed through the gateway: the same frames
    with served_gateway(farm.url, ["tok"], 60) as base:
        auth = {"Authorization": "Bearer tok"}
        body = {"model": WAN, "prompt": "a cat", "seed": 5, "fps": 8, **SMALL}
        r = httpx.post(f"{base}/v1/videos", json=body, headers=auth, timeout=30)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        doc: dict[str, Any] = {}
        deadline = time.monotonic() + 300
        while doc.get("state") not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.5)
            doc = httpx.get(f"{base}/v1/jobs/{job_id}", headers=auth, timeout=30).json()
        assert doc["state"] == "done" and doc["kind"] == "video", doc
        assert doc["images"] == 5 and doc["video_url"] == f"/v1/jobs/{job_id}/video.webp"
        frames = [httpx.get(base + u, headers=auth, timeout=30).content for u in doc["image_urls"]]
        assert frames == result.frames
        got = httpx.get(base + doc["video_url"], headers=auth, timeout=30)
        assert got.headers["content-type"] == "image/webp" and got.content == result.webp
        r = httpx.post(f"{base}/v1/videos", json={**body, "frames": 6}, headers=auth, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "frames", r.text


def test_bad_input_is_refused_at_submit(client: Farm) -> None:
    for name, change in {
        "frames": {"frames": 4},
        "width": {"width": 40},
        "init_image": {"init_image": b"not an image"},
        "end_image": {"end_image": b"not an image"},
    }.items():
        with pytest.raises(InvalidParameterError) as err:
            client.video(WAN, "x", **{**SMALL, **change})
        assert err.value.parameter == name
    # an end image of another size than the frames: the runtime would stretch the last frame
    with pytest.raises(InvalidParameterError, match="is 48x32, the frames are 32x32") as err:
        client.video(MOE, "x", **SMALL, end_image=png(size=(48, 32)))
    assert err.value.parameter == "end_image"
    for name, change in {
        "high_noise_steps": {"high_noise_steps": -3},
        "moe_boundary": {"moe_boundary": 2.0},
    }.items():
        with pytest.raises(InvalidParameterError) as err:
            client.video(WAN, "x", **{**SMALL, **change})
        assert err.value.parameter == name
    with pytest.raises(InvalidParameterError):
        client.video(WAN, "x", **{**SMALL, "frames": 165})
    with pytest.raises(InvalidParameterError, match="not a video model") as err:
        client.video("tiny-f16", "x", **SMALL)
    assert err.value.parameter == "model"
    with pytest.raises(InvalidParameterError, match="is a video model") as err:
        client.submit(WAN, "x", width=64, height=64, steps=1)
    assert err.value.parameter == "model"
    with pytest.raises(UnknownModelError):  # the worker reports it bad, never loads it
        client.video("wan-31", "x", **SMALL)
    hb = next(iter(client._heartbeats(fresh=True).values()))
    assert "31 layers" in hb["bad_models"]["wan-31"]


def test_a_job_past_the_client_is_refused_by_the_worker_which_survives(client: Farm) -> None:
    good, _ = video_params.detach(video_params.validate(video_params.VideoParams("x", **SMALL)))
    with_init, inputs = video_params.detach(
        video_params.validate(video_params.VideoParams("x", **SMALL, init_image=png()))
    )
    with_end, end_inputs = video_params.detach(
        video_params.validate(video_params.VideoParams("x", **SMALL, end_image=png()))
    )
    # unvalidated, as a client that skipped the checks would send them
    wide_end, wide_inputs = video_params.detach(
        video_params.VideoParams("x", **SMALL, seed=1, end_image=png(size=(48, 32)))
    )
    bad_end, bad_inputs = video_params.detach(
        video_params.VideoParams("x", **SMALL, seed=1, end_image=b"not an image")
    )
    cases: list[tuple[str, dict[str, Any], dict[str, bytes], str]] = [
        (WAN, {**good, "frames": 4}, {}, "invalid frames"),
        (WAN, {**good, "frames": 165}, {}, "invalid frames"),
        (WAN, {**good, "width": 40}, {}, "invalid width"),
        (WAN, with_init, inputs, "invalid init_image: Wan2.1-T2V-1.3B takes no init_image"),
        (WAN, with_end, end_inputs, "invalid end_image: Wan2.1-T2V-1.3B takes no end_image"),
        (
            WAN,
            {**good, "high_noise_steps": 1},
            {},
            "invalid high_noise_steps: Wan2.1-T2V-1.3B without a high-noise expert",
        ),
        (MOE, wide_end, wide_inputs, "invalid end_image: is 48x32, the frames are 32x32"),
        (MOE, bad_end, bad_inputs, "invalid end_image"),
        ("tiny-f16", good, {}, "invalid model: 'tiny-f16' is not a video model"),
    ]
    for model, params, images, error in cases:
        spec = JobSpec(model=model, params=params, kind="video")
        with pytest.raises(JobFailed, match=error):
            client.submit_spec(spec, images).result(120)
    # an image job for the video model: refused before its engine loads
    image, _ = detach_images(validate(GenerationParams("x", width=64, height=64, steps=1)))
    with pytest.raises(JobFailed, match="is a video model"):
        client.submit_spec(JobSpec(model=WAN, params=image)).result(120)
    # the same worker goes on: an image job, then a video
    done = client.submit("tiny-f16", "a cat", width=64, height=64, steps=1, seed=1).result(120)
    assert Image.open(io.BytesIO(done.png)).size == (64, 64)
    assert len(client.video(WAN, "x", seed=2, **SMALL).result(300).frames) == 5


def test_the_cli_makes_a_video_on_the_farm(farm: Any, tmp_path: Path) -> None:
    out = tmp_path / "clip"
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "video", WAN, "a cat", "--frames", "5",
         "--width", "32", "--height", "32", "--steps", "1", "--seed", "9", "--cfg-scale", "1",
         "--redis", farm.url, "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["job"] and doc["kind"] == "video" and doc["frames"] == 5
    assert sorted(p.name for p in out.iterdir()) == [
        *(f"frame-{i:04d}.png" for i in range(5)),
        "video.webp",
    ]
    assert Image.open(out / "video.webp").n_frames == 5
    bad = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "video", WAN, "x", "--frames", "6",
         "--redis", farm.url, "--out", str(tmp_path / "no")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "frames" in bad.stderr and not (tmp_path / "no").exists()


def test_a_moe_pair_s_switch_reaches_its_engine_through_every_door(
    client: Farm, farm: Any, tmp_path: Path
) -> None:
    """One MoE video of 5 frames through the Python client; the gateway and the CLI each submit
    the same switch at 1 frame (the least the runtime makes: a MoE video costs both experts'
    passes whatever its frames) and are held to what they stored and what the worker ran: the
    spec each stores is the client's, frames apart, and the worker's frames say both experts ran
    with the switch asked. That the switch changes the frames, and that the same job gives the
    same frames in another process: tests/e2e/test_video_moe.py; that the gateway's frames are
    the client's for the same job: test_a_video_job_returns_its_frames_and_webp."""
    switch = {"prompt": "a cat", "seed": 4, **SMALL, "high_noise_steps": 1}
    job = client.video(MOE, **switch)
    result = job.result(300)
    assert result.metadata["experts"] == 2 and result.metadata["high_noise_steps"] == 1
    assert len(result.frames) == 5
    record = client.store.record(job.id)
    hb = next(iter(client._heartbeats(fresh=True).values()))
    facts = ModelFacts.from_json(hb["models"][MOE])
    single = ModelFacts.from_json(hb["models"][WAN]) if WAN in hb["models"] else None
    assert int(record["estimate"]) == facts.video_estimate(32, 32, 5)  # both experts counted
    if single is not None:
        assert facts.bytes > single.bytes + 700 * 2**20  # the high-noise DiT's 0.8 GB
    sent = json.loads(record["spec"])
    assert sent["params"]["high_noise_steps"] == 1
    one_frame = {**sent["params"], "frames": 1}

    def ran_the_switch(job_id: str, frame: bytes) -> None:
        """The door stored the client's switch (at 1 frame), and the worker ran it with both
        experts: its result's metadata and the frame's stored parameters are the engine's."""
        spec = json.loads(client.store.record(job_id)["spec"])
        assert (spec["model"], spec["kind"], spec["params"]) == (MOE, "video", one_frame)
        meta = client.job(job_id).result(30).metadata
        assert (meta["experts"], meta["high_noise_steps"], meta["frames"]) == (2, 1, 1), meta
        ran = read_params(frame)
        assert (ran["model"], ran["high_noise_steps"], ran["frames"]) == (MOE, 1, 1), ran
        assert Image.open(io.BytesIO(frame)).size == (32, 32)

    with served_gateway(farm.url, ["tok"], 60) as base:
        auth = {"Authorization": "Bearer tok"}
        body = {"model": MOE, **switch, "frames": 1}
        r = httpx.post(f"{base}/v1/videos", json=body, headers=auth, timeout=30)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        doc: dict[str, Any] = {}
        deadline = time.monotonic() + 300
        while doc.get("state") not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.5)
            doc = httpx.get(f"{base}/v1/jobs/{job_id}", headers=auth, timeout=30).json()
        assert doc["state"] == "done" and doc["params"] == one_frame, doc
        assert len(doc["image_urls"]) == 1
        ran_the_switch(
            job_id, httpx.get(base + doc["image_urls"][0], headers=auth, timeout=30).content
        )
        r = httpx.post(f"{base}/v1/videos", json={**body, "moe_boundary": 3}, headers=auth,
                       timeout=30)  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "moe_boundary", r.text
    out = tmp_path / "moe"
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "video", MOE, "a cat", "--frames", "1",
         "--width", "32", "--height", "32", "--steps", "1", "--seed", "4", "--cfg-scale", "1",
         "--high-noise-steps", "1", "--redis", farm.url, "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    cli = json.loads(done.stdout)
    assert (cli["experts"], cli["high_noise_steps"], cli["frames"]) == (2, 1, 1), cli
    assert sorted(p.name for p in out.iterdir()) == ["frame-0000.png", "video.webp"]
    ran_the_switch(cli["job"], (out / "frame-0000.png").read_bytes())
