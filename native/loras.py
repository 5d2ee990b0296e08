"""LoRA files: where they live, how a name resolves, and the check of a file before the runtime
loads it.

A LoRA is one file (.safetensors or .gguf) named after its stem, in a `loras/` folder inside a
models directory (that name is reserved: it is not a model) or in a folder given with `--loras`
or `$SDFARM_LORAS`. Names come from users over the network, so a name resolves only to a file
directly inside one of those folders (no paths, no `..`, no symlinks out). Its header is read
and checked like a model file's (bounded by the file's size, never its tensor data), and its
tensor names must be a LoRA's (low-rank pairs, LoHa, LoKr or plain diffs): a model file given
as a LoRA is refused by name before the runtime would quietly apply nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sdfarm.native.catalog import LORAS_FOLDER, NAME
from sdfarm.native.errors import ModelLoadError
from sdfarm.native.headers import validate_header

SUFFIXES = (".safetensors", ".gguf")
LORA_MARKS = ("lora_down", "lora_up", "lora_A", "lora_B", "lora.down", "lora.up", "hada_w",
              "lokr_w", ".diff")  # fmt: skip
"""Tensor-name parts only a LoRA (or LyCORIS) file has."""


@dataclass(frozen=True)
class LoraFile:
    """A checked LoRA file: its name, absolute path and size in bytes."""

    name: str
    path: Path
    size: int


def lora_dirs(
    models_dirs: Iterable[str | os.PathLike[str]], given: Iterable[str] = ()
) -> list[Path]:
    """The LoRA folders: each models directory's `loras/`, then those given (else
    $SDFARM_LORAS, os.pathsep-separated). Folders that do not exist are kept: one may appear."""
    dirs = [Path(d).expanduser().resolve() / LORAS_FOLDER for d in models_dirs]
    extra = list(given) or [d for d in os.environ.get("SDFARM_LORAS", "").split(os.pathsep) if d]
    return dirs + [Path(d).expanduser().resolve() for d in extra]


class LoraCatalog:
    """The LoRAs found in a list of folders; headers are read once per file version."""

    def __init__(self, dirs: Iterable[str | os.PathLike[str]]) -> None:
        self.dirs = [Path(d).expanduser().resolve() for d in dirs]
        self._checked: dict[str, tuple[tuple[int, int], LoraFile]] = {}

    def names(self) -> list[str]:
        found: set[str] = set()
        for d in self.dirs:
            if d.is_dir():
                found.update(
                    p.stem for p in d.iterdir()
                    if p.suffix.lower() in SUFFIXES and p.is_file() and NAME.match(p.stem)
                )  # fmt: skip
        return sorted(found)

    def path(self, name: str) -> Path:
        """The file of LoRA `name`; ModelLoadError when the name is not a plain name or no
        folder holds it."""
        if not isinstance(name, str) or not NAME.match(name):
            raise ModelLoadError(f"invalid LoRA name {name!r}: use letters, digits, '.', '_', '-'")
        for d in self.dirs:
            for suffix in SUFFIXES:
                candidate = (d / f"{name}{suffix}").resolve()
                if candidate.parent == d and candidate.is_file():
                    return candidate
        raise ModelLoadError(f"unknown LoRA {name!r}; LoRAs: {', '.join(self.names()) or 'none'}")

    def load(self, name: str) -> LoraFile:
        """The checked file of LoRA `name` (its header re-read only when the file changed)."""
        path = self.path(name)
        st = path.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        known = self._checked.get(name)
        if known is not None and known[0] == stamp and known[1].path == path:
            return known[1]
        header = validate_header(path, "lora")
        if not any(mark in n for n in header.tensors for mark in LORA_MARKS):
            shown = ", ".join(list(header.tensors)[:3]) or "no tensors"
            raise ModelLoadError(
                f"lora file {path.name}: its tensors are not a LoRA's ({shown}); a LoRA has "
                "low-rank pairs such as *.lora_down.weight / *.lora_up.weight",
                role="lora",
            )
        checked = LoraFile(name, path, header.file_size)
        self._checked[name] = (stamp, checked)
        return checked

    def sizes(self) -> dict[str, int]:
        """{name: bytes} of every LoRA that checks out (what a worker's heartbeat lists)."""
        out = {}
        for name in self.names():
            try:
                out[name] = self.load(name).size
            except ModelLoadError:
                continue
        return out
