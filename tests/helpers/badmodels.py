"""Broken and huge model folders made from the tiny model, for the engine's error paths."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

HUGE_BYTES = 200 * 10**9


def _manifest(folder: Path, files: dict[str, str]) -> None:
    (folder / "model.json").write_text(json.dumps({"files": files, "native_size": [256, 256]}))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def make_sparse_huge_model(tiny: Path, dst: Path, apparent: int = HUGE_BYTES) -> Path:
    """The tiny model whose DiT file claims one tensor of `apparent` bytes: a valid header,
    the file extended sparsely (no disk used). The memory check sees a 200 GB model; the
    runtime, if asked anyway, finds the tensor's shape wrong and refuses the load."""
    dst.mkdir(parents=True)
    for f in ("llm.safetensors", "taesd.safetensors"):
        shutil.copy2(tiny / f, dst / f)
    raw = (tiny / "dit.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    name = "double_blocks.0.img_mlp.up_proj.weight"
    rows = apparent // (2 * 128)
    header[name] = {"dtype": "F16", "shape": [rows, 128], "data_offsets": [end, end + rows * 256]}
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with (dst / "dit.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data[:end])
        f.truncate(8 + len(h) + end + rows * 256)
    _manifest(
        dst,
        {
            "diffusion_model": "dit.safetensors",
            "llm": "llm.safetensors",
            "taesd": "taesd.safetensors",
        },
    )
    return dst


def make_broken_model(tiny: Path, dst: Path, kind: str) -> Path:
    """The tiny model with its diffusion_model file replaced: garbage, empty, truncated, or
    the llm file put in the diffusion_model role."""
    copy_model(tiny, dst)
    dit = dst / "dit.safetensors"
    if kind == "garbage":
        dit.write_bytes(b"this is not a model file at all\n" * 100)
    elif kind == "empty":
        dit.write_bytes(b"")
    elif kind == "truncated":
        dit.write_bytes(dit.read_bytes()[: dit.stat().st_size // 2])
    elif kind == "wrong-role":
        shutil.copy2(dst / "llm.safetensors", dit)
    else:
        raise ValueError(kind)
    return dst
