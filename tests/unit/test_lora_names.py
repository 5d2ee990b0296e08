"""LoRA names resolve only inside the LoRA folders, their headers are checked like model files',
and a job's LoRA list is parsed and bounded by the job schema."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sdfarm.native.catalog import Catalog
from sdfarm.native.errors import InvalidParameterError, ModelLoadError
from sdfarm.native.loras import LoraCatalog, lora_dirs
from sdfarm.native.params import MAX_LORAS, GenerationParams, validate


def write(path: Path, names: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: np.zeros((4, 8), dtype=np.float16) for n in names}, str(path))
    return path


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    models = tmp_path / "models"
    write(models / "loras" / "style.safetensors", ["diffusion_model.x.lora_down.weight",
                                                   "diffusion_model.x.lora_up.weight"])  # fmt: skip
    write(models / "loras" / "not-a-lora.safetensors", ["double_blocks.0.img_attn.qkv.weight"])
    (models / "loras" / "notes.txt").write_text("not a LoRA file")
    extra = tmp_path / "extra"
    write(extra / "detail.safetensors", ["lora_unet_x.lora_A.weight", "lora_unet_x.lora_B.weight"])
    return models, extra


def test_names_resolve_only_inside_the_folders(folders: tuple[Path, Path]) -> None:
    models, extra = folders
    catalog = LoraCatalog(lora_dirs([models], [str(extra)]))
    assert catalog.names() == ["detail", "not-a-lora", "style"]
    assert catalog.load("style").path == models / "loras" / "style.safetensors"
    assert catalog.load("detail").size > 0
    for bad in ("../style", "loras/style", "/etc/passwd", ".hidden"):
        with pytest.raises(ModelLoadError, match="invalid LoRA name"):
            catalog.path(bad)
    with pytest.raises(ModelLoadError, match="unknown LoRA 'missing'; LoRAs: detail"):
        catalog.path("missing")
    assert "loras" not in Catalog([models]).names()  # the folder is not a model


def test_a_model_file_given_as_a_lora_is_refused_by_name(folders: tuple[Path, Path]) -> None:
    models, _ = folders
    catalog = LoraCatalog(lora_dirs([models]))
    with pytest.raises(ModelLoadError) as err:
        catalog.load("not-a-lora")
    assert "lora file not-a-lora.safetensors: its tensors are not a LoRA's" in str(err.value)
    assert str(models) not in str(err.value)
    assert catalog.sizes() == {"style": catalog.load("style").size}  # what a heartbeat lists


def test_lora_dirs_come_from_the_environment_when_none_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDFARM_LORAS", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert lora_dirs([tmp_path / "m"]) == [
        (tmp_path / "m" / "loras").resolve(), (tmp_path / "a").resolve(),
        (tmp_path / "b").resolve(),
    ]  # fmt: skip


def test_a_jobs_lora_list_is_parsed_and_bounded() -> None:
    p = validate(GenerationParams(prompt="p", loras=["a:0.5", ["b", 2], {"name": "c"}, "d"]))
    assert p.loras == (("a", 0.5), ("b", 2.0), ("c", 1.0), ("d", 1.0))
    assert p.as_dict()["loras"] == [["a", 0.5], ["b", 2.0], ["c", 1.0], ["d", 1.0]]
    for bad, says in [
        (["a", "a:2"], "listed twice"),
        (["../x"], "is not a LoRA name"),
        (["a:11"], "outside -10..10"),
        (["a:strong"], "must be a number"),
        ([f"l{i}" for i in range(MAX_LORAS + 1)], f"at most {MAX_LORAS}"),
        ("a:1", "must be a list"),
    ]:
        with pytest.raises(InvalidParameterError, match=says) as err:
            validate(GenerationParams(prompt="p", loras=bad))
        assert err.value.parameter.startswith("loras")
