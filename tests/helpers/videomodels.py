"""A fake Wan model for refusal tests: the tensor names of a Wan2.1 DiT with any layer count,
one float each (the header check reads names only; the runtime would abort on such a model)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def fake_wan(folder: Path, layers: int) -> Path:
    """`folder` holding dit.gguf (Wan tensor names, `layers` blocks) and its model.json."""
    import gguf

    from sdfarm.native.wantestmodel import dit_specs

    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(folder / "dit.gguf"), arch="sdfarm-fake-wan")
    for name in dit_specs(layers):
        writer.add_tensor(name, np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    manifest = {"files": {"diffusion_model": "dit.gguf"}, "native_size": [64, 64]}
    (folder / "model.json").write_text(json.dumps(manifest), encoding="utf-8")
    return folder
