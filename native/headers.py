"""Model file headers: reading and validating safetensors and GGUF headers.

We read only a model file's header, never its tensor data, because:

- the runtime (master-596) does not abort on a bad model file, it returns NULL with an ERROR
  record that names the file's full path; we want an error a user can act on, naming the role
  and the file's name only (full paths leak into records that leave the machine);
- the role of a file can be told from its tensor names (`roles.py`), and the memory rules
  (`memory.py`) and the fit plan (`fitplan.py`) need file sizes split by component: the header
  gives both without reading gigabytes.

Every read is bounded by the file's size: a garbage header that claims a 1 TB JSON header or
10^12 tensors fails at once with a clear message instead of allocating.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from .errors import ModelLoadError

# The safetensors library refuses headers above 100 MB; nothing real comes close.
SAFETENSORS_MAX_HEADER = 100_000_000
# Bits per element of every dtype the safetensors format defines.
SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
# What master-596's safetensors loader accepts (src/model_io/safetensors_io.cpp); it skips U8
# tensors and fails on everything else with "unsupported dtype".
RUNTIME_SAFETENSORS_DTYPES = frozenset(
    {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I32", "I64", "U8"}
)
# The runtime's safetensors loader takes at most 5 dimensions (SD_MAX_DIMS), ggml's GGUF 4.
SAFETENSORS_MAX_DIMS = 5
GGUF_MAX_DIMS = 4

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
# ggml 0.9.8 (the runtime's): type id -> (name, elements per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
}

# GGUF metadata value types: id -> (struct format, size) for the fixed-size ones.
_GGUF_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_GGUF_STRING = 8
_GGUF_ARRAY = 9
_GGUF_UINT32 = 4
_GGUF_MAX_NESTING = 4
# The least bytes one GGUF key/value pair and one tensor info can take: bounds the counts.
_GGUF_MIN_KV_BYTES = 8 + 4 + 1
_GGUF_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


class TensorInfo(NamedTuple):
    """One tensor as its header describes it. `shape` is in PyTorch (row-major) order for both
    formats, so a GGUF's ggml dims come back reversed and equal the safetensors shape."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileHeader:
    """What a model file's header says, read without touching its tensor data.

    `format` is "safetensors" or "gguf"; `data_start` is the offset of the tensor data,
    `data_bytes` how many bytes of it the tensors reach (the end of the last one);
    `metadata` is the safetensors `__metadata__` or the GGUF key/value pairs.
    """

    format: str
    tensors: dict[str, TensorInfo]
    data_start: int
    data_bytes: int
    file_size: int
    metadata: dict[str, Any] = field(default_factory=dict)


class HeaderError(ValueError):
    """A header could not be read. `tail` completes "<role> file <name> ..." so the caller
    can name the role; `kind` is one of missing, empty, unreadable, not_model, corrupt,
    truncated, dtype."""

    def __init__(self, kind: str, tail: str) -> None:
        super().__init__(tail)
        self.kind = kind
        self.tail = tail


# ---------------------------------------------------------------------------------------------
# Header readers


class _Reader:
    """Reads a binary header sequentially and refuses any read past the end of the file, so
    a lying length never turns into an allocation."""

    def __init__(self, f: BinaryIO, size: int, fmt: str, pos: int = 0) -> None:
        self.f = f
        self.size = size
        self.fmt = fmt
        self.pos = pos

    def remaining(self) -> int:
        return self.size - self.pos

    def corrupt(self, detail: str) -> HeaderError:
        return HeaderError("corrupt", f"has a corrupt {self.fmt} header: {detail}")

    def read(self, n: int, what: str) -> bytes:
        if n > self.remaining():
            raise self.corrupt(
                f"{what} needs {n:,} bytes at offset {self.pos:,}, "
                f"the file has {self.remaining():,} left"
            )
        data = self.f.read(n)
        if len(data) != n:
            raise self.corrupt(f"{what}: short read at offset {self.pos:,}")
        self.pos += n
        return data

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        return struct.unpack(fmt, self.read(size, what))[0]

    def u32(self, what: str) -> int:
        return int(self.unpack("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.unpack("<Q", 8, what))

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        return self.read(n, what).decode("utf-8", errors="replace")


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read a safetensors or GGUF header. Raises HeaderError (role-less) on any problem found
    while parsing; truncation and dtypes the runtime cannot load are left to
    `validate_header`, which also names the role."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise HeaderError("empty", "is empty (0 bytes)")
            head = f.read(16)
            f.seek(0)
            if head[:4] == GGUF_MAGIC:
                return _read_gguf(f, size)
            if len(head) >= 9 and head[8:9] == b"{":
                return _read_safetensors(f, size)
            raise HeaderError("not_model", _not_model_tail(head))
    except FileNotFoundError:
        raise HeaderError("missing", "does not exist") from None
    except IsADirectoryError:
        raise HeaderError("unreadable", "is a folder, not a file") from None
    except PermissionError:
        raise HeaderError("unreadable", "cannot be read: permission denied") from None
    except OSError as exc:  # the message of an OSError carries the path: keep only strerror
        raise HeaderError("unreadable", f"cannot be read: {exc.strerror or 'I/O error'}") from None


def _not_model_tail(head: bytes) -> str:
    shown = head[:8].hex(" ")
    hint = ""
    if head.startswith(b"PK\x03\x04"):
        hint = " (it is a zip archive, perhaps a PyTorch .ckpt: convert it to safetensors)"
    elif head[:1] == b"\x80":
        hint = " (it looks like a Python pickle: convert it to safetensors)"
    elif head[:4] == b"FUGG":
        hint = " (a GGUF magic in the wrong byte order)"
    return (
        f"is not a model file: its first bytes ({shown}) do not look like safetensors or GGUF{hint}"
    )


def _read_safetensors(f: BinaryIO, size: int) -> FileHeader:
    r = _Reader(f, size, "safetensors")
    n = r.u64("header length")
    if n > SAFETENSORS_MAX_HEADER:
        raise r.corrupt(
            f"the header claims {n:,} bytes, more than the {SAFETENSORS_MAX_HEADER:,} "
            "a safetensors header may have"
        )
    if n > r.remaining():
        raise r.corrupt(
            f"the header claims {n:,} bytes, the file has only {r.remaining():,} "
            "after the length field"
        )
    raw = r.read(n, "JSON header")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise r.corrupt(f"the JSON header is not UTF-8 (byte {exc.start:,})") from None
    except json.JSONDecodeError as exc:
        raise r.corrupt(f"invalid JSON ({exc.msg} at byte {exc.pos:,})") from None
    if not isinstance(doc, dict):
        raise r.corrupt("the JSON header is not an object")

    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise r.corrupt("__metadata__ is not an object")
    tensors: dict[str, TensorInfo] = {}
    data_bytes = 0
    for name, entry in doc.items():
        tensors[name] = _safetensors_entry(r, name, entry)
        data_bytes = max(data_bytes, entry["data_offsets"][1])
    return FileHeader("safetensors", tensors, 8 + n, data_bytes, size, dict(metadata))


def _safetensors_entry(r: _Reader, name: str, entry: Any) -> TensorInfo:
    if not isinstance(entry, dict):
        raise r.corrupt(f"tensor {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise r.corrupt(f"tensor {name!r} has no dtype")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise r.corrupt(f"tensor {name!r} has a bad shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise r.corrupt(f"tensor {name!r} has bad data_offsets {offsets!r}")
    span = offsets[1] - offsets[0]
    bits = SAFETENSORS_DTYPE_BITS.get(dtype)
    if bits is not None:
        need_bits = _prod(shape) * bits
        if need_bits % 8 or need_bits // 8 != span:
            raise r.corrupt(
                f"tensor {name!r} of shape {shape} and dtype {dtype} needs "
                f"{need_bits / 8:,.0f} bytes, its data_offsets span {span:,}"
            )
    return TensorInfo(dtype, tuple(shape), span)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63


def _prod(xs: Iterable[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _read_gguf(f: BinaryIO, size: int) -> FileHeader:
    r = _Reader(f, size, "GGUF")
    r.read(4, "magic")
    version = r.u32("version")
    if version & 0xFFFF == 0:
        raise r.corrupt(f"version {version:#x}: a big-endian GGUF, which this host cannot load")
    if version not in (2, 3):
        raise r.corrupt(f"GGUF version {version} is not supported (versions 2 and 3 are)")
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("key/value count")
    if n_tensors * _GGUF_MIN_TENSOR_INFO_BYTES > r.remaining():
        raise r.corrupt(
            f"it claims {n_tensors:,} tensors, the {r.remaining():,} bytes left in the file "
            f"hold at most {r.remaining() // _GGUF_MIN_TENSOR_INFO_BYTES:,} tensor infos"
        )
    if n_kv * _GGUF_MIN_KV_BYTES > r.remaining():
        raise r.corrupt(
            f"it claims {n_kv:,} key/value pairs, the {r.remaining():,} bytes left in the file "
            f"hold at most {r.remaining() // _GGUF_MIN_KV_BYTES:,}"
        )

    metadata: dict[str, Any] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = r.string(f"key {i}")
        if key in metadata:
            raise r.corrupt(f"duplicate key {key!r}")
        vtype = r.u32(f"type of {key!r}")
        metadata[key] = _gguf_value(r, vtype, key, 0)
        if key == "general.alignment":
            # ggml reads it with gguf_get_val_u32, which aborts the process on another type.
            value = metadata[key]
            if vtype != _GGUF_UINT32 or value == 0 or value & (value - 1):
                raise r.corrupt(
                    f"general.alignment must be a power of two stored as uint32, got {value!r}"
                )
            alignment = value

    tensors: dict[str, TensorInfo] = {}
    data_bytes = 0
    for i in range(n_tensors):
        name = r.string(f"name of tensor {i}")
        if name in tensors:
            raise r.corrupt(f"duplicate tensor name {name!r}")
        n_dims = r.u32(f"dimension count of {name!r}")
        if n_dims > GGUF_MAX_DIMS:
            raise r.corrupt(f"tensor {name!r} has {n_dims} dimensions, ggml allows {GGUF_MAX_DIMS}")
        dims = [r.u64(f"dimensions of {name!r}") for _ in range(n_dims)]
        if any(d >= 2**63 for d in dims) or _prod(dims) >= 2**63:
            raise r.corrupt(f"tensor {name!r} has impossible dimensions {dims}")
        type_id = r.u32(f"type of {name!r}")
        offset = r.u64(f"offset of {name!r}")
        if type_id not in GGML_TYPES:
            raise HeaderError("dtype", f"has tensor {name!r} with unknown ggml type {type_id}")
        type_name, block, type_size = GGML_TYPES[type_id]
        row = dims[0] if dims else 1
        if row % block:
            raise r.corrupt(
                f"tensor {name!r} of type {type_name} has rows of {row} elements, "
                f"not a multiple of its block of {block}"
            )
        nbytes = _prod(dims) // block * type_size
        tensors[name] = TensorInfo(type_name, tuple(reversed(dims)), nbytes)
        data_bytes = max(data_bytes, offset + nbytes)
    data_start = _pad(r.pos, alignment)
    return FileHeader("gguf", tensors, data_start, data_bytes, size, metadata)


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _gguf_value(r: _Reader, vtype: int, key: str, depth: int) -> Any:
    if vtype in _GGUF_SCALARS:
        fmt, size = _GGUF_SCALARS[vtype]
        return r.unpack(fmt, size, f"value of {key!r}")
    if vtype == _GGUF_STRING:
        return r.string(f"value of {key!r}")
    if vtype == _GGUF_ARRAY and depth < _GGUF_MAX_NESTING:
        etype = r.u32(f"element type of {key!r}")
        count = r.u64(f"element count of {key!r}")
        if etype in _GGUF_SCALARS:
            fmt, size = _GGUF_SCALARS[etype]
            raw = r.read(count * size, f"array {key!r} of {count:,} elements")
            return [v[0] for v in struct.iter_unpack(fmt, raw)]
        least = 8 if etype == _GGUF_STRING else 12  # a string's length / a nested array's header
        if count * least > r.remaining():
            raise r.corrupt(
                f"array {key!r} claims {count:,} elements, the file has {r.remaining():,} "
                "bytes left"
            )
        return [_gguf_value(r, etype, key, depth + 1) for _ in range(count)]
    raise r.corrupt(f"key {key!r} has unknown value type {vtype}")


def validate_header(path: str | os.PathLike[str], role: str | None = None) -> FileHeader:
    """Read and check a model file's header; raise ModelLoadError for anything the runtime
    would reject (it only logs an error and returns NULL), with a message that begins with
    the role (or "model" when unknown yet) and the file's name, never its full path."""
    p = Path(path)
    label = f"{role or 'model'} file {p.name}"
    try:
        header = read_header(p)
    except HeaderError as exc:
        raise ModelLoadError(f"{label} {exc.tail}", role=role) from None
    have = max(0, header.file_size - header.data_start)
    if header.data_bytes > have:
        raise ModelLoadError(
            f"{label} is truncated: tensor data needs {header.data_bytes:,} bytes after the "
            f"header, the file has {have:,}",
            role=role,
        )
    if header.format == "safetensors":
        for name, info in header.tensors.items():
            if info.dtype not in SAFETENSORS_DTYPE_BITS:
                raise ModelLoadError(
                    f"{label} has tensor {name!r} with unknown dtype {info.dtype!r}", role=role
                )
            if info.dtype not in RUNTIME_SAFETENSORS_DTYPES:
                loads = ", ".join(sorted(RUNTIME_SAFETENSORS_DTYPES - {"U8"}))
                raise ModelLoadError(
                    f"{label} has tensor {name!r} with dtype {info.dtype}, which the runtime "
                    f"cannot load (it loads {loads})",
                    role=role,
                )
            if len(info.shape) > SAFETENSORS_MAX_DIMS:
                raise ModelLoadError(
                    f"{label} has tensor {name!r} with {len(info.shape)} dimensions, the "
                    f"runtime loads at most {SAFETENSORS_MAX_DIMS}",
                    role=role,
                )
    return header
