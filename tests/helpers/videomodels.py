"""Video test helpers: a fake Wan model for refusal tests (the tensor names of a Wan2.1 DiT with
any layer count, one float each: the header check reads names only; the runtime would abort on
such a model), and the frames' digest, in this process or in a fresh one (the same job must
give the same frames across processes)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

CHILD = """
import hashlib, json, sys
from pathlib import Path
from sdfarm.native.engine import Engine
images = {k: Path(v).read_bytes() for k, v in json.loads(sys.argv[3]).items()}
with Engine.load(sys.argv[1], device="cpu", threads=2) as engine:
    r = engine.video(**json.loads(sys.argv[2]), **images)
print(hashlib.sha256(b"".join(f.tobytes() for f in r.frames)).hexdigest())
"""


def digest(frames: list[Image.Image]) -> str:
    """The SHA-256 of the frames' pixels, in order."""
    return hashlib.sha256(b"".join(f.tobytes() for f in frames)).hexdigest()


def digest_in_child(model: Path, params: dict, images: dict[str, Path] | None = None) -> str:
    """`digest` of the frames a fresh process makes of `params` with the model in `model`;
    `images` names input images by their files (read in the child)."""
    files = {k: str(v) for k, v in (images or {}).items()}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), json.dumps(params), json.dumps(files)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    return child.stdout.strip()


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


def decode_mp4(data: bytes) -> tuple[dict, list[bytes]]:
    """(ffmpeg's metadata, the frames as RGB bytes) of MP4 bytes (needs the `video` extra)."""
    import imageio_ffmpeg

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.mp4"
        path.write_bytes(data)
        reader = imageio_ffmpeg.read_frames(str(path))
        meta = next(reader)
        return meta, list(reader)
