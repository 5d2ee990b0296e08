"""Video through the remaining doors, on a real LocalFarm (one CPU worker, the random-weight
Wan2.1 T2V test model): an MP4 job's file decodes to the frames asked for and depends on the
seed; the gateway's `GET /v1/videos/{id}` hands out a URL fetched without the token, which a
tampered or expired signature does not open; a batch file's video lines render into the output
folder (the video file, its sidecar, its frames when asked), a re-run redoes nothing, and a bad
video line stops the batch before anything is queued, naming the line and the field."""

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

from sdfarm.client.farm import Farm
from sdfarm.gateway.auth import Gate
from sdfarm.native.videofile import mp4_available
from sdfarm.store import Store

from helpers.gateway import served_gateway
from helpers.videomodels import decode_mp4

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not mp4_available(), reason="the `video` extra (imageio-ffmpeg) is absent"),
]

WAN = "wan-t2v-test"
SMALL = {"width": 32, "height": 32, "frames": 5, "steps": 1, "cfg_scale": 1.0}
TOKEN = "video-doors-token"


@pytest.fixture(scope="module")
def farm(wan_model: Path) -> Iterator[Any]:
    from sdfarm.localfarm.farm import LocalFarm

    farm = LocalFarm(
        [wan_model.parent],
        devices=["CPU"],
        threads=2,
        host="videodoors",
        announce=False,
        worker_args=["--memory-limit", "6GiB"],
    )
    with farm:
        yield farm


@pytest.fixture
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="video-doors") as f:
        yield f


def mean_abs_diff(a: bytes, b: bytes) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_an_mp4_job_decodes_to_its_frames_and_depends_on_the_seed(client: Farm) -> None:
    hb = next(iter(client._heartbeats(fresh=True).values()))
    assert hb["video_formats"] == ["webp", "mp4"]  # what Farm.video checked mp4 against
    result = client.video(WAN, "a cat", seed=5, fps=8, format="mp4", **SMALL).result(300)
    assert result.video_format == "mp4" and result.webp is None and result.mp4 is not None
    meta, decoded = decode_mp4(result.mp4)
    assert meta["size"] == (32, 32) and meta["fps"] == 8.0 and len(decoded) == 5
    pngs = [Image.open(io.BytesIO(f)).convert("RGB").tobytes() for f in result.frames]
    assert len(pngs) == 5
    # the MP4 is these frames (H.264 is lossy: nearer to them than to another seed's)
    other = client.video(WAN, "a cat", seed=6, fps=8, format="mp4", **SMALL).result(300)
    assert other.mp4 is not None and other.mp4 != result.mp4
    _, decoded_other = decode_mp4(other.mp4)
    others = [Image.open(io.BytesIO(f)).convert("RGB").tobytes() for f in other.frames]
    for i in range(5):
        near = mean_abs_diff(pngs[i], decoded[i])
        assert near < mean_abs_diff(others[i], decoded[i]) / 2, i
        assert mean_abs_diff(others[i], decoded_other[i]) < mean_abs_diff(pngs[i], decoded_other[i])
    print("mean abs difference of the MP4's frames to the PNG frames:",
          [round(mean_abs_diff(p, d), 2) for p, d in zip(pngs, decoded, strict=True)])  # fmt: skip


def _wait_done(base: str, job_id: str, auth: dict[str, str]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    deadline = time.monotonic() + 300
    while doc.get("state") not in ("done", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        doc = httpx.get(f"{base}/v1/videos/{job_id}", headers=auth, timeout=30).json()
    return doc


def test_the_gateway_hands_out_a_signed_video_url_that_expires(farm: Any) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with served_gateway(farm.url, [TOKEN], 60) as base:
        body = {"model": WAN, "prompt": "a cat", "seed": 7, "format": "mp4", **SMALL}
        r = httpx.post(f"{base}/v1/videos", json=body, headers=auth, timeout=30)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert httpx.get(f"{base}/v1/videos/{job_id}", timeout=30).status_code == 401
        doc = _wait_done(base, job_id, auth)
        assert doc["state"] == "done" and doc["format"] == "mp4" and doc["frames"] == 5, doc
        assert doc["media_type"] == "video/mp4" and doc["expires_at"] > time.time() + 3000
        url = doc["url"]
        assert url.startswith(f"{base}/v1/jobs/{job_id}/video.mp4?exp=")
        got = httpx.get(url, timeout=30)  # no token: the signature opens it
        assert got.status_code == 200 and got.headers["content-type"] == "video/mp4"
        assert len(decode_mp4(got.content)[1]) == 5
        with_token = httpx.get(f"{base}/v1/jobs/{job_id}/video.mp4", headers=auth, timeout=30)
        assert with_token.content == got.content
        frame = httpx.get(doc["frame_urls"][4], timeout=30)  # the frames' URLs are signed too
        assert frame.status_code == 200 and frame.content.startswith(b"\x89PNG")

        sig = url.rsplit("sig=", 1)[1]
        tampered = url[: -len(sig)] + ("0" if sig[0] != "0" else "1") + sig[1:]
        assert httpx.get(tampered, timeout=30).status_code == 401
        later = url.replace(f"exp={doc['expires_at']}", f"exp={doc['expires_at'] + 86400}")
        assert httpx.get(later, timeout=30).status_code == 401
        other_format = url.replace("/video.mp4?", "/video.webp?")
        assert httpx.get(other_format, timeout=30).status_code == 401
        unsigned = url.split("?")[0]
        assert httpx.get(unsigned, timeout=30).status_code == 401
        # a URL this gateway signed two hours ago (a replica with the same tokens signs alike)
        old, _ = Gate([TOKEN], 60.0).video_url(job_id, "mp4", now=time.time() - 7200)
        expired = httpx.get(f"{base}/{old}", timeout=30)
        assert expired.status_code == 403, expired.text
        error = expired.json()["error"]
        assert error["code"] == "url_expired" and f"GET v1/videos/{job_id}" in error["message"]
        # the format the job did not make is not there, even with the token
        assert (
            httpx.get(f"{base}/v1/jobs/{job_id}/video.webp", headers=auth, timeout=30).status_code
            == 404
        )


def batch(farm: Any, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "batch", *args, "--redis", farm.url],
        capture_output=True,
        text=True,
        timeout=600,
    )


def job_count(farm: Any) -> int:
    store = Store.connect(farm.url)
    try:
        return sum(store.count_by_state().values())
    finally:
        store.close()


def test_video_lines_of_a_batch_file_render_and_resume(farm: Any, tmp_path: Path) -> None:
    lines = tmp_path / "clips.jsonl"
    rows = [
        {"prompt": "a cat", "kind": "video", "name": "cat", "seed": 1, **SMALL},
        {"prompt": "a dog", "kind": "video", "name": "dog", "seed": 2, "format": "mp4",
         "fps": 4, **SMALL},
    ]  # fmt: skip
    lines.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    args = [str(lines), "--out", str(out), "--model", WAN, "--save-frames", "--json"]
    first = batch(farm, *args)
    assert first.returncode == 0, first.stderr
    summary = json.loads(first.stdout)
    assert (summary["done"], summary["failed"]) == (2, 0), summary
    cat = Image.open(out / "cat.webp")
    assert cat.n_frames == 5 and cat.size == (32, 32)
    meta, decoded = decode_mp4((out / "dog.mp4").read_bytes())
    assert len(decoded) == 5 and meta["fps"] == 4.0
    for name in ("cat", "dog"):
        assert sorted(p.name for p in (out / name).iterdir()) == [
            f"frame-{i:04d}.png" for i in range(5)
        ]
        sidecar = json.loads((out / f"{name}.json").read_text())
        assert sidecar["metadata"]["kind"] == "video" and sidecar["metadata"]["frames"] == 5
    assert json.loads((out / "dog.json").read_text())["metadata"]["seed"] == 2

    jobs = job_count(farm)
    again = batch(farm, *args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["skipped"] == 2 and job_count(farm) == jobs

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "ok", "kind": "video", "name": "ok", **SMALL})
        + "\n"
        + json.dumps({"prompt": "x", "kind": "video", **{**SMALL, "frames": 6}})
        + "\n"
    )
    refused = batch(farm, str(bad), "--out", str(tmp_path / "bad-out"), "--model", WAN)
    assert refused.returncode == 2
    assert "line 2" in refused.stderr and "invalid frames: 6 is not 4k+1" in refused.stderr
    assert job_count(farm) == jobs and not (tmp_path / "bad-out" / "ok.webp").exists()


def test_sdfarm_video_writes_an_mp4_when_asked(farm: Any, tmp_path: Path) -> None:
    out = tmp_path / "clip"
    done = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "video", WAN, "a cat", "--frames", "5",
         "--width", "32", "--height", "32", "--steps", "1", "--seed", "9", "--cfg-scale", "1",
         "--format", "mp4", "--redis", farm.url, "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["format"] == "mp4" and doc["video"] == str(out / "video.mp4") == doc["mp4"]
    assert sorted(p.name for p in out.iterdir()) == [
        *(f"frame-{i:04d}.png" for i in range(5)),
        "video.mp4",
    ]
    assert len(decode_mp4((out / "video.mp4").read_bytes())[1]) == 5
    bad = subprocess.run(
        [sys.executable, "-m", "sdfarm.cli.main", "video", WAN, "x", "--frames", "5",
         "--format", "avi", "--redis", farm.url, "--out", str(tmp_path / "no")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "format" in bad.stderr and not (tmp_path / "no").exists()
