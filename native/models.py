"""Model files, their roles and their headers.

A model is a set of files, each in one role that the runtime loads through its own context
parameter (`ROLE_PARAMS`). We read only the files' headers, never their tensor data, because:

- the runtime (master-596) does not abort on a bad model file, it returns NULL with an ERROR
  record that names the file's full path; we want an error a user can act on, naming the role
  and the file's name only (full paths leak into records that leave the machine);
- the role of a file can be told from its tensor names, so a model folder needs no manifest
  and a file in the wrong role is caught before the runtime silently loads nonsense;
- the memory rules (`memory.py`) and the fit plan (`fitplan.py`) need file sizes split by
  component, which the header gives without reading gigabytes.

Every read is bounded by the file's size: a garbage header that claims a 1 TB JSON header or
10^12 tensors fails at once with a clear message instead of allocating.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO, NamedTuple

from .errors import ModelLoadError

# The roles, in the order the runtime loads them, and the sd_ctx_params_t field of each.
ROLE_PARAMS: dict[str, str] = {
    "checkpoint": "model_path",
    "diffusion_model": "diffusion_model_path",
    "clip_l": "clip_l_path",
    "clip_g": "clip_g_path",
    "t5xxl": "t5xxl_path",
    "llm": "llm_path",
    "vae": "vae_path",
    "taesd": "taesd_path",
}
ROLES: tuple[str, ...] = tuple(ROLE_PARAMS)

# Which part of the pipeline each role feeds (the fit plan places these three separately).
ROLE_COMPONENTS: dict[str, str] = {
    "diffusion_model": "diffusion",
    "clip_l": "text_encoders",
    "clip_g": "text_encoders",
    "t5xxl": "text_encoders",
    "llm": "text_encoders",
    "vae": "vae",
    "taesd": "vae",
}
COMPONENTS: tuple[str, ...] = ("diffusion", "text_encoders", "vae")

MODEL_SUFFIXES: tuple[str, ...] = (".safetensors", ".gguf")
MANIFEST_NAME = "model.json"
DEFAULT_NATIVE_SIZE: tuple[int, int] = (512, 512)

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


# ---------------------------------------------------------------------------------------------
# Roles from tensor names

# The prefixes sd.cpp adds per role (or that checkpoints carry); stripped before matching.
_PREFIX_RE = re.compile(
    r"^(?:model\.diffusion_model\.|unet\.|first_stage_model\.|vae\.|tae\."
    r"|cond_stage_model\.(?:\d+\.)?(?:transformer\.)?"
    r"|conditioner\.embedders\.\d+\.(?:transformer\.)?"
    r"|text_encoders\.[^.]+\.(?:transformer\.)?|te\.\d*\.?)"
)
# Which component a checkpoint's prefix marks.
_COMPONENT_PREFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("diffusion", ("model.diffusion_model.", "unet.")),
    ("vae", ("first_stage_model.", "vae.", "tae.")),
    ("text_encoders", ("cond_stage_model.", "conditioner.embedders.", "text_encoders.", "te.")),
)
_BLOCKS_RE = re.compile(
    r"^(double_blocks|single_blocks|input_blocks|middle_block|output_blocks|joint_blocks)\."
)
_ANY_BLOCK_RE = re.compile(
    r"(?:^|\.)(transformer_blocks|layers|blocks|down_blocks|up_blocks)\.\d+\."
)
_DIT_HINTS = (
    "adaLN",
    "img_mod.",
    "t_embedder.",
    "x_embedder.",
    "cap_embedder.",
    "time_text_embed.",
    "patch_embedding.",
    "time_embedding.",
)
_VAE_PREFIXES = (
    "decoder.conv_in",
    "decoder.up.",
    "decoder.up_blocks.",
    "decoder.mid.",
    "decoder.mid_block.",
    "decoder.upsamples.",
    "encoder.conv_in",
    "encoder.down.",
    "encoder.down_blocks.",
    "encoder.downsamples.",
    "post_quant_conv.",
    "quant_conv.",
)
_TAESD_RE = re.compile(r"^(?:decoder|encoder)\.layers\.\d+\.")
_LLM_RE = re.compile(r"^(.*?layers\.)\d+(\.self_attn)\.")
_LLAMA_CPP_LLM_RE = re.compile(r"^blk\.\d+\.attn_")
_T5_RE = re.compile(r"^(.*?encoder\.block\.)\d+(\.layer)\.")
_LLAMA_CPP_T5_RE = re.compile(r"^enc\.blk\.\d+\.")
_CLIP_RE = re.compile(r"(?:^|\.)text_model\.encoder\.layers\.\d+\.")
_OPENCLIP_RE = re.compile(r"(?:^|\.)transformer\.resblocks\.\d+\.")
CLIP_G_HIDDEN = 1280


def _strip(name: str) -> str:
    return _PREFIX_RE.sub("", name, count=1)


def _glob(pattern: str) -> str:
    """A tensor name as evidence: layer numbers replaced by '*'."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", pattern)


def _diffusion_evidence(names: list[str]) -> str | None:
    found = sorted({m.group(1) for n in names if (m := _BLOCKS_RE.match(n))})
    if found:
        return ", ".join(f"{b}.*" for b in found)
    blocks = [n for n in names if _ANY_BLOCK_RE.search(n)]
    for hint in _DIT_HINTS:
        hinted = [n for n in names if hint in n]
        if hinted and blocks:
            return f"{_glob(hinted[0])}, {_glob(blocks[0])}"
    return None


def _vae_evidence(names: list[str]) -> str | None:
    found = [n for n in names if n.startswith(_VAE_PREFIXES)]
    return _glob(found[0]) if found else None


def _text_evidence(names: list[str], header: FileHeader | None = None) -> tuple[str, str] | None:
    """(role, evidence) for a text encoder's tensor names, or None."""
    attn = [m for n in names if (m := _LLM_RE.match(n))]
    if attn and any("embed_tokens" in n for n in names):
        return "llm", f"tensor names {attn[0].group(1)}*{attn[0].group(2)}"
    if any(_LLAMA_CPP_T5_RE.match(n) for n in names):
        return "t5xxl", "tensor names enc.blk.*"
    t5 = [m for n in names if (m := _T5_RE.match(n))]
    if t5:
        return "t5xxl", f"tensor names {t5[0].group(1)}*{t5[0].group(2)}"
    if any(_LLAMA_CPP_LLM_RE.match(n) for n in names) and any("token_embd" in n for n in names):
        return "llm", "tensor names blk.*.attn_*"
    clip = [n for n in names if _CLIP_RE.search(n)]
    openclip = [n for n in names if _OPENCLIP_RE.search(n)]
    if clip or openclip:
        hidden = _clip_hidden(header) if header is not None else None
        role = "clip_g" if hidden == CLIP_G_HIDDEN else "clip_l"
        shown = "text_model.encoder.layers.*" if clip else "transformer.resblocks.*"
        width = f", hidden size {hidden}" if hidden else ""
        return role, f"tensor names {shown}{width}"
    return None


def _clip_hidden(header: FileHeader) -> int | None:
    """A CLIP text encoder's hidden size, read from a tensor shape (PyTorch order)."""
    for name, info in header.tensors.items():
        stripped = _strip(name)
        if stripped.endswith(("final_layer_norm.weight", "ln_final.weight")) and info.shape:
            return info.shape[0]
    for name, info in header.tensors.items():
        if name.endswith("token_embedding.weight") and len(info.shape) == 2:
            return info.shape[1]
    return None


def _components(header: FileHeader) -> dict[str, str]:
    """The pipeline components a file holds: component -> evidence."""
    raw = list(header.tensors)
    found: dict[str, str] = {}
    for component, prefixes in _COMPONENT_PREFIXES:
        hit = next((n for n in raw if n.startswith(prefixes)), None)
        if hit is not None:
            found[component] = hit.split(".")[0] + ".*"
    stripped = [_strip(n) for n in raw]
    if "diffusion" not in found and (ev := _diffusion_evidence(stripped)):
        found["diffusion"] = ev
    if "vae" not in found and (ev := _vae_evidence(stripped)):
        found["vae"] = ev
    if "text_encoders" not in found and (text := _text_evidence(stripped)):
        found["text_encoders"] = text[1]
    return found


def detect_role_with_evidence(header: FileHeader) -> tuple[str | None, str]:
    """The role a file's tensor names point to and the evidence, in words, e.g.
    ("llm", "tensor names model.layers.*.self_attn"); (None, "") when nothing matches.

    A file holding the diffusion model together with a VAE or text encoder is a checkpoint
    (sd.cpp's model_path): loaded as diffusion_model, its other tensors would be misnamed.
    """
    names = [_strip(n) for n in header.tensors]
    if not names:
        return None, ""
    components = _components(header)
    if "diffusion" in components and len(components) > 1:
        shown = ", ".join(f"{c} ({e})" for c, e in components.items())
        return "checkpoint", f"tensors of {shown}"
    if ev := _diffusion_evidence(names):
        return "diffusion_model", f"tensor names {ev}"
    if all(_TAESD_RE.match(n) for n in names):
        sides = sorted({n.split(".")[0] for n in names})
        return "taesd", "tensor names " + ", ".join(f"{s}.layers.*" for s in sides) + " only"
    if ev := _vae_evidence(names):
        return "vae", f"tensor names {ev}"
    if text := _text_evidence(names, header):
        return text
    return None, ""


def detect_role(header: FileHeader) -> str | None:
    """The role a file's tensor names point to (with or without sd.cpp's per-role prefixes),
    or None when they match no known architecture."""
    return detect_role_with_evidence(header)[0]


# A role slot that also takes files detected as another role: sd.cpp's model_path loads a
# diffusion-only file (a checkpoint may lack the parts given in other slots).
_ALSO_ACCEPTS: dict[str, tuple[str, ...]] = {"checkpoint": ("diffusion_model",)}


def _article(role: str) -> str:
    return "an" if role == "llm" else "a"


# ---------------------------------------------------------------------------------------------
# Native size


def guess_architecture(header: FileHeader) -> str:
    """A coarse architecture of a diffusion model or checkpoint: sd1, sd2, sdxl, mmdit, flux,
    dit or unknown; only what the native size needs."""
    names = {_strip(n): info for n, info in header.tensors.items()}
    if any(n.startswith("joint_blocks.") for n in names):
        return "mmdit"
    if any(n.startswith(("double_blocks.", "single_blocks.")) for n in names):
        return "flux"
    unet = any(n.startswith(("input_blocks.", "middle_block.", "down_blocks.")) for n in names)
    if unet:
        for n, info in names.items():
            if n.startswith(("label_emb.", "add_embedding.")) and 2816 in info.shape:
                return "sdxl"
        context = [
            info.shape[-1]
            for n, info in names.items()
            if n.endswith("attn2.to_k.weight") and len(info.shape) == 2
        ]
        if any(c == 2048 for c in context):
            return "sdxl"
        if any(c == 1024 for c in context):
            return "sd2"
        return "sd1"
    if _diffusion_evidence(list(names)):
        return "dit"
    return "unknown"


_ARCH_NATIVE_SIZES: dict[str, tuple[int, int]] = {
    "sd1": (512, 512),
    "sd2": (512, 512),
    "sdxl": (1024, 1024),
    "mmdit": (1024, 1024),
    "flux": (1024, 1024),
    "dit": (1024, 1024),
}


def native_size_for(header: FileHeader) -> tuple[int, int]:
    """The image size a diffusion model was trained at, guessed from its architecture.

    The memory estimate (`memory.py`) grows with the requested size above this native size
    (measured: the seed's estimate holds at the native size with flash attention and direct
    VAE convolution, and is far too low at twice it), so a guess that is too small only makes
    the estimate cautious sooner; unknown architectures get 512. A manifest's native_size wins.
    """
    return _ARCH_NATIVE_SIZES.get(guess_architecture(header), DEFAULT_NATIVE_SIZE)


# ---------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelFile:
    """One file of a model: its absolute path, its role, its size in bytes and its header."""

    path: Path
    role: str
    size: int
    header: FileHeader


@dataclass(frozen=True)
class Model:
    """A model: a name, its files by role and its native image size (width, height).
    `directory` is the model's folder (None when its files live in different folders)."""

    name: str
    files: dict[str, ModelFile]
    native_size: tuple[int, int] = DEFAULT_NATIVE_SIZE
    directory: Path | None = None

    @property
    def total_bytes(self) -> int:
        """The sum of the file sizes: the base of the seed's memory estimate."""
        return sum(f.size for f in self.files.values())

    def component_bytes(self) -> dict[str, int]:
        """Bytes per pipeline component, {"diffusion", "text_encoders", "vae"}, for the fit
        plan. A checkpoint's tensors are split by their prefixes; header bytes and tensors of
        no known component count as diffusion. The values sum to `total_bytes`."""
        out = dict.fromkeys(COMPONENTS, 0)
        for role, mf in self.files.items():
            if role != "checkpoint":
                out[ROLE_COMPONENTS[role]] += mf.size
                continue
            split = _split_checkpoint(mf.header)
            for component, nbytes in split.items():
                out[component] += nbytes
            out["diffusion"] += mf.size - sum(split.values())
        return out

    def path_roles(self) -> dict[str, str]:
        """{path: placeholder} for scrubbing logs: every file's absolute path ->
        "<role file>" and the model folder -> "<model dir>"; longest paths first so a
        replacer that goes in order never leaves half a path behind."""
        pairs: dict[str, str] = {}
        for role, mf in self.files.items():
            for p in _path_variants(mf.path):
                pairs[p] = f"<{role} file>"
        if self.directory is not None:
            for p in _path_variants(self.directory):
                pairs.setdefault(p, "<model dir>")
        return dict(sorted(pairs.items(), key=lambda kv: -len(kv[0])))

    def ctx_paths(self) -> dict[str, str]:
        """{sd_ctx_params_t field: path} for the runtime, e.g. {"llm_path": "/m/llm.gguf"}."""
        return {ROLE_PARAMS[role]: str(mf.path) for role, mf in self.files.items()}

    @classmethod
    def from_files(
        cls,
        files: Mapping[str, str | os.PathLike[str]],
        *,
        name: str | None = None,
        native_size: tuple[int, int] | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> Model:
        """A model from explicit {role: path}. Each file's header is validated and its
        detected role must agree with the given one (a file whose role cannot be detected is
        accepted: detection is best effort, the runtime has the last word). A checkpoint
        slot also takes a diffusion-only file (sd.cpp's model_path loads it)."""
        if not files:
            raise ModelLoadError("a model needs files: none were given")
        model_files: dict[str, ModelFile] = {}
        for role, raw_path in files.items():
            if role not in ROLE_PARAMS:
                raise ModelLoadError(
                    f"unknown role {role!r} (roles: {', '.join(ROLES)})", role=role
                )
            path = Path(raw_path).absolute()
            header = validate_header(path, role)
            detected, evidence = detect_role_with_evidence(header)
            if detected not in (None, role, *_ALSO_ACCEPTS.get(role, ())):
                raise ModelLoadError(
                    f"{role} file {path.name}: given as {role}, it looks like "
                    f"{_article(detected)} {detected} file ({evidence})",
                    role=role,
                )
            model_files[role] = ModelFile(path, role, header.file_size, header)

        main = model_files.get("diffusion_model") or model_files.get("checkpoint")
        if main is None:
            raise ModelLoadError(
                f"model {name or '(unnamed)'} has no diffusion_model or checkpoint file "
                f"(it has: {', '.join(model_files)})"
            )
        if name is None:
            name = main.path.stem
        if directory is None:
            parents = {mf.path.parent for mf in model_files.values()}
            directory = parents.pop() if len(parents) == 1 else None
        size = native_size or native_size_for(main.header)
        ordered = {r: model_files[r] for r in ROLES if r in model_files}
        return cls(name, ordered, (int(size[0]), int(size[1])), _abs_or_none(directory))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Model:
        """A folder is one model named after the folder. Its optional manifest `model.json`,
        {"files": {"role": "filename"}, "native_size": [w, h]}, names the roles (filenames
        relative, inside the folder); without "files", every *.safetensors and *.gguf file
        gets its role detected from its header."""
        folder = Path(path).absolute()
        name = folder.name
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise ModelLoadError(f"model folder {name} {what}")
        manifest = _read_manifest(folder)
        native = manifest.get("native_size")
        if "files" in manifest:
            files = {role: folder / fname for role, fname in manifest["files"].items()}
        else:
            files = _detect_files(folder)
        return cls.from_files(files, name=name, native_size=native, directory=folder)


def _abs_or_none(p: str | os.PathLike[str] | None) -> Path | None:
    return None if p is None else Path(p).absolute()


def _path_variants(p: Path) -> list[str]:
    """The path as given and as resolved (symlinks), since either may reach a log line."""
    out = [str(p)]
    try:
        resolved = str(p.resolve())
    except OSError:
        return out
    if resolved not in out:
        out.append(resolved)
    return out


def _split_checkpoint(header: FileHeader) -> dict[str, int]:
    out = dict.fromkeys(COMPONENTS, 0)
    for name, info in header.tensors.items():
        component = "diffusion"
        for comp, prefixes in _COMPONENT_PREFIXES:
            if name.startswith(prefixes):
                component = comp
                break
        else:
            stripped = [_strip(name)]
            if _vae_evidence(stripped) or all(_TAESD_RE.match(n) for n in stripped):
                component = "vae"
            elif _text_evidence(stripped) or "embed_tokens" in name or "shared." in name:
                component = "text_encoders"
        out[component] += info.nbytes
    return out


def _read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's model.json, checked: roles known, filenames relative and inside the
    folder (a manifest must not point the runtime at other files on the host)."""
    mpath = folder / MANIFEST_NAME
    label = f"{MANIFEST_NAME} of model {folder.name}"
    if not mpath.exists():
        return {}
    try:
        doc = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{label} cannot be read: {type(exc).__name__}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{label} is not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{label} must be a JSON object")
    out: dict[str, Any] = {}
    if "files" in doc:
        files = doc["files"]
        if not isinstance(files, dict) or not files:
            raise ModelLoadError(f'{label}: "files" must map roles to file names')
        checked: dict[str, str] = {}
        for role, fname in files.items():
            if role not in ROLE_PARAMS:
                raise ModelLoadError(
                    f"{label}: unknown role {role!r} (roles: {', '.join(ROLES)})", role=role
                )
            if not isinstance(fname, str) or not fname:
                raise ModelLoadError(f"{label}: the {role} file name must be a string", role=role)
            if not _stays_inside(fname):
                raise ModelLoadError(
                    f"{label}: the {role} file {fname!r} must be a file name inside the model "
                    "folder (no absolute paths, no '..')",
                    role=role,
                )
            checked[role] = fname
        out["files"] = checked
    if "native_size" in doc:
        size = doc["native_size"]
        if not (
            isinstance(size, list)
            and len(size) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
        ):
            raise ModelLoadError(f'{label}: "native_size" must be [width, height] in pixels')
        out["native_size"] = (size[0], size[1])
    return out


def _stays_inside(fname: str) -> bool:
    """True when a manifest file name cannot leave the folder on any OS."""
    for pure in (PurePosixPath(fname), PureWindowsPath(fname)):
        if pure.is_absolute() or pure.drive or pure.root or ".." in pure.parts:
            return False
    return True


def _detect_files(folder: Path) -> dict[str, Path]:
    """{role: path} for a folder without a manifest, roles detected from the headers."""
    candidates = sorted(
        p
        for p in folder.iterdir()
        if p.suffix.lower() in MODEL_SUFFIXES and not p.name.startswith(".") and p.is_file()
    )
    if not candidates:
        raise ModelLoadError(
            f"model folder {folder.name} holds no .safetensors or .gguf file "
            f"(and no {MANIFEST_NAME})"
        )
    found: dict[str, Path] = {}
    for p in candidates:
        header = validate_header(p)
        role = detect_role(header)
        if role is None:
            shown = ", ".join(list(header.tensors)[:3]) or "no tensors"
            raise ModelLoadError(
                f"model file {p.name} in model {folder.name}: its role cannot be told from its "
                f"tensor names ({shown}); name it in {MANIFEST_NAME}"
            )
        if role in found:
            raise ModelLoadError(
                f"{role} files {found[role].name} and {p.name} in model {folder.name}: two files "
                f"with one role; name the one to use in {MANIFEST_NAME}",
                role=role,
            )
        found[role] = p
    return found
