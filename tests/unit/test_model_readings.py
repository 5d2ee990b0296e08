"""A model's header readings are made once per Model object."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from sdfarm.native.catalog import Catalog
from sdfarm.native.video import video_model


def test_a_models_header_readings_are_made_once(tmp_path: Path) -> None:
    """The catalog hands a worker the same Model for every job: its architecture, decoders
    and video reading are kept on it, not rescanned from 1,228 tensor names per job (4.8 ms
    a job for the full-size model, bench/job_prep.py)."""
    folder = tmp_path / "m"
    folder.mkdir()
    tensors = {
        "model.diffusion_model.input_blocks.0.0.weight": np.zeros((8, 4, 3, 3), np.float16),
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": np.zeros(
            (8, 1024), np.float16
        ),
        "first_stage_model.decoder.conv_in.weight": np.zeros((8, 4, 3, 3), np.float16),
        "first_stage_model.encoder.conv_in.weight": np.zeros((8, 3, 3, 3), np.float16),
    }
    save_file(tensors, str(folder / "model.safetensors"))
    catalog = Catalog([tmp_path])
    model = catalog.load("m")
    assert catalog.load("m") is model
    first = (model.architecture, model.decoders, video_model(model))
    assert first[0] == "sd2" and first[2] is None
    assert {"architecture", "decoders", "_video_model"} <= set(vars(model))
    assert (model.architecture, model.decoders, video_model(model)) == first
