"""What `sdfarm convert` needs, memory and disk, judged from the headers before it starts.

The runtime's `convert` (src/convert.cpp of master-596) allocates one ggml context for every
tensor of a file in its output type, loads and converts all of them into it, then writes the
file: a file's whole result is in memory at once, plus the converting thread's buffers for
one tensor at a time. The child converts a model's files one after another, freeing each
context, so its peak is that of its largest result. The rule, from the source and
bench/convert_memory.py (bench/results/convert_memory.json):

    need = max over converted files of (output bytes + the threads' buffers) + CONVERT_BASE

where a file's output bytes are each tensor's bytes in the type it gets, by the runtime's own
rule of which tensors it converts (biases, embeddings and rows that are not whole blocks stay
as they are; `converted`), computed from the file's header, and the buffers are
`working_bytes` (the loader runs a thread per physical core). Measured on 2 cores: the SD 1.x
test checkpoint (1.46 GB, q4_0) to q8_0, f16 and q4_k peaked at 1.84, 2.17 and 1.66 GB RSS,
0.97 to 0.98 of the need; the tiny model at 0.46 to 0.50 of it (its small tensors leave the
base term most of the need). The output bytes came within 0.1% of the files written.
The host must hold `need` in MemAvailable (the child dies by the OOM killer otherwise, having
written nothing), and the output folder's disk the sum of every file's output bytes plus the
copied files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sdfarm.native.headers import GGML_TYPES, FileHeader
from sdfarm.native.memory import MiB, format_bytes

CONVERT_BASE = 128 * MiB
"""The child's memory beside a file's result and its threads' buffers: Python, the runtime's
code, the CPU backend. The tiny model, whose converted tensors are small, peaked 49 to 87 MiB
over its output's bytes; 128 MiB leaves the SD 1.x checkpoint's peaks 2% under the need
(bench/results/convert_memory.json)."""
HEADER_MARGIN = 1 * MiB
"""Disk for each new file's GGUF header (names, shapes, offsets, alignment): measured 4.4 KB
for the tiny model's files (bench/results/convert_memory.json: need_disk against
written_bytes), 1 MiB is room for a large model's thousands of tensor names."""
_BLOCKS = {name.lower(): (block, size) for name, block, size in GGML_TYPES.values()}


def tensor_bytes(shape: tuple[int, ...], type_name: str) -> int:
    """The bytes of a tensor of `shape` in ggml type `type_name` (rows in whole blocks)."""
    block, size = _BLOCKS[type_name.lower()]
    elements = 1
    for dim in shape:
        elements *= int(dim)
    return -(-elements // block) * size


_KEPT_PARTS = ("img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.",
               "x_embedder.", "t_embedder.", "y_embedder.", "pos_embed", "context_embedder.",
               "time_embed.", "label_emb.", "embedding")  # fmt: skip
"""Name parts of tensors the runtime never converts (ModelLoader::tensor_should_be_converted:
Flux's and MMDiT's input and output layers, a UNet's time and label embeddings, embeddings)."""


def converted(name: str, shape: tuple[int, ...], type_name: str) -> bool:
    """Whether the runtime converts tensor `name` of `shape` to `type_name`, by its own rule:
    not a bias or scale, none of _KEPT_PARTS, and for a block type rows (the last dimension)
    of whole blocks."""
    block = _BLOCKS[type_name.lower()][0]
    if block > 1 and (not shape or int(shape[-1]) % block):
        return False
    return not name.endswith((".bias", ".scale")) and not any(k in name for k in _KEPT_PARTS)


def output_bytes(header: FileHeader, type_name: str, rules: Iterable[tuple[str, str]] = ()) -> int:
    """The size of a file converted to `type_name` with tensor `rules` ((pattern, type)
    pairs, the first match wins, as the runtime's): each tensor in the type it gets, or as it
    is where the runtime leaves it."""
    compiled = [(re.compile(p), t) for p, t in rules]
    total = 0
    for name, info in header.tensors.items():
        target = next((t for p, t in compiled if p.search(name)), type_name)
        if converted(name, info.shape, target):
            total += tensor_bytes(info.shape, target)
        else:
            total += int(info.nbytes)
    return total


def working_bytes(
    header: FileHeader, type_name: str, rules: Iterable[tuple[str, str]] = (), threads: int = 1
) -> int:
    """The loader threads' buffers while a file converts: each thread keeps a read buffer of
    the largest tensor it converted (in its source type) and converts through an f32 copy, so
    at most the `threads` largest converted tensors' source and f32 bytes at once. Tensors
    that keep their type are read straight into the result."""
    compiled = [(re.compile(p), t) for p, t in rules]
    sizes = []
    for name, info in header.tensors.items():
        target = next((t for p, t in compiled if p.search(name)), type_name)
        if info.dtype.lower() != target.lower() and converted(name, info.shape, target):
            elements = 1
            for dim in info.shape:
                elements *= int(dim)
            sizes.append(int(info.nbytes) + 4 * elements)
    return sum(sorted(sizes, reverse=True)[: max(1, threads)])


def loader_threads() -> int:
    """The threads the runtime's loader uses when not told: the physical cores."""
    import psutil

    return int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)


@dataclass(frozen=True)
class ConvertNeed:
    """What a conversion needs: memory (the largest file's result and the overhead) and disk
    (every new file)."""

    memory: int
    disk: int


def refusal(need: ConvertNeed, available_memory: int | None, free_disk: int | None) -> str | None:
    """Why the conversion cannot run on this host (None: it can): `available_memory` is the
    host's MemAvailable, `free_disk` the free bytes of the output folder's disk (None: not
    known, not checked)."""
    if available_memory is not None and need.memory > available_memory:
        return (
            f"converting needs about {format_bytes(need.memory)} of memory (the runtime holds "
            f"a whole file's result in memory before it writes it) and this host has "
            f"{format_bytes(available_memory)} available; free memory or convert on a larger "
            "host"
        )
    if free_disk is not None and need.disk > free_disk:
        return (
            f"the new model needs about {format_bytes(need.disk)} of disk and the models "
            f"folder's disk has {format_bytes(free_disk)} free"
        )
    return None


MemoryProbe = Callable[[], int | None]
"""Returns the host's available memory in bytes (MemAvailable), None when unknown."""
DiskProbe = Callable[[str], int | None]
"""Returns the free bytes of the disk holding a folder, None when unknown."""


def host_available_memory() -> int | None:
    """MemAvailable (psutil's `available`, the same figure the engine's memory check reads)."""
    import psutil

    return int(psutil.virtual_memory().available)


def disk_free(folder: str) -> int | None:
    """The free bytes of the disk holding `folder`."""
    import shutil

    try:
        return int(shutil.disk_usage(folder).free)
    except OSError:
        return None
