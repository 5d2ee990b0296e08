"""LoRA files: where they live, how a name resolves, and the check of a file before the runtime
loads it.

A LoRA is one file (.safetensors or .gguf) named after its stem, in a `loras/` folder inside a
models directory (that name is reserved: it is not a model) or in a folder given with `--loras`
or `$SDFARM_LORAS`; a name resolves as every named file's does (sdfarm.native.filecatalog).
Its header is read and checked like a model file's (bounded by the file's size, never its
tensor data), and its tensor names must be a LoRA's (low-rank pairs, LoHa, LoKr or plain
diffs): a model file given as a LoRA is refused by name before the runtime would
quietly apply nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sdfarm.native.catalog import LORAS_FOLDER
from sdfarm.native.errors import ModelLoadError
from sdfarm.native.filecatalog import FileCatalog, asset_dirs
from sdfarm.native.headers import validate_header

LORA_MARKS = ("lora_down", "lora_up", "lora_A", "lora_B", "lora.down", "lora.up", "hada_w",
              "lokr_w", ".diff")  # fmt: skip
"""Tensor-name parts only a LoRA (or LyCORIS) file has."""


@dataclass(frozen=True)
class LoraFile:
    """A checked LoRA file: its name, absolute path and size in bytes, and the hash its
    trainer stored in its metadata (`sshs_model_hash`, "" when none), which A1111's `Lora
    hashes` prefers (sdfarm.native.filehash.lora_hash)."""

    name: str
    path: Path
    size: int
    stored_hash: str = ""


def lora_dirs(
    models_dirs: Iterable[str | os.PathLike[str]], given: Iterable[str] = ()
) -> list[Path]:
    """The LoRA folders: each models directory's `loras/`, then those given (else
    $SDFARM_LORAS, os.pathsep-separated). Folders that do not exist are kept: one may appear."""
    return asset_dirs(models_dirs, LORAS_FOLDER, given, "SDFARM_LORAS")


class LoraCatalog(FileCatalog[LoraFile]):
    """The LoRAs found in a list of folders; headers are read once per file version."""

    kind = "LoRA"

    def check(self, name: str, path: Path) -> LoraFile:
        header = validate_header(path, "lora")
        if not any(mark in n for n in header.tensors for mark in LORA_MARKS):
            shown = ", ".join(list(header.tensors)[:3]) or "no tensors"
            raise ModelLoadError(
                f"lora file {path.name}: its tensors are not a LoRA's ({shown}); a LoRA has "
                "low-rank pairs such as *.lora_down.weight / *.lora_up.weight",
                role="lora",
            )
        stored = header.metadata.get("sshs_model_hash") if header.format == "safetensors" else ""
        return LoraFile(name, path, header.file_size, str(stored or ""))

    def sizes(self) -> dict[str, int]:
        """{name: bytes} of every LoRA that checks out (what a worker's heartbeat lists)."""
        return {name: f.size for name, f in self.all().items()}
