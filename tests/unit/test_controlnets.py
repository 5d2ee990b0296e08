"""Pure logic of ControlNets and embeddings: the header checks, name resolution inside the
folders, engine keys, the job schema's rules and the scheduler's facts of an engine key."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file

from sdfarm.native import enginekey
from sdfarm.native.catalog import Catalog
from sdfarm.native.controlnets import (
    CONTROL_HEADS,
    ControlNetCatalog,
    controlnet_dirs,
    resident_bytes,
    unet_refusal,
)
from sdfarm.native.embeddings import TABLE_BYTES, EmbeddingCatalog, embedding_dirs
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.headers import FileHeader, TensorInfo, validate_header
from sdfarm.native.params import GenerationParams, validate
from sdfarm.scheduler.registry import Snapshot, model_facts


def controlnet_file(path: Path, width: int = 768, marks: bool = True) -> Path:
    t = {
        "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": np.zeros((320, width), "f2"),
        "input_blocks.1.0.in_layers.2.weight": np.zeros((320, 320, 3, 3), "f2"),
    }
    if marks:
        for name in ("input_hint_block.0", "zero_convs.0.0", "middle_block_out.0"):
            t[f"{name}.weight"] = np.zeros((16, 3, 3, 3), "f2")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path))
    return path


def embedding_file(path: Path, shape=(4, 768), dtype="f4") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"emb_params": np.zeros(shape, dtype)}, str(path))
    return path


def test_a_controlnet_is_checked_by_its_tensor_names_and_width(tmp_path: Path) -> None:
    root = tmp_path / "models"
    controlnet_file(root / "controlnets" / "canny.safetensors")
    controlnet_file(root / "controlnets" / "xl.safetensors", width=2048)
    controlnet_file(root / "controlnets" / "odd.safetensors", width=640)
    controlnet_file(root / "controlnets" / "lora.safetensors", marks=False)
    cat = ControlNetCatalog(controlnet_dirs([root]))
    canny = cat.load("canny")
    assert canny.context_dim == 768 and cat.load("xl").context_dim == 2048
    # as the runtime holds it: convolutions f16, the rest f32 (whatever the file has)
    header = validate_header(canny.path)
    assert (
        canny.resident_bytes
        == resident_bytes(header)
        == 320 * 768 * 4 + (320 * 320 * 9 + 3 * 16 * 27) * 2
    )
    with pytest.raises(ModelLoadError, match="cross-attention width is \\[640\\]"):
        cat.load("odd")
    with pytest.raises(ModelLoadError, match="not a ControlNet's"):
        cat.load("lora")
    assert sorted(cat.all()) == ["canny", "xl"]  # what a heartbeat lists


def test_only_a_full_sd_unet_takes_a_controlnet() -> None:
    def header(*names: str) -> FileHeader:
        tensors = {n: TensorInfo("F16", (4, 4), 32) for n in names}
        return FileHeader("gguf", tensors, 0, 0, 0)

    full = header("model.diffusion_model.input_blocks.1.0.in_layers.0.weight",
                  "model.diffusion_model.middle_block.1.norm.weight")  # fmt: skip
    tiny = header("model.diffusion_model.input_blocks.1.0.in_layers.0.weight",
                  "model.diffusion_model.output_blocks.0.0.in_layers.0.weight")  # fmt: skip
    assert unet_refusal(full, "sd1") is None and unet_refusal(full, "sdxl") is None
    assert "would abort" in (unet_refusal(tiny, "sd1") or "")
    assert "flux" in (unet_refusal(full, "flux") or "")


def test_names_resolve_only_inside_the_folders(tmp_path: Path) -> None:
    root = tmp_path / "models"
    controlnet_file(root / "controlnets" / "canny.safetensors")
    outside = controlnet_file(tmp_path / "elsewhere" / "secret.safetensors")
    (root / "controlnets" / "link.safetensors").symlink_to(outside)
    cat = ControlNetCatalog(controlnet_dirs([root]))
    for bad in ("../elsewhere/secret", "/etc/passwd", "canny/../canny", "", ".hidden"):
        with pytest.raises(ModelLoadError, match="invalid ControlNet name"):
            cat.path(bad)
    with pytest.raises(ModelLoadError, match="unknown ControlNet 'link'"):
        cat.path("link")  # a symlink out of the folder is not in it
    with pytest.raises(ModelLoadError, match="unknown ControlNet 'nope'; ControlNets: canny"):
        cat.path("nope")
    extra = tmp_path / "more"
    controlnet_file(extra / "depth.gguf.safetensors")  # stem "depth.gguf"
    assert "depth.gguf" in ControlNetCatalog(controlnet_dirs([root], [str(extra)])).names()
    # the asset folders are not models
    (root / "embeddings").mkdir()
    assert Catalog([root]).names() == []


def test_an_embedding_must_be_f32_of_a_clip_width(tmp_path: Path) -> None:
    d = tmp_path / "models" / "embeddings"
    embedding_file(d / "good.safetensors")
    embedding_file(d / "half.safetensors", dtype="f2")
    embedding_file(d / "wide.safetensors", shape=(4, 640))
    embedding_file(d / "long.safetensors", shape=(80, 768))
    cat = EmbeddingCatalog(embedding_dirs([tmp_path / "models"]))
    good = cat.load("good")
    assert (good.vectors, good.width) == (4, 768)
    with pytest.raises(ModelLoadError, match="in F16; the runtime copies"):
        cat.load("half")
    with pytest.raises(ModelLoadError, match="shape \\[4, 640\\]"):
        cat.load("wide")
    with pytest.raises(ModelLoadError, match="80 vectors"):
        cat.load("long")
    assert list(cat.sizes()) == ["good"]


def test_engine_keys_round_trip_and_name_their_parts() -> None:
    params = {"control_net": "canny", "embeddings": "b,a"}
    key = enginekey.key_of("sd15", params)
    assert str(key) == "sd15+control:canny+embeddings:a,b"
    assert enginekey.parse(str(key)) == enginekey.EngineKey("sd15", "canny", ("a", "b"))
    assert enginekey.engine_key("sd15", {}) == "sd15" and enginekey.parse("sd15").plain
    assert enginekey.engine_key("sd15", {"embeddings": "e"}) == "sd15+embeddings:e"
    for bad in ("sd15+control:", "sd15+embeddings:", "../x+control:c", "upscaler:x+control:c"):
        assert enginekey.parse(bad) is None, bad
    enginekey.check_key("sd15+control:canny+embeddings:a,b", "sd15", params)
    with pytest.raises(InvalidParameterError, match="is not"):
        enginekey.check_key("sd15", "sd15", params)
    parts = enginekey.parse("sd15+control:canny+embeddings:a")
    assert enginekey.extra_bytes(parts, {"canny": 100}, {"a": 7}) == 107 + TABLE_BYTES
    assert enginekey.extra_bytes(parts, {}, {"a": 7}) is None


def test_the_schema_pairs_a_control_image_with_its_controlnet() -> None:
    small = {"prompt": "x", "width": 64, "height": 64}
    png = b"\x89PNG"  # checked only when the pairing passes
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(**small, control_net="canny"))
    assert err.value.parameter == "control_net" and "needs a control_image" in str(err.value)
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(**small, control_net="a/b", control_image=png))
    assert err.value.parameter in ("control_net", "control_image")
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(**small, control_strength=2.5))
    assert err.value.parameter == "control_strength"
    real = io.BytesIO()
    Image.new("RGB", (64, 64)).save(real, "PNG")
    with pytest.raises(InvalidParameterError) as err:  # the runtime's hires pass would abort
        validate(GenerationParams(**small, control_net="c", control_image=real.getvalue(),
                                  hires_scale=2))  # fmt: skip
    assert err.value.parameter == "hires_scale" and "aborts" in str(err.value)
    assert validate(GenerationParams(**small, embeddings=" b , a ")).embeddings == "a,b"
    assert validate(GenerationParams(**small, embeddings=["a"])).embeddings == "a"
    for bad in ("a,A", "a,../b", ",".join("abcdefghi")):
        with pytest.raises(InvalidParameterError) as err:
            validate(GenerationParams(**small, embeddings=bad))
        assert err.value.parameter == "embeddings"


def test_the_scheduler_adds_a_keys_controlnet_and_embeddings_to_its_model() -> None:
    model = {"bytes": 1000, "native_size": [512, 512], "decode_per_pixel": 0}
    hbs = {
        "a": {"models": {"sd15": model}, "controlnets": {"canny": 500}, "embeddings": {"e": 7}},
        "b": {"models": {"sd15": model}, "controlnets": {"canny": 600}},
    }
    key = "sd15+control:canny+embeddings:e"
    facts = model_facts(hbs, key)
    assert facts is not None and facts.bytes == 1000 + 600 + 7 + TABLE_BYTES  # largest copy
    assert facts.control_heads == CONTROL_HEADS  # its attention counted (no flash attention)
    tokens = (512 // 8) ** 2
    plain = model_facts(hbs, "sd15+embeddings:e")
    assert plain is not None and plain.control_heads == 0
    assert facts.estimate(512, 512) - plain.estimate(512, 512) == (
        600 + 600 // 4 + CONTROL_HEADS * tokens * tokens * 4
    )
    assert facts.control_working(1024, 1024) == 16 * facts.control_working(512, 512)
    assert Snapshot(heartbeats=hbs).model_facts(key) == facts
    assert model_facts(hbs, "sd15+control:depth") is None  # no worker has it
    assert model_facts(hbs, "sd14+control:canny") is None
    assert "unknown ControlNet 'depth'" in enginekey.unknown_error(
        "sd15+control:depth", hbs, ["sd15"]
    )
    assert "unknown embedding 'f'" in enginekey.unknown_error("sd15+embeddings:f", hbs, ["sd15"])


def test_placement_goes_where_the_engine_key_is_loaded_not_the_plain_model() -> None:
    from sdfarm.scheduler.placement import DeviceState, GiB, JobRequest, LoadedModel, Placed, place

    key = "sd15+control:canny"

    def dev(name: str, loaded: str) -> DeviceState:
        held = (LoadedModel(loaded, 4 * GiB, busy=False, pinned=False, idle_since=0.0),)
        return DeviceState(host="h", device=name, type="gpu", compute_figure=12 * GiB,
                           slow_figure=28 * GiB, capacity=16 * GiB, loaded=held, queued=0,
                           backlog_limit=2, alive=True, accepting=True)  # fmt: skip

    devices = [dev("gpu0", "sd15"), dev("gpu1", key)]
    for order in (devices, devices[::-1]):
        got = place(JobRequest(model=key, estimate=5 * GiB), order, 10_000.0)
        assert got == Placed("h/gpu1", "loaded")
        plain = place(JobRequest(model="sd15", estimate=4 * GiB), order, 10_000.0)
        assert plain == Placed("h/gpu0", "loaded")
