"""The clip_vision role (a CLIP vision encoder beside a Wan2.1 image-to-video DiT) as pure
logic: its file is told from its tensor names in either naming, a model folder finds it with
or without a manifest, a Wan2.1 I2V DiT without one and a clip_vision file beside any other
model are refused before the runtime sees them, a 30-layer first-last-frame DiT (which the
runtime aborts on) is refused from its header, which images a Wan2.1 I2V model takes, and
the estimate's CLIP vision term (in the facts, the heartbeat and the video estimate)."""

from __future__ import annotations

import json
from dataclasses import replace
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdfarm.native.devices import Device
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.estimate import CLIP_VISION_COMPUTE_BYTES, ModelFacts, model_facts
from sdfarm.native.headers import FileHeader, TensorInfo
from sdfarm.native.model import Model
from sdfarm.native.roles import ROLE_COMPONENTS, detect_role, detect_role_with_evidence
from sdfarm.native.video import check_header, describe, video_model
from sdfarm.native.video_params import VideoParams, validate
from sdfarm.native.wantestmodel import FLF_TOKENS, I2V_1_3B, dit_specs, vision_specs


def header(names: dict[str, tuple[int, ...]], prefix: str = "") -> FileHeader:
    tensors = {prefix + n: TensorInfo("F16", s, 2 * int(np.prod(s))) for n, s in names.items()}
    return FileHeader("gguf", tensors, 0, 0, 0)


def vision() -> dict[str, tuple[int, ...]]:
    return {n: shape for n, (shape, _kind) in vision_specs().items()}


def i2v_dit(layers: int = 30, **extra: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    specs = {n: shape for n, (shape, _kind) in dit_specs(layers, arch=I2V_1_3B).items()}
    return {**specs, **extra}


def png(size: tuple[int, int] = (64, 64)) -> bytes:
    buf = BytesIO()
    Image.new("RGB", size, (5, 6, 7)).save(buf, "PNG")
    return buf.getvalue()


def params(**kw: object) -> VideoParams:
    return validate(VideoParams(**{"prompt": "x", "width": 64, "height": 64, **kw}))  # type: ignore[arg-type]


def test_a_clip_vision_file_is_told_from_its_tensor_names() -> None:
    role, evidence = detect_role_with_evidence(header(vision()))
    assert role == "clip_vision" and "vision_model.encoder.layers.*" in evidence
    # with the runtime's prefix, and in OpenCLIP's naming
    assert detect_role(header(vision(), "cond_stage_model.transformer.")) == "clip_vision"
    openclip = {
        "visual.conv1.weight": (1280, 3, 14, 14),
        "visual.transformer.resblocks.0.attn.in_proj_weight": (3840, 1280),
        "visual.ln_post.weight": (1280,),
    }
    assert detect_role(header(openclip)) == "clip_vision"
    # its patch embedding and layers.N would have looked like a DiT's without the vision check
    assert detect_role(header(i2v_dit())) == "diffusion_model"
    # a whole CLIP (text and vision towers) is a text encoder to the runtime, not this role
    both = {**vision(), "text_model.encoder.layers.0.mlp.fc1.weight": (3072, 768)}
    assert detect_role(header(both)) != "clip_vision"
    # it runs on the diffusion model's backend: the fit plan keeps it with the DiT
    assert ROLE_COMPONENTS["clip_vision"] == "diffusion"


def _write(path: Path, names: dict[str, tuple[int, ...]]) -> None:
    """A GGUF file of `names`, one float each: the checks read names only."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="sdfarm-fake")
    for name in names:
        writer.add_tensor(name, np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_model_folder_finds_its_clip_vision_and_needs_one_for_a_wan21_i2v_dit(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "i2v"
    folder.mkdir()
    _write(folder / "dit.gguf", i2v_dit())
    _write(folder / "encoder.gguf", vision())
    found = Model.from_dir(folder)  # no manifest: roles from the names
    assert set(found.files) == {"diffusion_model", "clip_vision"}
    assert found.ctx_paths()["clip_vision_path"] == str(folder / "encoder.gguf")
    vm = video_model(found)
    assert vm is not None and vm.desc == "Wan2.1-I2V-1.3B" and vm.clip_vision
    # named in the manifest (any file name)
    (folder / "model.json").write_text(
        json.dumps({"files": {"diffusion_model": "dit.gguf", "clip_vision": "encoder.gguf"}})
    )
    assert Model.from_dir(folder).files["clip_vision"].path.name == "encoder.gguf"
    # without it the runtime fails the load on hundreds of missing tensors: refused first
    (folder / "model.json").write_text(json.dumps({"files": {"diffusion_model": "dit.gguf"}}))
    with pytest.raises(ModelLoadError, match="add a clip_vision file") as err:
        Model.from_dir(folder)
    assert err.value.role == "clip_vision" and "Wan2.1-I2V-1.3B" in str(err.value)
    # a DiT file given as the encoder: its names say it is not one
    (folder / "model.json").write_text(
        json.dumps({"files": {"diffusion_model": "dit.gguf", "clip_vision": "dit.gguf"}})
    )
    with pytest.raises(ModelLoadError, match="looks like a diffusion_model file"):
        Model.from_dir(folder)


def test_a_clip_vision_file_beside_a_model_that_never_reads_it_is_refused(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "t2v"
    folder.mkdir()
    _write(folder / "dit.gguf", {n: s for n, (s, _k) in dit_specs().items()})
    _write(folder / "encoder.gguf", vision())
    with pytest.raises(ModelLoadError, match="only for a Wan2.1 I2V / FLF2V") as err:
        Model.from_dir(folder)
    assert "Wan2.1-T2V-1.3B" in str(err.value) and "encoder.gguf" in str(err.value)


def test_a_first_last_frame_dit_of_30_layers_is_refused_from_its_header() -> None:
    flf = {"img_emb.emb_pos": (1, FLF_TOKENS, 1280)}
    with pytest.raises(ModelLoadError, match="ends the process") as err:
        check_header(header(i2v_dit(**flf)), "diffusion_model file f.gguf")
    assert "emb_pos" in str(err.value) and "f.gguf" in str(err.value)
    check_header(header(i2v_dit()), "x")  # I2V without emb_pos: the runtime runs it
    check_header(header(i2v_dit(40, **flf)), "x")  # Wan2.1-FLF2V-14B
    found = describe(header(i2v_dit(40, **flf)), True)
    assert found is not None and found.desc == "Wan2.1-FLF2V-14B" and found.first_last


def test_a_wan21_i2v_model_takes_both_images_only_with_its_clip_vision() -> None:
    for layers in (30, 40):
        vm = describe(header(i2v_dit(layers)), True)
        assert vm is not None and vm.needs_clip_vision and vm.init_image and vm.end_image
        both = params(init_image=png(), end_image=png())
        for name in ("init_image", "end_image"):
            with pytest.raises(InvalidParameterError, match="add a clip_vision file") as err:
                vm.refuse_images(params(**{name: png()}))
            assert err.value.parameter == name and "CLIP vision encoder" in str(err.value)
        held = replace(vm, clip_vision=True)
        held.check(both)
        held.check(params(init_image=png()))
        held.check(params())  # text-to-video with it: nothing to refuse
    # validated like every video image: the end image is the frame size
    with pytest.raises(InvalidParameterError, match="is 64x48") as bad:
        params(init_image=png(), end_image=png((64, 48)))
    assert bad.value.parameter == "end_image"


def test_the_estimate_counts_the_clip_vision_term_for_an_input_image() -> None:
    base = ModelFacts(2 << 30, (64, 64), video="Wan2.1-I2V-1.3B")
    held = replace(base, vision=CLIP_VISION_COMPUTE_BYTES)
    assert held.resident() == base.resident()  # its weights are in `bytes` already
    assert held.video_estimate(64, 64, 5, encodes=False) == base.video_estimate(64, 64, 5)
    assert (
        held.video_estimate(64, 64, 5, encodes=True)
        == base.video_estimate(64, 64, 5, encodes=True) + CLIP_VISION_COMPUTE_BYTES
    )
    # it travels in the heartbeat and the cautious merge keeps it
    doc = held.as_json()
    assert doc["vision"] == CLIP_VISION_COMPUTE_BYTES and "vision" not in base.as_json()
    assert ModelFacts.from_json(doc) == held
    assert ModelFacts.cautious([base, held]).vision == CLIP_VISION_COMPUTE_BYTES


def test_model_facts_give_the_term_to_a_model_with_a_clip_vision_file(tmp_path: Path) -> None:
    folder = tmp_path / "i2v"
    folder.mkdir()
    _write(folder / "dit.gguf", i2v_dit())
    _write(folder / "encoder.gguf", vision())
    model = Model.from_dir(folder)
    cpu = Device(index=0, name="CPU", description="cpu", type="cpu", free=1 << 34, total=1 << 34)
    facts = model_facts(model, cpu)
    assert facts.vision == CLIP_VISION_COMPUTE_BYTES and facts.video == "Wan2.1-I2V-1.3B"
    assert facts.bytes == model.total_bytes  # the encoder's file counts with the others
    assert model.component_bytes()["diffusion"] == model.total_bytes


def test_sdfarm_models_shows_a_video_model_s_variant_and_its_encoder() -> None:
    from sdfarm.cli.jobs import _model_line

    assert _model_line({"name": "tiny"}) == "tiny"
    assert _model_line({"name": "w", "video": "Wan2.1-T2V-1.3B"}) == "w (video: Wan2.1-T2V-1.3B)"
    held = {"name": "i", "video": "Wan2.1-I2V-1.3B", "clip_vision": True}
    assert _model_line(held) == "i (video: Wan2.1-I2V-1.3B, CLIP vision encoder)"
