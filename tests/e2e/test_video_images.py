"""Video from input images on a real LocalFarm (one CPU worker, real redis-server, the real
runtime) with the Wan test model's image-to-video variant: a Wan2.1 I2V DiT at the 1.3B width
and its CLIP vision encoder (sdfarm.native.wantestmodel, `wan-i2v-test`). The runtime encodes
the init image through the encoder and pins the init and end images as the first and last
frames of its conditioning latent: the same images and seed give the same frames in another
process, another end image or another init image give other frames. Bad images (an end image
of another size, a corrupt one) and the same model without its encoder are refused before
any native call, and the worker goes on with its engine loaded."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sdfarm.client.errors import JobFailed, UnknownModelError
from sdfarm.client.farm import Farm
from sdfarm.native import video_params
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.estimate import CLIP_VISION_COMPUTE_BYTES, ModelFacts
from sdfarm.native.wantestmodel import I2V_DIT_FILE, I2V_NAME, VAE_FILE
from sdfarm.store import JobSpec

from helpers.videomodels import digest_in_child

pytestmark = pytest.mark.e2e

NO_ENCODER = "wan-i2v-no-encoder"
SMALL = {"width": 32, "height": 32, "frames": 5, "steps": 1, "cfg_scale": 1.0, "seed": 7}
RED, BLUE, GREEN, YELLOW = (220, 30, 30), (30, 30, 220), (30, 200, 30), (230, 220, 20)


def png(color: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> bytes:
    """A PNG of one color with a diagonal of another (so the image is not flat)."""
    img = Image.new("RGB", size, color)
    for i in range(min(size)):
        img.putpixel((i, i), (255 - color[0], 255 - color[1], 255 - color[2]))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def pixels(frames: list[bytes]) -> list[bytes]:
    return [Image.open(io.BytesIO(f)).convert("RGB").tobytes() for f in frames]


@pytest.fixture(scope="module")
def farm(i2v_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A farm with the I2V test model and the same DiT without its CLIP vision encoder."""
    from sdfarm.localfarm.farm import LocalFarm

    models = tmp_path_factory.mktemp("i2v-models")
    bare = models / NO_ENCODER  # its files linked: a folder of its own, no encoder
    bare.mkdir()
    for name in (I2V_DIT_FILE, VAE_FILE):
        (bare / name).symlink_to(i2v_model / name)
    manifest = {"files": {"diffusion_model": I2V_DIT_FILE, "vae": VAE_FILE}}
    (bare / "model.json").write_text(json.dumps(manifest), encoding="utf-8")
    farm = LocalFarm(
        [i2v_model.parent, models],
        devices=["CPU"],
        threads=2,
        host="i2vhost",
        announce=False,
        worker_args=["--memory-limit", "6GiB"],
    )
    with farm:
        yield farm


@pytest.fixture(scope="module")
def client(farm: Any) -> Iterator[Farm]:
    with Farm(farm.url, submitter="video-images") as f:
        yield f


@pytest.fixture(scope="module")
def first(client: Farm) -> tuple[str, Any]:
    """(job id, result) of the reference job: red first frame, blue last frame, seed 7."""
    job = client.video(I2V_NAME, "x", init_image=png(RED), end_image=png(BLUE), **SMALL)
    return job.id, job.result(600)


def test_the_same_images_and_seed_give_the_same_frames_in_another_process(
    client: Farm, first: tuple[str, Any], i2v_model: Path, tmp_path: Path
) -> None:
    job_id, result = first
    meta = result.metadata
    assert meta["video_model"] == "Wan2.1-I2V-1.3B" and len(result.frames) == 5
    assert meta["init_image"].startswith("sha256:") and meta["end_image"].startswith("sha256:")
    # placed with the CLIP vision term: the worker's facts say it has the encoder
    hb = next(iter(client._heartbeats(fresh=True).values()))
    facts = ModelFacts.from_json(hb["models"][I2V_NAME])
    assert facts.vision == CLIP_VISION_COMPUTE_BYTES
    assert int(client.store.record(job_id)["estimate"]) == facts.video_estimate(32, 32, 5, True)
    listed = {m["name"]: m for m in client.models()}
    assert listed[I2V_NAME]["clip_vision"] is True
    assert listed[I2V_NAME]["video"] == "Wan2.1-I2V-1.3B"
    # a fresh process (an engine of its own, not the worker's) makes the same frames
    init, end = tmp_path / "init.png", tmp_path / "end.png"
    init.write_bytes(png(RED))
    end.write_bytes(png(BLUE))
    mine = hashlib.sha256(b"".join(pixels(result.frames))).hexdigest()
    images = {"init_image": init, "end_image": end}
    assert digest_in_child(i2v_model, {"prompt": "x", **SMALL}, images) == mine


def test_bad_images_and_a_model_without_its_encoder_are_refused_before_any_native_call(
    client: Farm, first: tuple[str, Any]
) -> None:
    # at submit
    with pytest.raises(InvalidParameterError, match="is 48x32, the frames are 32x32") as err:
        client.video(I2V_NAME, "x", init_image=png(RED), end_image=png(BLUE, (48, 32)), **SMALL)
    assert err.value.parameter == "end_image"
    with pytest.raises(InvalidParameterError) as err:
        client.video(I2V_NAME, "x", end_image=b"\x89PNG\r\n\x1a\n not a png", **SMALL)
    assert err.value.parameter == "end_image"
    # the worker reports it bad (its DiT needs an encoder), never loads it; the client says why
    with pytest.raises(UnknownModelError, match="add a clip_vision file") as unknown:
        client.video(NO_ENCODER, "x", init_image=png(RED), end_image=png(BLUE), **SMALL)
    assert "Wan2.1-I2V-1.3B" in str(unknown.value)
    hb = next(iter(client._heartbeats(fresh=True).values()))
    assert "add a clip_vision file" in hb["bad_models"][NO_ENCODER]

    # past the client, unvalidated, as a client that skipped the checks would send them
    def spec(model: str, **images: bytes) -> tuple[JobSpec, dict[str, bytes]]:
        params, inputs = video_params.detach(video_params.VideoParams("x", **SMALL, **images))
        return JobSpec(model=model, params=params, kind="video"), inputs

    for (job, inputs), error in (
        (spec(I2V_NAME, end_image=png(BLUE, (48, 32))), "invalid end_image: is 48x32"),
        (spec(I2V_NAME, end_image=b"GIF89a broken"), "invalid end_image"),
        (spec(I2V_NAME, init_image=b"\xff\xd8\xff broken jpeg"), "invalid init_image"),
    ):
        with pytest.raises(JobFailed, match=error):
            client.submit_spec(job, inputs).result(120)
    # the worker went on, its engine still loaded (no crash, no reload)
    hb = next(iter(client._heartbeats(fresh=True).values()))
    assert [m["name"] for m in hb.get("loaded") or []] == [I2V_NAME]


def test_another_end_image_or_init_image_gives_other_frames(
    client: Farm, first: tuple[str, Any]
) -> None:
    reference = pixels(first[1].frames)
    other_end = client.video(I2V_NAME, "x", init_image=png(RED), end_image=png(GREEN), **SMALL)
    other_init = client.video(I2V_NAME, "x", init_image=png(YELLOW), end_image=png(BLUE), **SMALL)
    by_end, by_init = pixels(other_end.result(600).frames), pixels(other_init.result(600).frames)
    assert by_end != reference and by_init != reference and by_end != by_init
    # the end image is pinned as the last frame, the init image as the first
    assert by_end[-1] != reference[-1] and by_init[0] != reference[0]
