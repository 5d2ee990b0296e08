"""cuDNN for the CUDA runtime's convolutions (off unless the operator names one).

On CUDA, stable-diffusion.cpp convolves through im2col + GEMM: a 3x3 convolution first writes
its input nine times over, which was most of a 1024x1024 VAE decode on the H200 (docs/gpu.md,
"Where an image's GPU time goes"). Our CUDA build (native/patches/conv2d_cudnn.cuh) can run the
runtime's direct convolutions through cuDNN instead, as PyTorch does, opening the library at
run time; cuDNN is not a build dependency and not ours to ship.

It is off unless `SDFARM_CUDNN` names a libcudnn.so.9 file, or says `auto`: the first found
of this Python's cuDNN wheel (`pip install nvidia-cudnn-cu13`) and the system's. On the H200
(cuDNN 9.19 of PyTorch 2.11) it made a 1024x1024 image of the SD-Turbo-class model 13-29%
faster than im2col and its GPU peak 7.8 GiB against 10, with pixels within 3/255 of im2col's
(PSNR 53 dB): docs/gpu.md, "Convolutions through cuDNN". Since the pixels move, it stays the
operator's choice: a farm mixing workers with and without it would give two images for one
seed. Where it is named, an engine on a CUDA device asks for direct convolution
(native/estimate.py `use_conv_direct`) and counts cuDNN's memory instead of im2col's buffer,
and `export` tells the runtime the same answer, so the runtime never opens a library the
estimate did not count on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from pathlib import Path

ENV = "SDFARM_CUDNN"
AUTO = "auto"
LIBRARY = "libcudnn.so.9"
SYSTEM_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/local/cuda/lib64",
)


def search_dirs(paths: Iterable[str] | None = None) -> list[Path]:
    """Where `SDFARM_CUDNN=auto` looks for LIBRARY, in order: the cuDNN wheel of this
    Python (`pip install nvidia-cudnn-cu13` puts it in nvidia/cudnn/lib of a `paths` folder,
    default sys.path, as PyTorch's does), then the system's library folders (NVIDIA's
    packages)."""
    folders = sys.path if paths is None else paths
    wheels = [Path(p) / "nvidia" / "cudnn" / "lib" for p in folders if p]
    return [*wheels, *map(Path, SYSTEM_DIRS)]


def find(
    env: Mapping[str, str],
    is_file: Callable[[Path], bool] = Path.is_file,
    dirs: Iterable[Path] | None = None,
) -> Path | None:
    """The cuDNN library `ENV` names, if it is a file; with `auto`, the first LIBRARY in
    `dirs` (default `search_dirs()`); None when unset, 0, not a file or not found."""
    named = env.get(ENV, "").strip()
    if not named or named == "0":
        return None
    if named == AUTO:
        found = (d / LIBRARY for d in (search_dirs() if dirs is None else dirs))
        return next((f for f in found if is_file(f)), None)
    path = Path(named)
    return path if is_file(path) else None


def library(env: Mapping[str, str] | None = None) -> Path | None:
    """This process's cuDNN (`find` over `env`, default its environment), or None."""
    return find(os.environ if env is None else env)


def export(env: MutableMapping[str, str] | None = None) -> Path | None:
    """Name the library `library` found to the runtime of this process (`ENV` set to its
    path, or to 0 when there is none, so that a name that is not a file, or `auto` that
    found none, opens nothing) and return it. An engine calls this before its runtime's
    first CUDA graph, so the runtime's choice is the estimate's."""
    env = os.environ if env is None else env
    lib = library(env)
    env[ENV] = str(lib) if lib is not None else "0"
    return lib


# What the CUDA build needs to compile attention through cuDNN (native/patches/fattn_cudnn.cuh):
# cuDNN's headers (the cuDNN wheel: nvidia/cudnn/include), its C++ frontend's (the
# nvidia-cudnn-frontend wheel installs include/cudnn_frontend.h), and NVRTC's header, which
# the frontend includes (the CUDA toolkit's, or the nvrtc wheel's). `pip install
# 'sdfarm[cudnn]'` brings all three; without them the build leaves attention to ggml.
SDPA_HEADERS = (
    ("cudnn_frontend.h", ("include",)),
    ("cudnn.h", ("nvidia/cudnn/include",)),
    ("nvrtc.h", ("nvidia/cu13/include", "nvidia/cuda_nvrtc/include", "nvidia/cu12/include")),
)


def sdpa_include_dirs(
    paths: Iterable[str] | None = None,
    toolkit_include: Path | None = None,
    is_file: Callable[[Path], bool] = Path.is_file,
) -> list[Path] | None:
    """The folders holding SDPA_HEADERS, one per header, searched in `paths` (default
    sys.path) and, first, the CUDA toolkit's `toolkit_include`; None when one is missing."""
    folders = [p for p in (sys.path if paths is None else paths) if p]
    found: list[Path] = []
    for header, subdirs in SDPA_HEADERS:
        candidates = [toolkit_include] if toolkit_include is not None else []
        candidates += [Path(p) / sub for p in folders for sub in subdirs]
        hit = next((d for d in candidates if is_file(d / header)), None)
        if hit is None:
            return None
        if hit not in found:
            found.append(hit)
    return found
