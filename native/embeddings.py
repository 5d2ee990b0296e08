"""Textual-inversion embeddings: where they live, how a name resolves, and the check of a file
before the runtime reads it.

An embedding is one file (.safetensors or .gguf) named after its stem, in an `embeddings/`
folder inside a models directory (a reserved name: not a model) or in a folder given with
`--embedding-dir` or `$SDFARM_EMBEDDINGS`; a name resolves as every named file's does
(sdfarm.native.filecatalog).

What the runtime does with them (src/conditioner.hpp of master-596): the list
(`sd_embedding_t`: name, path) is a context parameter, read when the engine is made. Each name
(lowercased) becomes a special token of the CLIP tokenizer; the first prompt holding it reads
the file and appends its vectors to the token table. Only CLIP text encoders take them (SD 1.x,
2.x, XL). Any embedding at all makes the runtime keep the token table in f32.

Which embeddings an engine loads: those the job lists (`embeddings`), not every file of the
folders. A loaded name is a token in every prompt the engine encodes, so with the folders'
whole set a job's pixels would depend on which files a worker happens to have (an embedding
named like a prompt word silently replaces it, on one worker and not another); listed, the
same job gives the same pixels on every worker, and an engine without embeddings keeps its
token table as the file has it. The cost is one engine per (model, ControlNet, embedding set),
named by its engine key (sdfarm.native.enginekey), so the engine cache, the heartbeat's
loaded list and the scheduler's affinity all tell them apart.

The check: the runtime copies an embedding's bytes into its f32 token table as they are, so a
tensor must be F32 (an f16 file would be read as garbage, and past its buffer), each tensor's
last dimension a CLIP width (768 CLIP-L, 1024 OpenCLIP-H, 1280 OpenCLIP-bigG), and the file
within the runtime's 100 MB arena for custom embeddings.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sdfarm.native.catalog import EMBEDDINGS_FOLDER
from sdfarm.native.errors import ModelLoadError
from sdfarm.native.filecatalog import FileCatalog, asset_dirs
from sdfarm.native.headers import validate_header

ROLE = "embedding"
WIDTHS = (768, 1024, 1280)
MAX_VECTORS = 75
"""Vectors a file may add: one 77-token CLIP chunk less its start and end tokens."""
MAX_BYTES = 64 * 1024 * 1024
"""Under the runtime's 100 MB arena for custom embeddings (conditioner.hpp)."""
F32 = ("F32", "f32")
TABLE_BYTES = 49408 * (768 + 1280) * 4
"""What embeddings add to an engine beside their own bytes, at most: the runtime keeps the
token table in f32 once any embedding is given (CLIP-L's and, for SDXL, OpenCLIP-bigG's:
49408 rows each), where the file may hold it in f16 or quantised. The estimate counts it whole
(the scheduler has no model's header to tell how much is already f32)."""


@dataclass(frozen=True)
class EmbeddingFile:
    """A checked embedding: name, absolute path, size in bytes, vectors and width."""

    name: str
    path: Path
    size: int
    vectors: int
    width: int


def check_embedding(name: str, path: Path) -> EmbeddingFile:
    """Read and check an embedding file's header (never its data)."""
    header = validate_header(path, ROLE)
    label = f"embedding file {path.name}"
    if not header.tensors:
        raise ModelLoadError(f"{label} holds no tensor", role=ROLE)
    if header.file_size > MAX_BYTES:
        raise ModelLoadError(
            f"{label} is {header.file_size:,} bytes; an embedding may be {MAX_BYTES:,} (the "
            "runtime reads custom embeddings into a 100 MB arena)",
            role=ROLE,
        )
    vectors, widths = 0, set()
    for tname, info in header.tensors.items():
        if info.dtype not in F32:
            raise ModelLoadError(
                f"{label} has tensor {tname!r} in {info.dtype}; the runtime copies embedding "
                "bytes into its f32 token table as they are, so only F32 reads right (convert "
                "the file to f32)",
                role=ROLE,
            )
        if not 1 <= len(info.shape) <= 2 or info.shape[-1] not in WIDTHS:
            raise ModelLoadError(
                f"{label} has tensor {tname!r} of shape {list(info.shape)}; an embedding is "
                f"[vectors, width] with width {', '.join(map(str, WIDTHS))} (a CLIP's)",
                role=ROLE,
            )
        vectors += info.shape[0] if len(info.shape) == 2 else 1
        widths.add(info.shape[-1])
    if vectors > MAX_VECTORS:
        raise ModelLoadError(
            f"{label} has {vectors} vectors; at most {MAX_VECTORS} fit a prompt chunk",
            role=ROLE,
        )
    return EmbeddingFile(name, path, header.file_size, vectors, min(widths))


def embedding_dirs(
    models_dirs: Iterable[str | os.PathLike[str]], given: Iterable[str] = ()
) -> list[Path]:
    """The embedding folders: each models directory's `embeddings/`, then those given (else
    $SDFARM_EMBEDDINGS, os.pathsep-separated)."""
    return asset_dirs(models_dirs, EMBEDDINGS_FOLDER, given, "SDFARM_EMBEDDINGS")


class EmbeddingCatalog(FileCatalog[EmbeddingFile]):
    """The embeddings found in a list of folders; headers are read once per file version."""

    kind = "embedding"

    def check(self, name: str, path: Path) -> EmbeddingFile:
        return check_embedding(name, path)

    def sizes(self) -> dict[str, int]:
        """{name: bytes} of every embedding that checks out (what a heartbeat lists)."""
        return {name: f.size for name, f in self.all().items()}
