"""bench/fullsize_model.py: the SD-Turbo layout (names, shapes, parameter totals, file size)
checked on the tensor list, and the streaming writer on small tensor sets (never 2.6 GB)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from sdfarm.native.headers import FileHeader, TensorInfo, read_header
from sdfarm.native.model import Model
from sdfarm.native.roles import detect_role, guess_architecture

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "fullsize_model.py"
# The file measured in ../shared/facts/runtime.md ("A full-size model on the CPU").
REFERENCE_SIZE = 2_607_360_016


def _load_script():
    spec = importlib.util.spec_from_file_location("fullsize_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


fm = _load_script()
TENSORS = fm.tensor_list("sd-turbo")
SHAPES = dict(TENSORS)


def test_script_is_standalone() -> None:
    imports = {
        line.split()[1].split(".")[0]
        for line in SCRIPT.read_text().splitlines()
        if line.startswith(("import ", "from "))
    }
    stdlib = set(sys.stdlib_module_names)
    assert {m for m in imports if m not in stdlib} == {"numpy"}


def test_tensor_count_and_unique_names() -> None:
    # 686 UNet + 293 text (incl. text_projection) + 248 VAE tensors sd.cpp loads, + logit_scale.
    assert len(TENSORS) == 1228
    assert len(SHAPES) == len(TENSORS)
    counts = {
        comp: sum(1 for n in SHAPES if n.startswith(prefix)) for comp, prefix in fm.COMPONENTS
    }
    assert counts == {"unet": 686, "text": 294, "vae": 248}


def test_param_totals_per_component() -> None:
    counts = fm.param_counts(TENSORS)
    assert counts == {"unet": 865_910_724, "text": 354_032_641, "vae": 83_653_863}
    assert sum(counts.values()) == 1_303_597_228


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.diffusion_model.input_blocks.0.0.weight", (320, 4, 3, 3)),
        ("model.diffusion_model.time_embed.0.weight", (1280, 320)),
        ("model.diffusion_model.input_blocks.1.1.proj_in.weight", (320, 320)),
        ("model.diffusion_model.input_blocks.4.0.skip_connection.weight", (640, 320, 1, 1)),
        ("model.diffusion_model.input_blocks.9.0.op.weight", (1280, 1280, 3, 3)),
        (
            "model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight",
            (1280, 1024),
        ),
        (
            "model.diffusion_model.middle_block.1.transformer_blocks.0.ff.net.0.proj.weight",
            (10240, 1280),
        ),
        ("model.diffusion_model.output_blocks.2.1.conv.weight", (1280, 1280, 3, 3)),
        ("model.diffusion_model.output_blocks.5.2.conv.weight", (1280, 1280, 3, 3)),
        ("model.diffusion_model.output_blocks.8.0.in_layers.2.weight", (640, 960, 3, 3)),
        ("model.diffusion_model.output_blocks.11.1.proj_out.weight", (320, 320)),
        ("model.diffusion_model.out.2.weight", (4, 320, 3, 3)),
        ("cond_stage_model.model.token_embedding.weight", (49408, 1024)),
        ("cond_stage_model.model.positional_embedding", (77, 1024)),
        ("cond_stage_model.model.text_projection", (1024, 1024)),
        ("cond_stage_model.model.logit_scale", ()),
        ("cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight", (3072, 1024)),
        ("cond_stage_model.model.transformer.resblocks.0.mlp.c_fc.weight", (4096, 1024)),
        ("cond_stage_model.model.transformer.resblocks.0.mlp.c_proj.weight", (1024, 4096)),
        ("cond_stage_model.model.ln_final.weight", (1024,)),
        ("first_stage_model.encoder.conv_out.weight", (8, 512, 3, 3)),
        ("first_stage_model.encoder.down.1.block.0.nin_shortcut.weight", (256, 128, 1, 1)),
        ("first_stage_model.decoder.mid.attn_1.q.weight", (512, 512, 1, 1)),
        ("first_stage_model.decoder.up.0.block.0.nin_shortcut.weight", (128, 256, 1, 1)),
        ("first_stage_model.decoder.up.3.upsample.conv.weight", (512, 512, 3, 3)),
        ("first_stage_model.quant_conv.weight", (8, 8, 1, 1)),
        ("first_stage_model.post_quant_conv.weight", (4, 4, 1, 1)),
    ],
)
def test_exact_names_and_shapes(name: str, shape: tuple[int, ...]) -> None:
    assert SHAPES[name] == shape


def test_layout_limits() -> None:
    assert "model.diffusion_model.input_blocks.12.0.in_layers.0.weight" not in SHAPES
    assert not any(n.startswith("model.diffusion_model.input_blocks.10.1.") for n in SHAPES)
    assert not any("resblocks.24." in n for n in SHAPES)
    assert "first_stage_model.decoder.up.0.upsample.conv.weight" not in SHAPES
    assert "first_stage_model.encoder.down.3.downsample.conv.weight" not in SHAPES
    # SD 2.x: the UNet's transformers project linearly and attend over a 1024-wide context.
    unet = [(n, s) for n, s in TENSORS if n.startswith("model.diffusion_model.")]
    projections = [s for n, s in unet if n.endswith(("proj_in.weight", "proj_out.weight"))]
    assert len(projections) == 32 and all(len(s) == 2 for s in projections)
    assert {s[1] for n, s in unet if n.endswith("attn2.to_k.weight")} == {1024}
    # the VAE's attention keeps the LDM 1x1 convolutions
    assert SHAPES["first_stage_model.encoder.mid.attn_1.proj_out.weight"] == (512, 512, 1, 1)


def test_file_size_matches_the_measured_model() -> None:
    specs = sorted(fm.checkpoint_specs("sd-turbo"), key=lambda s: s[0])
    header = fm.header_bytes(specs, "f16", {"format": "pt", "sdfarm": "x" * 70, "seed": "0"})
    data = sum(math.prod(s) * 2 for _, s in TENSORS)
    assert len(header) % 8 == 0
    assert abs(len(header) + data - REFERENCE_SIZE) < 1_000_000


def test_the_repo_reads_it_as_an_sd2_checkpoint() -> None:
    tensors = {n: TensorInfo("F16", s, math.prod(s) * 2) for n, s in TENSORS}
    total = sum(t.nbytes for t in tensors.values())
    header = FileHeader("safetensors", tensors, 8, total, total + 8)
    assert detect_role(header) == "checkpoint"
    assert guess_architecture(header) == "sd2"


def test_taesd_decoder_layout() -> None:
    taesd = dict(fm.taesd_tensor_list())
    assert len(taesd) == 67
    assert sum(math.prod(s) for s in taesd.values()) == 1_222_531
    assert taesd["decoder.layers.0.weight"] == (64, 4, 3, 3)
    assert taesd["decoder.layers.2.conv.4.weight"] == (64, 64, 3, 3)
    assert taesd["decoder.layers.16.weight"] == (64, 64, 3, 3)
    assert "decoder.layers.16.bias" not in taesd  # the convs after each upsample have no bias
    assert taesd["decoder.layers.18.weight"] == (3, 64, 3, 3)
    # ReLU (1) and nn.Upsample (5, 10, 15) hold no tensors, as in tae.hpp's TinyDecoder.
    layers = {int(n.split(".")[2]) for n in taesd}
    assert layers == set(range(19)) - {1, 5, 10, 15}


def test_writer_streams_a_valid_deterministic_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fm, "CHUNK", 1000)  # several chunks per tensor
    specs = [
        ("b.weight", (64, 32, 3, 3), "w"),
        ("a.norm.weight", (64,), "one"),
        ("a.norm.bias", (64,), "zero"),
        ("c.scale", (), 2.5),
    ]
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    size = fm.write_safetensors(one, specs, "f16", 0, {"format": "pt"})
    fm.write_safetensors(two, specs, "f16", 0, {"format": "pt"})
    assert one.read_bytes() == two.read_bytes()
    assert size == one.stat().st_size and not list(tmp_path.glob("*.part"))
    t = load_file(str(one))
    assert list(t) == sorted(t)
    assert t["b.weight"].dtype == np.float16 and t["b.weight"].shape == (64, 32, 3, 3)
    assert abs(float(t["b.weight"].astype(np.float32).std()) - 1 / math.sqrt(32 * 9)) < 0.005
    assert (t["a.norm.weight"] == 1).all() and (t["a.norm.bias"] == 0).all()
    assert t["c.scale"].shape == () and float(t["c.scale"]) == 2.5
    # The same values whatever the chunk size, and another seed gives others.
    monkeypatch.setattr(fm, "CHUNK", 1 << 22)
    fm.write_safetensors(two, specs, "f16", 0, {"format": "pt"})
    assert one.read_bytes() == two.read_bytes()
    fm.write_safetensors(two, specs, "f16", 1, {"format": "pt"})
    assert not (load_file(str(two))["b.weight"] == t["b.weight"]).all()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_writer_other_dtypes(tmp_path: Path, dtype: str) -> None:
    path = tmp_path / "m.safetensors"
    fm.write_safetensors(path, [("w", (16, 8), "w"), ("n", (4,), "one")], dtype, 3, {})
    header = read_header(path)
    assert header.tensors["w"].dtype == fm.DTYPES[dtype][0]
    assert header.tensors["w"].nbytes == 16 * 8 * fm.DTYPES[dtype][1]
    if dtype == "f32":
        assert (load_file(str(path))["n"] == 1).all()
    else:  # bf16 of 1.0 is 0x3F80
        start = header.data_start  # "n" sorts first
        assert path.read_bytes()[start : start + 8] == bytes.fromhex("803f") * 4


def test_taesd_folder_is_a_model(tmp_path: Path, monkeypatch) -> None:
    """The --taesd folder's manifest and files, with a tiny stand-in checkpoint."""

    def tiny_checkpoint(arch: str = "sd-turbo"):
        return fm.unet_specs(model_channels=32, channel_mult=(1,), attention_levels=()) + [
            ("first_stage_model.decoder.conv_in.weight", (4, 4, 3, 3), "w")
        ]

    monkeypatch.setattr(fm, "checkpoint_specs", tiny_checkpoint)
    folders = fm.make(tmp_path, "sd-turbo", "f16", 0, taesd=True)
    assert [f.name for f in folders] == ["sd-turbo-random", "sd-turbo-random-taesd"]
    manifest = json.loads((folders[1] / "model.json").read_text())
    assert manifest == {
        "files": {"checkpoint": "model.safetensors", "taesd": "taesd.safetensors"},
        "native_size": [512, 512],
    }
    model = Model.from_dir(folders[1])
    assert set(model.files) == {"checkpoint", "taesd"}
    assert detect_role(read_header(folders[1] / "taesd.safetensors")) == "taesd"
    assert (folders[0] / "model.safetensors").read_bytes() == (
        folders[1] / "model.safetensors"
    ).read_bytes()
    assert json.loads((folders[0] / "model.json").read_text())["files"] == {
        "checkpoint": "model.safetensors"
    }
