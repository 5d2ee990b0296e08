"""The short file hashes of the infotext (sdfarm.native.filehash): A1111's conventions,
checked against hashes computed here with hashlib alone, and the per-file-version cache that
keeps them off each job's path."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from sdfarm.native.filehash import HashCache, lora_hash, model_hash


def _lora(path: Path, metadata: dict[str, str] | None = None) -> Path:
    tensors = {"x.lora_down.weight": np.arange(32, dtype=np.float32).reshape(4, 8),
               "x.lora_up.weight": np.ones((8, 4), dtype=np.float32)}  # fmt: skip
    save_file(tensors, str(path), metadata=metadata)
    return path


def _addnet(path: Path) -> str:
    """sd-scripts' addnet_hash_safetensors, written out: SHA-256 after the header."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return hashlib.sha256(data[8 + n :]).hexdigest()


def test_model_hash_is_the_first_ten_hex_digits_of_the_whole_files_sha256(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(3 * (1 << 20) + 17))  # more than one read block
    assert model_hash(f, HashCache()) == hashlib.sha256(f.read_bytes()).hexdigest()[:10]


def test_a_safetensors_loras_hash_covers_its_tensors_only(tmp_path: Path) -> None:
    a = _lora(tmp_path / "a.safetensors", {"ss_output_name": "a"})
    b = _lora(tmp_path / "b.safetensors", {"ss_output_name": "another name, same tensors"})
    cache = HashCache()
    assert lora_hash(a, cache=cache) == _addnet(a)[:12]
    assert lora_hash(a, cache=cache) == lora_hash(b, cache=cache)  # metadata does not count
    assert lora_hash(a, cache=cache) != hashlib.sha256(a.read_bytes()).hexdigest()[:12]


def test_a_stored_sshs_model_hash_wins_and_a_gguf_lora_is_hashed_whole(tmp_path: Path) -> None:
    stored = "ab" * 32
    a = _lora(tmp_path / "a.safetensors")
    assert lora_hash(a, {"sshs_model_hash": stored.upper()}, HashCache()) == stored[:12]
    assert lora_hash(a, {"sshs_model_hash": "not a hash"}, HashCache()) == _addnet(a)[:12]
    g = tmp_path / "g.gguf"
    g.write_bytes(b"GGUF" + os.urandom(1000))
    assert lora_hash(g, {}, HashCache()) == hashlib.sha256(g.read_bytes()).hexdigest()[:12]


def test_each_file_version_is_hashed_once_and_the_cache_file_outlives_the_process(
    tmp_path: Path,
) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(os.urandom(4096))
    store = tmp_path / "cache" / "hashes.json"
    first = HashCache(store)
    digest = first.sha256(f)
    assert first.sha256(f) == digest and first.computed == 1
    again = HashCache(store)  # a restarted worker
    assert again.sha256(f) == digest and again.computed == 0
    f.write_bytes(os.urandom(4096))  # same size, new contents and mtime
    os.utime(f, ns=(1, 1))
    assert again.sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest() != digest
    assert again.computed == 1


def test_a_corrupt_or_unwritable_cache_file_costs_only_a_rehash(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    store = tmp_path / "hashes.json"
    store.write_text("{not json")
    assert HashCache(store).sha256(f) == hashlib.sha256(b"abc").hexdigest()
    assert json.loads(store.read_text())["sha256"]  # rewritten whole
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    cache = HashCache(blocked / "hashes.json")  # its folder cannot be made
    assert cache.sha256(f) == hashlib.sha256(b"abc").hexdigest()


def test_entries_of_files_that_are_gone_are_dropped_when_the_cache_is_written(
    tmp_path: Path,
) -> None:
    store = tmp_path / "hashes.json"
    cache = HashCache(store)
    gone, kept = tmp_path / "gone.gguf", tmp_path / "kept.gguf"
    gone.write_bytes(b"1")
    kept.write_bytes(b"2")
    cache.sha256(gone)
    gone.unlink()
    cache.sha256(kept)
    assert [Path(k.rpartition("@")[0]).name for k in json.loads(store.read_text())["sha256"]] == [
        "kept.gguf"
    ]
