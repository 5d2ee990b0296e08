"""A Wan 2.2 MoE pair (a high_noise_diffusion_model beside the diffusion_model) on the real
runtime, in-process, with the random-weight pair of the Wan test model: both experts load and
are counted in the estimate; the same inputs and seed give the same frames in another process;
moving the switch between the experts changes the frames; the high-noise parameters are
refused for a model without a high-noise expert, and a pair the runtime would abort on or
misuse is refused before any load, all before any native call."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.model import Model
from sdfarm.native.wantestmodel import HIGH_NOISE_FILE

from helpers.videomodels import digest, digest_in_child, fake_wan

pytestmark = pytest.mark.e2e

SMALL = {"width": 32, "height": 32, "frames": 1, "cfg_scale": 1.0, "seed": 7}
"""One frame of 32x32, the least the runtime makes (5 frames cost about 0.8 s more a video on
2 cores, and this file makes four): what it proves is about the two experts and the switch
between them, which run once a step whatever the frame count (a video's frames:
tests/e2e/test_video.py, and a pair's 5 frames on a farm: tests/e2e/test_video_farm.py)."""


@pytest.fixture(scope="module")
def pair(moe_model: Path) -> Iterator[Engine]:
    with Engine.load(moe_model, device="cpu", threads=2, log=LogConfig(level="info")) as e:
        yield e


@pytest.fixture(scope="module")
def switched(pair: Engine) -> Any:
    """Two steps: the first by the high-noise expert (the switch forced after one step)."""
    return pair.video(prompt="x", steps=1, high_noise_steps=1, **SMALL)


def test_both_experts_load_and_count_in_the_estimate(pair: Engine, wan_model: Path) -> None:
    files = pair.model.files
    assert set(files) == {"diffusion_model", "high_noise_diffusion_model", "vae"}
    single = Model.from_dir(wan_model)
    high = files["high_noise_diffusion_model"].size
    assert pair.model.total_bytes == single.total_bytes + high
    assert pair.facts.bytes == pair.model.total_bytes
    # the seed's rule on both DiTs: the high-noise one adds its file and a quarter
    assert pair.facts.resident() - single.total_bytes * 5 // 4 >= high * 5 // 4 - 2**20
    assert pair.model.component_bytes()["diffusion"] == files["diffusion_model"].size + high
    # the runtime loaded the second DiT in its high-noise role (its path scrubbed to the role)
    loaded = [r.message for r in pair.drain_load_records()]
    assert any(
        "loading high noise diffusion model from '<high_noise_diffusion_model file>'" in m
        for m in loaded
    ), loaded[:20]


def test_the_same_inputs_give_the_same_frames_in_another_process(
    pair: Engine, switched: Any, moe_model: Path
) -> None:
    meta = switched.metadata
    assert meta["video_model"] == "Wan2.1-T2V-1.3B" and meta["experts"] == 2
    assert meta["high_noise_steps"] == 1 and len(switched.frames) == 1
    assert digest_in_child(
        moe_model, {"prompt": "x", "steps": 1, "high_noise_steps": 1, **SMALL}
    ) == digest(switched.frames)


def test_moving_the_switch_changes_the_frames(pair: Engine, switched: Any) -> None:
    # the same two-step schedule, both steps by the low-noise expert
    low_only = pair.video(prompt="x", steps=2, high_noise_steps=0, **SMALL)
    assert digest(low_only.frames) != digest(switched.frames)
    # the switch from the boundary: 1.0 is above every sigma but the first, so the runtime
    # switches after one step, exactly as high_noise_steps=1 did
    boundary = pair.video(prompt="x", steps=2, moe_boundary=1.0, **SMALL)
    assert digest(boundary.frames) == digest(switched.frames)
    assert digest(boundary.frames) != digest(low_only.frames)
    assert pair.last_call["moe_boundary"] == 1.0 and pair.last_call["high_noise_steps"] == -1


def test_high_noise_parameters_need_a_high_noise_expert(wan_model: Path) -> None:
    with Engine.load(wan_model, device="cpu", threads=2) as single:
        calls = single.native_calls
        for change in (
            {"high_noise_steps": 1},
            {"moe_boundary": 0.9},
            {"high_noise_cfg_scale": 3.0},
            {"high_noise_sampler": "euler"},
        ):
            name = next(iter(change))
            with pytest.raises(InvalidParameterError, match="without a high-noise expert") as err:
                single.video(prompt="x", steps=1, **SMALL, **change)  # type: ignore[arg-type]
            assert err.value.parameter == name
        assert single.native_calls == calls and single.poisoned is None


def test_a_pair_the_runtime_would_abort_on_or_ignore_is_refused(
    tmp_path: Path, moe_model: Path, tiny_models: list[Path]
) -> None:
    def folder(name: str, files: dict[str, Path]) -> Path:
        out = tmp_path / name
        out.mkdir()
        roles = {}
        for role, src in files.items():
            (out / f"{role}{src.suffix}").symlink_to(src)
            roles[role] = f"{role}{src.suffix}"
        (out / "model.json").write_text(json.dumps({"files": roles}), encoding="utf-8")
        return out

    low = moe_model / "dit.gguf"
    vae = moe_model / "vae.safetensors"
    tiny = Model.from_dir(tiny_models[0]).files["diffusion_model"].path
    # a file that is no Wan DiT: the runtime would build a Wan runner of 0 layers and abort
    not_wan = folder("not-wan", {"diffusion_model": low, "high_noise_diffusion_model": tiny})
    with pytest.raises(ModelLoadError, match="not a Wan diffusion model"):
        Engine.load(not_wan, device="cpu")
    # a high-noise expert beside an image model: the runtime never reads it
    beside = folder("beside", {"diffusion_model": tiny, "high_noise_diffusion_model": low})
    with pytest.raises(ModelLoadError, match="beside a Wan diffusion_model"):
        Engine.load(beside, device="cpu")
    # an expert of a layer count the runtime aborts on (experts of two variants: unit tests)
    bad = fake_wan(tmp_path / "wan-31", 31) / "dit.gguf"
    aborts = folder("aborts", {"diffusion_model": low, "high_noise_diffusion_model": bad})
    with pytest.raises(ModelLoadError, match="31 layers"):
        Engine.load(aborts, device="cpu")
    # two DiTs and no manifest: the folder says which is which only through model.json
    guess = tmp_path / "guess"
    guess.mkdir()
    for src in (low, moe_model / HIGH_NOISE_FILE, vae):
        shutil.copy(src, guess / src.name) if src == vae else (guess / src.name).symlink_to(src)
    with pytest.raises(ModelLoadError, match="high_noise_diffusion_model in model.json"):
        Model.from_dir(guess)
