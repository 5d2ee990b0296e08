"""A job's decoder (sdfarm.native.decoders): which decoders a model has, what a job's choice
resolves to or why it is refused, the engine key it runs on and the context settings the
engine makes from it. Pure logic on the tiny models' real headers; the runtime's side is in
tests/e2e/test_decoder.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sdfarm.native.decoders import DECODERS, ctx_settings, engine_decoder, own, resolve
from sdfarm.native.enginekey import EngineKey, engine_key, is_key, parse
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.model import Model
from sdfarm.native.params import GenerationParams, validate
from sdfarm.native.testmodel import make_vae_test_model, vae_decoder_specs


@pytest.fixture(scope="module")
def vae_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vae_test_model(tmp_path_factory.mktemp("vae"))


def test_models_list_their_decoders(vae_model: Path, tiny_models: list[Path], tmp_path) -> None:
    both = Model.from_dir(vae_model)
    assert both.decoders == ("vae", "taesd")
    assert Model.from_dir(tiny_models[0]).decoders == ("taesd",)  # the TAESD is its only one
    # The same folder without its TAESD: the VAE alone.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("dit.safetensors", "llm.safetensors", "vae.safetensors"):
        shutil.copy(vae_model / name, bare / name)
    assert Model.from_dir(bare).decoders == ("vae",)
    # The tiny VAE has no encoder, the tiny TAESD has one: img2img goes through the TAESD.
    assert not both.can_encode_with("vae") and both.can_encode_with("taesd")
    assert not both.can_encode  # its own decoder is the VAE


def test_the_tiny_vae_is_what_the_runtime_infers() -> None:
    specs = vae_decoder_specs()
    # The runtime reads the decoder's width from conv_in: 32 x ch_mult[-1] = 128 channels.
    assert specs["decoder.conv_in.weight"] == (128, 16, 3, 3)
    assert specs["decoder.conv_out.weight"] == (3, 32, 3, 3)
    assert "decoder.up.0.upsample.conv.weight" not in specs  # the top level does not upsample
    assert specs["decoder.up.0.block.0.nin_shortcut.weight"] == (32, 64, 1, 1)
    assert not any(n.startswith("encoder.") for n in specs)


@pytest.mark.parametrize(
    ("asked", "decoders", "got"),
    [
        ("default", ("vae", "taesd"), "vae"),
        ("default", ("taesd",), "taesd"),
        ("default", ("vae",), "vae"),
        ("taesd", ("vae", "taesd"), "taesd"),
        ("taesd", ("taesd",), "taesd"),
        ("vae", ("vae", "taesd"), "vae"),
    ],
)
def test_a_jobs_choice_resolves_to_a_decoder_the_model_has(asked, decoders, got) -> None:
    assert resolve(asked, decoders, "m") == got
    assert own(decoders) == resolve("default", decoders, "m")


@pytest.mark.parametrize(
    ("asked", "decoders", "says"),
    [
        ("taesd", ("vae",), "model 'm' has no TAESD file (role taesd): it decodes with vae"),
        ("vae", ("taesd",), "model 'm' has no full VAE: it decodes with taesd"),
        ("taesd", (), "it has no decoder"),
        ("fast", ("vae",), "unknown decoder 'fast'; choose one of default, vae, taesd"),
    ],
)
def test_a_decoder_the_model_lacks_is_refused_by_name(asked, decoders, says) -> None:
    with pytest.raises(InvalidParameterError) as info:
        resolve(asked, decoders, "m")
    assert info.value.parameter == "decoder"
    assert says in str(info.value)


def test_the_job_schema_takes_the_decoder() -> None:
    assert validate(GenerationParams(prompt="x")).decoder == "default"
    assert validate(GenerationParams(prompt="x", decoder="taesd")).decoder == "taesd"
    with pytest.raises(InvalidParameterError, match="choose one of default, vae, taesd"):
        validate(GenerationParams(prompt="x", decoder="TAESD"))
    assert DECODERS == ("default", "vae", "taesd")


def test_only_a_taesd_job_gets_another_engine() -> None:
    assert engine_key("m", {"decoder": "taesd"}) == "m+decoder:taesd"
    assert engine_key("m", {"decoder": "vae"}) == "m"
    assert engine_key("m", {"decoder": "default"}) == engine_key("m", {}) == "m"
    assert engine_decoder("taesd") == "taesd" and engine_decoder("default") == ""
    full = "m+control:c+embeddings:a,b+decoder:taesd"
    assert engine_key("m", {"control_net": "c", "embeddings": "b,a", "decoder": "taesd"}) == full
    assert parse(full) == EngineKey("m", "c", ("a", "b"), "taesd")
    assert str(parse(full)) == full and is_key(full) and is_key("m+decoder:taesd")
    assert not is_key("m") and not parse("m+decoder:taesd").plain
    for bad in ("m+decoder:", "m+decoder:vae", "m+decoder:taesd+control:c", "+decoder:taesd"):
        assert parse(bad) is None, bad


@pytest.mark.parametrize(
    ("decoders", "decoder", "taesd_encodes", "encodes", "settings"),
    [
        # The TAESD decodes: given to the runtime as the decoder.
        (("vae", "taesd"), "taesd", False, False, (True, False)),
        (("taesd",), "taesd", True, True, (True, False)),
        # The VAE decodes and the TAESD draws previews only (tae_preview_only)...
        (("vae", "taesd"), "vae", False, False, (True, True)),
        (("vae", "taesd"), "vae", True, True, (True, True)),
        # ...unless the context encodes and the TAESD has no encoder to build.
        (("vae", "taesd"), "vae", False, True, (False, True)),
        # No TAESD: nothing to pass.
        (("vae",), "vae", False, True, (False, False)),
    ],
)
def test_context_settings_per_decoder(decoders, decoder, taesd_encodes, encodes, settings):
    assert ctx_settings(decoders, decoder, taesd_encodes, encodes) == settings
