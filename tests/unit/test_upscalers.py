"""Upscaler files without the runtime: the network the tiny ESRGAN has is the one esrgan.hpp
builds, names resolve only inside the upscalers/ folders, a file of another architecture is
refused by name, the job schema checks factor, tile size and output caps, and the estimate
grows with tile and output pixels."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file

from sdfarm.native.catalog import Catalog
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.estimate import UpscalerFacts, upscaler_facts
from sdfarm.native.headers import read_header
from sdfarm.native.model import Model
from sdfarm.native.roles import detect_role
from sdfarm.native.testmodel import TEST_UPSCALERS, make_test_upscaler
from sdfarm.native.upscale_params import (
    UPSCALE_NAMES,
    UpscaleParams,
    check_against,
    from_mapping,
    validate,
)
from sdfarm.native.upscalers import (
    UpscalerCatalog,
    architecture,
    esrgan_names,
    rrdbnet_specs,
    upscaler_dirs,
)


def png(w: int, h: int, seed: int = 1, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, (h, w, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr.squeeze(), mode).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name, (scale, layout) in TEST_UPSCALERS.items():
        make_test_upscaler(tmp_path / "upscalers" / f"{name}.safetensors", scale, layout)
    return tmp_path


def test_the_specs_are_the_network_esrgan_hpp_builds() -> None:
    specs = rrdbnet_specs(1, 4)
    # RRDBNet(scale 4, 1 block, 3 -> 3 channels, 64 features, 32 growth): a conv in, three
    # dense blocks of five convs, the body conv, two upsampling convs, hr and last.
    assert len(specs) == 2 * (1 + 15 + 1 + 2 + 2)
    assert specs["conv_first.weight"] == (64, 3, 3, 3)
    assert specs["body.0.rdb3.conv1.weight"] == (32, 64, 3, 3)
    assert specs["body.0.rdb3.conv4.weight"] == (32, 160, 3, 3)
    assert specs["body.0.rdb3.conv5.weight"] == (64, 192, 3, 3)
    assert specs["conv_last.weight"] == (3, 64, 3, 3)
    assert "conv_up2.weight" not in rrdbnet_specs(1, 2)
    assert "conv_up1.weight" not in rrdbnet_specs(1, 1)
    # The old layout's names, as esrgan.hpp maps them.
    names = esrgan_names(2, 4)
    assert names["body.1.rdb2.conv3.bias"] == "model.1.sub.1.RDB2.conv3.0.bias"
    assert names["conv_body.weight"] == "model.1.sub.2.weight"
    assert names["conv_last.weight"] == "model.10.weight"
    assert esrgan_names(1, 2)["conv_last.weight"] == "model.7.weight"


def test_the_tiny_upscalers_carry_exactly_those_tensors(folder: Path) -> None:
    for name, (scale, layout) in TEST_UPSCALERS.items():
        header = read_header(folder / "upscalers" / f"{name}.safetensors")
        mapping = esrgan_names(1, scale) if layout == "esrgan" else {}
        want = {mapping.get(n, n): s for n, s in rrdbnet_specs(1, scale).items()}
        assert {n: t.shape for n, t in header.tensors.items()} == want
        assert all(t.dtype == ("F16" if len(t.shape) > 1 else "F32")
                   for t in header.tensors.values())  # fmt: skip
        arch = architecture(header)
        assert (arch.layout, arch.scale, arch.num_block) == (layout, scale, 1)
        assert detect_role(header) == "upscaler"


def test_the_tiny_upscalers_are_deterministic(tmp_path: Path) -> None:
    a = make_test_upscaler(tmp_path / "a.safetensors", 2)
    b = make_test_upscaler(tmp_path / "b.safetensors", 2)
    assert a.read_bytes() == b.read_bytes()


def test_names_resolve_only_inside_the_folder(folder: Path, tmp_path: Path) -> None:
    catalog = UpscalerCatalog(upscaler_dirs([folder]))
    assert catalog.names() == sorted(TEST_UPSCALERS)
    assert catalog.load("tiny-esrgan-x2").scale == 2
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    make_test_upscaler(outside / "evil.safetensors", 2)
    os.symlink(outside / "evil.safetensors", folder / "upscalers" / "linked.safetensors")
    for bad in ("../elsewhere/evil", "/etc/passwd", "linked", "nope", "", "a/b"):
        with pytest.raises(ModelLoadError):
            catalog.load(bad)
    # upscalers/ is not a model
    assert "upscalers" not in Catalog([folder]).names()
    with pytest.raises(ModelLoadError, match="invalid model name"):
        Catalog([folder]).path("upscalers")


def test_a_file_of_another_architecture_is_refused_by_name(folder: Path) -> None:
    up = folder / "upscalers"
    specs = rrdbnet_specs(1, 2)
    # A network of 32 features, which the runtime cannot build (its widths are fixed).
    narrow = {n: np.zeros(tuple(min(d, 32) if d == 64 else d for d in s), np.float32)
              for n, s in specs.items()}  # fmt: skip
    save_file(narrow, str(up / "narrow.safetensors"))
    missing = {n: np.zeros(s, np.float32) for n, s in specs.items() if "conv_hr" not in n}
    save_file(missing, str(up / "missing.safetensors"))
    save_file({"lora_down.weight": np.zeros((4, 4), np.float32)}, str(up / "lora.safetensors"))
    (up / "garbage.safetensors").write_bytes(b"\x00" * 64)
    catalog = UpscalerCatalog(upscaler_dirs([folder]))
    with pytest.raises(ModelLoadError, match="of shape .* the runtime builds"):
        catalog.load("narrow")
    with pytest.raises(ModelLoadError, match="lacks tensor 'conv_hr.weight'"):
        catalog.load("missing")
    with pytest.raises(ModelLoadError, match="not an ESRGAN"):
        catalog.load("lora")
    with pytest.raises(ModelLoadError, match="upscaler file garbage"):
        catalog.load("garbage")
    assert sorted(catalog.all()) == sorted(TEST_UPSCALERS)  # what a heartbeat lists


def test_an_upscaler_in_a_model_folder_says_where_it_belongs(folder: Path) -> None:
    model = folder / "mixed"
    model.mkdir()
    make_test_upscaler(model / "esrgan.safetensors", 4)
    with pytest.raises(ModelLoadError, match="upscalers/ folder"):
        Model.from_dir(model)


def test_the_schema_checks_factor_tile_size_and_caps() -> None:
    assert UPSCALE_NAMES == ("image", "upscaler", "factor", "tile_size")
    ok = validate(UpscaleParams(image=png(16, 12), upscaler="tiny-esrgan-x2"))
    assert (ok.factor, ok.tile_size) == (0, 128)
    assert check_against(ok, 2).factor == 2
    assert validate(UpscaleParams(image=png(16, 12), upscaler="x", tile_size=0)).tile_size == 0
    bad = {
        "factor": {"factor": 5},
        "tile_size": {"tile_size": 16},
        "upscaler": {"upscaler": "../x"},
        "image": {"image": b"not an image"},
    }
    for name, change in bad.items():
        values = {"image": png(16, 12), "upscaler": "x", **change}
        with pytest.raises(InvalidParameterError) as err:
            validate(from_mapping(values))
        assert err.value.parameter == name
    four = validate(UpscaleParams(image=png(16, 12), upscaler="x", factor=4))
    with pytest.raises(InvalidParameterError) as err:
        check_against(four, 2)  # the runtime would return 2x whatever the factor
    assert err.value.parameter == "factor"
    big = validate(UpscaleParams(image=png(2100, 8), upscaler="x"))  # fine at x1..x3
    with pytest.raises(InvalidParameterError, match="beyond 8192 pixels a side"):
        check_against(big, 4)
    with pytest.raises(InvalidParameterError) as err:
        from_mapping({"upscaler": "x"})
    assert err.value.parameter == "image"
    with pytest.raises(InvalidParameterError) as err:
        from_mapping({"image": png(8, 8), "upscaler": "x", "prompt": "no"})
    assert err.value.parameter == "prompt"


def test_the_estimate_grows_with_tiles_and_output() -> None:
    facts = UpscalerFacts(bytes=64 << 20, scale=4, tile_per_pixel=1024)
    assert facts.estimate(64, 64, 128) == facts.estimate(64, 64, 0)  # one tile either way
    assert facts.estimate(512, 512, 0) > facts.estimate(512, 512, 128)  # tiles save memory
    assert facts.estimate(512, 512, 128) > facts.estimate(256, 256, 128)  # the output counts
    assert facts.estimate(8, 8, 0) > facts.resident() > 64 << 20
    assert UpscalerFacts.from_json(facts.as_json()) == facts
    cpu, cuda = upscaler_facts(1000, 2, "CPU"), upscaler_facts(1000, 2, "CUDA0")
    assert cuda.tile_per_pixel > cpu.tile_per_pixel  # im2col without direct convolution
    assert cuda.overhead > cpu.overhead  # a GPU backend's context: the seed's 512 MiB
    assert UpscalerFacts.cautious([cpu, cuda]) == cuda
    assert cpu.working(64, 64, 0) == cpu.estimate(64, 64, 0) - cpu.overhead
