"""Model directories: each subfolder of a models directory is one model named after it.

Model names come from users (and over the network), so a name resolves only to a direct
subfolder of a configured directory: no paths, no `..`, no symlinks out of the directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from sdfarm.native.errors import ModelLoadError
from sdfarm.native.model import Model

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
LORAS_FOLDER = "loras"
"""A models directory's folder of LoRA files (sdfarm.native.loras): not a model."""
UPSCALERS_FOLDER = "upscalers"
"""A models directory's folder of upscaler files (sdfarm.native.upscalers): not a model."""
CONTROLNETS_FOLDER = "controlnets"
"""A models directory's folder of ControlNet files (sdfarm.native.controlnets): not a model."""
EMBEDDINGS_FOLDER = "embeddings"
"""A models directory's folder of textual-inversion embeddings (sdfarm.native.embeddings)."""
ASSET_FOLDERS = (LORAS_FOLDER, UPSCALERS_FOLDER, CONTROLNETS_FOLDER, EMBEDDINGS_FOLDER)


def model_dirs(given: Iterable[str | os.PathLike[str]] = ()) -> list[Path]:
    """The directories named on the command line, else those in $SDFARM_MODELS
    (os.pathsep-separated)."""
    dirs = [Path(d) for d in given]
    if not dirs and os.environ.get("SDFARM_MODELS"):
        dirs = [Path(d) for d in os.environ["SDFARM_MODELS"].split(os.pathsep) if d]
    return [d.expanduser().resolve() for d in dirs]


class Catalog:
    """The models found in a list of directories."""

    def __init__(self, dirs: Iterable[str | os.PathLike[str]]) -> None:
        self.dirs = [Path(d).expanduser().resolve() for d in dirs]
        self._cache: dict[str, tuple[tuple, Model]] = {}

    def names(self) -> list[str]:
        found = set()
        for d in self.dirs:
            if d.is_dir():
                found.update(
                    p.name
                    for p in d.iterdir()
                    if p.is_dir() and NAME.match(p.name) and p.name not in ASSET_FOLDERS
                )
        return sorted(found)

    def path(self, name: str) -> Path:
        """The folder of model `name`; ModelLoadError when the name is not a plain name or no
        directory holds it."""
        if not isinstance(name, str) or not NAME.match(name) or name in ASSET_FOLDERS:
            raise ModelLoadError(f"invalid model name {name!r}: use letters, digits, '.', '_', '-'")
        for d in self.dirs:
            candidate = (d / name).resolve()
            if candidate.parent == d and candidate.is_dir():
                return candidate
        where = ", ".join(str(d) for d in self.dirs) or "no model directory configured"
        raise ModelLoadError(
            f"unknown model {name!r}; models: {', '.join(self.names()) or 'none'} (in {where})"
        )

    def load(self, name: str) -> Model:
        """The model `name`, its headers read once and read again only when a file in its
        folder changed (a worker resolves a model for every job: 3 ms of header parsing
        per job otherwise)."""
        folder = self.path(name)
        stamp = _stamp(folder)
        cached = self._cache.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        model = Model.from_dir(folder)
        self._cache[name] = (stamp, model)
        return model


def _stamp(folder: Path) -> tuple:
    """What identifies a folder's contents cheaply: each entry's name, size and mtime."""
    out = []
    with os.scandir(folder) as it:
        for e in it:
            st = e.stat()
            out.append((e.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return (str(folder), tuple(sorted(out)))


def resolve(model: str, dirs: Iterable[str | os.PathLike[str]] = ()) -> Model:
    """A model given on the command line: a name inside the model directories, or a folder."""
    cat = Catalog(model_dirs(dirs))
    if cat.dirs and NAME.match(model) and not Path(model).is_dir():
        return cat.load(model)
    if Path(model).is_dir():
        return Model.from_dir(Path(model))
    return cat.load(model)
