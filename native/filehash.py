"""The short file hashes A1111 writes into an image's infotext, computed once per file version.

An image says which files made it by hash, so a reader (Civitai, an image browser, a user with
another copy of the file) can find them whatever they are named here. What A1111 (v1.10)
writes, and so what we write:

- `Model hash`: the first 10 hex digits of the SHA-256 of the whole checkpoint file (its
  `CheckpointInfo.shorthash`, Civitai's "AutoV2"). A model of several files (a diffusion model
  with its own text encoders and VAE, as Flux-style and the tiny test model are) is hashed by
  its main file, the `diffusion_model` or `checkpoint` role: that is the file A1111 users pick
  and search for; the text encoders and VAE are shared by many models and are not what
  `Model hash` names in A1111 either (it names them nowhere).
- `Lora hashes`: for each LoRA, the first 12 hex digits of A1111's `NetworkOnDisk.hash`: the
  file's `sshs_model_hash` metadata when its trainer stored one (kohya's sd-scripts store the
  same hash precomputed), else for a .safetensors file the "addnet" hash (SHA-256 of the bytes
  after the 8-byte header length and the JSON header, i.e. of the tensor data only, so
  editing the metadata does not change it: Civitai's "AutoV3"), else (a .gguf file, which A1111
  cannot load: it hashes non-safetensors files whole) the SHA-256 of the whole file.

Hashing reads every byte (0.8 to 1.2 GB/s on these 2 cores by bench/file_hash.py, so a
6.5 GB SDXL checkpoint costs 5 to 8 s), so it
never runs per job: a worker hashes a model when its engine loads and a LoRA when a job first
uses it, and keeps the result per (path, size, mtime) in memory and in a small JSON file in
the user's cache (`$SDFARM_CACHE/hashes.json`, as A1111 keeps its `cache.json`), so a
restarted worker does not hash again. The paths stay in that file on this machine; only the
hashes reach an image.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MODEL_HASH_CHARS = 10
LORA_HASH_CHARS = 12
CACHE_FILE = "hashes.json"
_CHUNK = 1 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def sha256_of(path: str | os.PathLike[str], start: int = 0) -> str:
    """The SHA-256 (hex) of the file's bytes from offset `start` to its end."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def safetensors_data_start(path: str | os.PathLike[str]) -> int:
    """Where a .safetensors file's tensor data begins: after its 8-byte little-endian header
    length and that many bytes of JSON header (what the addnet hash skips)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{Path(path).name} is too short to be a .safetensors file")
    return 8 + int.from_bytes(head, "little")


class HashCache:
    """SHA-256 of file contents keyed by (absolute path, start offset) and checked against the
    file's size and mtime, in memory and (when `file` is given) in a JSON file shared by the
    processes of this host. A changed file is hashed again. Thread-safe; writes of the JSON
    file are atomic (a lost race only costs a later re-hash)."""

    def __init__(self, file: str | os.PathLike[str] | None = None) -> None:
        self.file = Path(file) if file is not None else None
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = self._read()
        self.computed = 0  # how many hashes read a whole file (tests and benches look)

    def sha256(self, path: str | os.PathLike[str], start: int = 0) -> str:
        """The SHA-256 of `path` from byte `start`, hashed only when unknown for this version
        of the file."""
        p = Path(path).absolute()
        st = p.stat()
        key = f"{p}@{start}"
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        with self._lock:
            known = self._entries.get(key)
        if known is not None and {k: known.get(k) for k in stamp} == stamp:
            return str(known["sha256"])
        digest = sha256_of(p, start)
        with self._lock:
            self.computed += 1
            self._entries[key] = {**stamp, "sha256": digest}
            self._write()
        return digest

    def _read(self) -> dict[str, dict[str, Any]]:
        if self.file is None:
            return {}
        try:
            doc = json.loads(self.file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        entries = doc.get("sha256") if isinstance(doc, dict) else None
        if not isinstance(entries, dict):
            return {}
        ok = {k: v for k, v in entries.items() if isinstance(v, dict)}
        return {k: v for k, v in ok.items() if _HEX64.match(str(v.get("sha256")))}

    def _write(self) -> None:
        if self.file is None:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), **self._entries}  # keep what other processes added
            kept = {k: v for k, v in merged.items() if os.path.exists(k.rpartition("@")[0])}
            tmp = self.file.with_name(f".{self.file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"sha256": kept}), "utf-8")
            os.replace(tmp, self.file)
        except OSError:
            pass  # a read-only cache only costs hashing again in the next process


_default: HashCache | None = None
_default_lock = threading.Lock()


def default_cache() -> HashCache:
    """The process's cache, kept in `hashes.json` in sdfarm's cache folder
    (sdfarm.native.build.cache_root)."""
    global _default
    with _default_lock:
        if _default is None:
            from sdfarm.native.build import cache_root

            _default = HashCache(cache_root() / CACHE_FILE)
        return _default


def model_hash(path: str | os.PathLike[str], cache: HashCache | None = None) -> str:
    """A1111's `Model hash` of a model's main file: its SHA-256's first 10 hex digits."""
    return (cache or default_cache()).sha256(path)[:MODEL_HASH_CHARS]


def lora_hash(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any] | None = None,
    cache: HashCache | None = None,
) -> str:
    """A1111's short hash of a LoRA file (its `Lora hashes` entry): the first 12 hex digits of
    the `sshs_model_hash` in the file's `metadata` when it holds one, else of the addnet hash
    of a .safetensors file, else of the whole file's SHA-256 (see the module's docstring)."""
    stored = str((metadata or {}).get("sshs_model_hash") or "").strip().lower()
    if _HEX64.match(stored):
        return stored[:LORA_HASH_CHARS]
    cache = cache or default_cache()
    start = safetensors_data_start(path) if str(path).lower().endswith(".safetensors") else 0
    return cache.sha256(path, start)[:LORA_HASH_CHARS]
