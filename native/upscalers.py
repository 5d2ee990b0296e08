"""Upscaler files (ESRGAN, the RRDBNet architecture): where they live, the architecture the
runtime builds, and the check of a file before the runtime loads it.

An upscaler is one file (.safetensors or .gguf) named after its stem, in an `upscalers/` folder
inside a models directory (a reserved name: not a model) or in a folder given with
`--upscaler-dir` or `$SDFARM_UPSCALERS`; a name resolves as every named file's does
(sdfarm.native.filecatalog).

What the runtime builds (src/esrgan.hpp of master-596): an RRDBNet whose block count and scale
it infers from tensor names, in the original layout (`conv_first`, `body.N.rdbM.convK`,
`conv_body`, `conv_up1`, `conv_up2`, `conv_hr`, `conv_last`) or the old ESRGAN one (`model.0`,
`model.1.sub.N.RDBM.convK.0`, `model.3/6/8/10`). Its widths are NOT inferred: 64 features, 32
growth channels, RGB in and out are fixed, and a file of other widths fails to load. The scale
is 4 with `conv_up2`, 2 with only `conv_up1`, else 1, and the upscale call ignores the factor it
is given: the output is always the input times the model's scale. So the check here computes
every tensor the runtime will ask for, with its shape, and refuses a file that lacks one or has
another shape; a job's factor must be the model's scale.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdfarm.native.catalog import UPSCALERS_FOLDER
from sdfarm.native.errors import ModelLoadError
from sdfarm.native.filecatalog import FileCatalog, asset_dirs
from sdfarm.native.headers import FileHeader, validate_header
from sdfarm.native.roles import UPSCALER, UPSCALER_BODY_RE, UPSCALER_SUB_RE

ROLE = UPSCALER
NUM_FEAT, NUM_GROW_CH, CHANNELS = 64, 32, 3  # fixed in esrgan.hpp
SCALES = (1, 2, 4)
MAX_BLOCKS = 64  # the real models have 23 (x4plus) or 6 (anime_6B)
_MODEL_RE = re.compile(r"^model\.(\d+)\.")


def _conv(out: dict[str, tuple[int, ...]], name: str, cin: int, cout: int) -> None:
    out[f"{name}.weight"] = (cout, cin, 3, 3)
    out[f"{name}.bias"] = (cout,)


def rrdbnet_specs(num_block: int, scale: int) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape (PyTorch order)} of the RRDBNet esrgan.hpp builds, original layout."""
    out: dict[str, tuple[int, ...]] = {}
    f, g = NUM_FEAT, NUM_GROW_CH
    _conv(out, "conv_first", CHANNELS, f)
    for i in range(num_block):
        for j in (1, 2, 3):
            for k in range(1, 6):
                cout = f if k == 5 else g
                _conv(out, f"body.{i}.rdb{j}.conv{k}", f + (k - 1) * g, cout)
    _conv(out, "conv_body", f, f)
    if scale >= 2:
        _conv(out, "conv_up1", f, f)
    if scale == 4:
        _conv(out, "conv_up2", f, f)
    _conv(out, "conv_hr", f, f)
    _conv(out, "conv_last", f, CHANNELS)
    return out


def esrgan_names(num_block: int, scale: int) -> dict[str, str]:
    """{original name: old ESRGAN name}, the mapping esrgan.hpp applies to `model.N` files."""
    out = {"conv_first": "model.0", "conv_body": f"model.1.sub.{num_block}"}
    for i in range(num_block):
        for j in (1, 2, 3):
            for k in range(1, 6):
                out[f"body.{i}.rdb{j}.conv{k}"] = f"model.1.sub.{i}.RDB{j}.conv{k}.0"
    hr, last = {1: (2, 4), 2: (5, 7), 4: (8, 10)}[scale]
    if scale >= 2:
        out["conv_up1"] = "model.3"
    if scale == 4:
        out["conv_up2"] = "model.6"
    out["conv_hr"], out["conv_last"] = f"model.{hr}", f"model.{last}"
    return {f"{k}.{p}": f"{v}.{p}" for k, v in out.items() for p in ("weight", "bias")}


@dataclass(frozen=True)
class Architecture:
    """What the runtime will build from a file: its layout ("rrdbnet" or "esrgan"), block
    count and scale, and how many parameters it holds."""

    layout: str
    num_block: int
    scale: int
    params: int


def architecture(header: FileHeader, label: str = "upscaler file") -> Architecture:
    """The RRDBNet the runtime will build from `header`, inferred as esrgan.hpp infers it;
    ModelLoadError naming the tensor when the file is not exactly that network."""
    names = set(header.tensors)
    if "model.0.weight" in names:
        layout = "esrgan"
        blocks = [int(m.group(1)) for n in names if (m := UPSCALER_SUB_RE.match(n))]
        top = max((int(m.group(1)) for n in names if (m := _MODEL_RE.match(n))), default=0)
        scale = 1 if top <= 4 else 2 if top <= 7 else 4
    elif "conv_first.weight" in names:
        layout = "rrdbnet"
        blocks = [int(m.group(1)) for n in names if (m := UPSCALER_BODY_RE.match(n))]
        scale = 4 if "conv_up2.weight" in names else 2 if "conv_up1.weight" in names else 1
    else:
        shown = ", ".join(sorted(names)[:3]) or "no tensors"
        raise ModelLoadError(
            f"{label}: its tensors are not an ESRGAN's ({shown}); the runtime loads RRDBNet "
            "files (conv_first, body.N.rdbM.convK, ... or model.0, model.1.sub.N.RDBM...)",
            role=ROLE,
        )
    num_block = max(blocks, default=-1) + 1
    if not 1 <= num_block <= MAX_BLOCKS:
        raise ModelLoadError(
            f"{label} has {num_block} RRDB blocks; 1..{MAX_BLOCKS} load", role=ROLE
        )
    expected = rrdbnet_specs(num_block, scale)
    mapping = esrgan_names(num_block, scale) if layout == "esrgan" else {}
    for name, shape in expected.items():
        stored = mapping.get(name, name)
        info = header.tensors.get(stored)
        if info is None:
            raise ModelLoadError(
                f"{label} lacks tensor {stored!r}, which the runtime's x{scale} RRDBNet of "
                f"{num_block} blocks loads",
                role=ROLE,
            )
        if tuple(info.shape) != shape:
            raise ModelLoadError(
                f"{label} has tensor {stored!r} of shape {list(info.shape)}; the runtime builds "
                f"{list(shape)} (its widths are fixed: {NUM_FEAT} features, {NUM_GROW_CH} growth "
                f"channels, {CHANNELS} colour channels)",
                role=ROLE,
            )
    params = sum(_count(s) for s in expected.values())
    return Architecture(layout, num_block, scale, params)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class UpscalerFile:
    """A checked upscaler file: its name, absolute path, size in bytes and architecture."""

    name: str
    path: Path
    size: int
    arch: Architecture

    @property
    def scale(self) -> int:
        return self.arch.scale

    def as_json(self) -> dict[str, Any]:
        """What a heartbeat and `sdfarm models` say of it (no path)."""
        return {"bytes": self.size, "scale": self.arch.scale, "num_block": self.arch.num_block}


def check_upscaler(name: str, path: Path) -> UpscalerFile:
    """Read and check an upscaler file's header (never its tensor data)."""
    header = validate_header(path, ROLE)
    return UpscalerFile(name, path, header.file_size, architecture(header, f"upscaler {name!r}"))


def upscaler_dirs(
    models_dirs: Iterable[str | os.PathLike[str]], given: Iterable[str] = ()
) -> list[Path]:
    """The upscaler folders: each models directory's `upscalers/`, then those given (else
    $SDFARM_UPSCALERS, os.pathsep-separated)."""
    return asset_dirs(models_dirs, UPSCALERS_FOLDER, given, "SDFARM_UPSCALERS")


class UpscalerCatalog(FileCatalog[UpscalerFile]):
    """The upscalers found in a list of folders; headers are read once per file version."""

    kind = "upscaler"

    def check(self, name: str, path: Path) -> UpscalerFile:
        return check_upscaler(name, path)
