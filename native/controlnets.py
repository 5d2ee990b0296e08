"""ControlNet files: where they live, how a name resolves, the check of a file before the
runtime loads it, and what a loaded one holds.

A ControlNet is one file (.safetensors or .gguf) named after its stem, in a `controlnets/`
folder inside a models directory (a reserved name: not a model) or in a folder given with
`--controlnet-dir` or `$SDFARM_CONTROLNETS`; a name resolves as every named file's does
(sdfarm.native.filecatalog).

What the runtime does with one (src/control.hpp and stable-diffusion.cpp of master-596): the
file's path is a context parameter (`control_net_path`), so a ControlNet is part of an engine,
not of a job: an engine with another ControlNet is another engine (sdfarm.native.enginekey).
It builds the SD 1.x/2.x/XL ControlNet of the model's own version (the encoder half of that
UNet with `input_hint_block.*`, `zero_convs.N.0` and `middle_block_out.0`), and adds its 13
outputs to the UNet's skips: only the full UNets of SD 1.x, 2.x and XL take it (the tiny UNet
and SDXS have other skips; DiT models have none), and its cross-attention width must be the
model's text width (768, 1024, 2048). Its weights are not in the model's tensor map, so the
runtime gives every linear weight f32 and every convolution f16 in memory whatever the file
holds: a quantised file takes several times its size once loaded, which `resident_bytes`
counts (the estimate's term for it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sdfarm.native.catalog import CONTROLNETS_FOLDER
from sdfarm.native.errors import ModelLoadError
from sdfarm.native.filecatalog import FileCatalog, asset_dirs
from sdfarm.native.headers import FileHeader, validate_header

ROLE = "control_net"
ARCH_CONTEXT = {"sd1": 768, "sd2": 1024, "sdxl": 2048}
"""The UNet architectures (sdfarm.native.roles.guess_architecture) a ControlNet applies to,
with the cross-attention width each one's ControlNet must have."""
CONTROL_HEADS = 8
"""The attention heads of a ControlNet's first attention layers as the estimate counts them:
SD 1.x's 8 at 1/8 of each side (SD 2.x has 5 there, SDXL 10 at 1/16 of each side, a quarter of
SD 1.x's bytes), so 8 covers the three (`ModelFacts.control_working`)."""
MARKS = ("input_hint_block.0.weight", "zero_convs.0.0.weight", "middle_block_out.0.weight")
_PREFIX = re.compile(r"^(?:control_model\.)")  # the runtime strips it (name_conversion.cpp)
_ATTN_K = re.compile(r"attn2\.to_k\.weight$")


@dataclass(frozen=True)
class ControlNetFile:
    """A checked ControlNet file: name, absolute path, size in bytes, the bytes the runtime
    holds once it is loaded, and its cross-attention width (768: SD 1.x)."""

    name: str
    path: Path
    size: int
    resident_bytes: int
    context_dim: int

    def as_json(self) -> dict[str, int]:
        """What a heartbeat says of it (no path)."""
        return {"bytes": self.size, "resident": self.resident_bytes, "context": self.context_dim}


def resident_bytes(header: FileHeader) -> int:
    """What the runtime allocates for a ControlNet's weights: convolutions (4-D) f16, every
    other tensor f32 (its linear layers find no type in the model's tensor map)."""
    total = 0
    for info in header.tensors.values():
        n = 1
        for d in info.shape:
            n *= d
        total += n * (2 if len(info.shape) == 4 else 4)
    return total


def check_controlnet(name: str, path: Path) -> ControlNetFile:
    """Read and check a ControlNet file's header (never its tensor data)."""
    header = validate_header(path, ROLE)
    names = {_PREFIX.sub("", n) for n in header.tensors}
    missing = [m for m in MARKS if m not in names]
    if missing:
        shown = ", ".join(sorted(names)[:3]) or "no tensors"
        raise ModelLoadError(
            f"control_net file {path.name}: its tensors are not a ControlNet's ({shown}); the "
            f"runtime loads SD 1.x/2.x/XL ControlNets (input_hint_block.*, zero_convs.*, "
            f"middle_block_out.*), this one lacks {missing[0]}",
            role=ROLE,
        )
    widths = {
        info.shape[-1] for n, info in header.tensors.items() if _ATTN_K.search(n) and info.shape
    }
    if len(widths) != 1 or next(iter(widths)) not in ARCH_CONTEXT.values():
        raise ModelLoadError(
            f"control_net file {path.name}: its cross-attention width is "
            f"{sorted(widths) or 'missing'}; SD 1.x, 2.x and XL ControlNets have 768, 1024 or "
            "2048",
            role=ROLE,
        )
    return ControlNetFile(name, path, header.file_size, resident_bytes(header), widths.pop())


def unet_refusal(header: FileHeader, arch: str) -> str | None:
    """Why the runtime cannot apply a ControlNet to the diffusion model of `header` (of
    architecture `arch`, sdfarm.native.roles.guess_architecture), or None when it can. The
    runtime builds the full SD 1.x/2.x/XL ControlNet whatever the UNet is and adds its outputs
    to the UNet's skips: the tiny UNet and SDXS (one res block a level, three levels, no
    middle block) get 13 outputs for 6 skips, 1280 channels onto 640, and ggml aborts the
    process (measured by bench/controlnet_tiny_unet.py: the tiny UNet generates alone, and
    with the SD 1.x ControlNet dies of `GGML_ASSERT(ggml_can_repeat(b, a))`, SIGABRT); the
    UNets without a middle attention block (SSD-1B, Vega) have other skips too."""
    if arch not in ARCH_CONTEXT:
        return (
            f"its architecture is {arch}: the runtime applies ControlNet to SD 1.x, 2.x and XL "
            "UNets only"
        )
    if not any(".middle_block.1." in f".{n}" for n in header.tensors):
        return (
            "its UNet has no middle attention block (a tiny UNet, SDXS, SSD-1B or Vega): the "
            "runtime's ControlNet is the full UNet's, whose outputs do not fit its skips (the "
            "process would abort)"
        )
    return None


def controlnet_dirs(
    models_dirs: Iterable[str | os.PathLike[str]], given: Iterable[str] = ()
) -> list[Path]:
    """The ControlNet folders: each models directory's `controlnets/`, then those given (else
    $SDFARM_CONTROLNETS, os.pathsep-separated)."""
    return asset_dirs(models_dirs, CONTROLNETS_FOLDER, given, "SDFARM_CONTROLNETS")


class ControlNetCatalog(FileCatalog[ControlNetFile]):
    """The ControlNets found in a list of folders; headers are read once per file version."""

    kind = "ControlNet"

    def check(self, name: str, path: Path) -> ControlNetFile:
        return check_controlnet(name, path)
