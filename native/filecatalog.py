"""Named single-file assets beside the models (LoRAs in `loras/`, upscalers in `upscalers/`):
where they live, how a name resolves, and a per-file-version cache of the check of each file.

Names come from users over the network, so a name resolves only to a file directly inside one
of the configured folders (no paths, no `..`, no symlinks out). What a file must be is the
subclass's `check` (sdfarm.native.loras, sdfarm.native.upscalers); this module only finds
files, so both kinds resolve the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Generic, TypeVar

from sdfarm.native.catalog import NAME
from sdfarm.native.errors import ModelLoadError

SUFFIXES = (".safetensors", ".gguf")
T = TypeVar("T")


def asset_dirs(
    models_dirs: Iterable[str | os.PathLike[str]], folder: str, given: Iterable[str], env: str
) -> list[Path]:
    """Each models directory's `folder`, then the folders given (else those in `$env`,
    os.pathsep-separated). Folders that do not exist are kept: one may appear."""
    dirs = [Path(d).expanduser().resolve() / folder for d in models_dirs]
    extra = list(given) or [d for d in os.environ.get(env, "").split(os.pathsep) if d]
    return dirs + [Path(d).expanduser().resolve() for d in extra]


class FileCatalog(Generic[T]):
    """The files of one kind found in a list of folders; each file is checked once per
    version (size, mtime). Subclasses name the kind and check a file."""

    kind = "file"  # in messages: "unknown LoRA 'x'"

    def __init__(self, dirs: Iterable[str | os.PathLike[str]]) -> None:
        self.dirs = [Path(d).expanduser().resolve() for d in dirs]
        self._checked: dict[str, tuple[tuple[int, int], Path, T]] = {}

    def check(self, name: str, path: Path) -> T:
        """The checked file `name` at `path`; ModelLoadError when it is not one of this kind."""
        raise NotImplementedError

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
        """The file of `name`; ModelLoadError when the name is not a plain name or no folder
        holds it."""
        if not isinstance(name, str) or not NAME.match(name):
            raise ModelLoadError(
                f"invalid {self.kind} name {name!r}: use letters, digits, '.', '_', '-'"
            )
        for d in self.dirs:
            for suffix in SUFFIXES:
                candidate = (d / f"{name}{suffix}").resolve()
                if candidate.parent == d and candidate.is_file():
                    return candidate
        raise ModelLoadError(
            f"unknown {self.kind} {name!r}; {self.kind}s: {', '.join(self.names()) or 'none'}"
        )

    def load(self, name: str) -> T:
        """The checked file of `name` (checked again only when the file changed)."""
        path = self.path(name)
        st = path.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        known = self._checked.get(name)
        if known is not None and known[0] == stamp and known[1] == path:
            return known[2]
        checked = self.check(name, path)
        self._checked[name] = (stamp, path, checked)
        return checked

    def all(self) -> dict[str, T]:
        """Every file that checks out, by name (what a worker's heartbeat lists)."""
        out = {}
        for name in self.names():
            try:
                out[name] = self.load(name)
            except ModelLoadError:
                continue
        return out
