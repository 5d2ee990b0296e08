"""Model files: header readers, header validation, role detection, manifests, Model."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sdfarm.native.errors import ModelLoadError
from sdfarm.native.headers import FileHeader, TensorInfo, read_header, validate_header
from sdfarm.native.model import Model
from sdfarm.native.roles import (
    ROLE_PARAMS,
    detect_role,
    detect_role_with_evidence,
    guess_architecture,
    native_size_for,
)


def write_st(path: Path, shapes: dict[str, tuple[int, ...]], dtype=np.float16) -> Path:
    """A small real safetensors file holding zero tensors of the given shapes."""
    save_file({n: np.zeros(s, dtype=dtype) for n, s in shapes.items()}, str(path))
    return path


def write_raw_st(path: Path, header: dict, data: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf_raw(
    path: Path,
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    kvs: bytes = b"",
    n_kv: int = 0,
    tensors: list[tuple[str, list[int], int, int]] | None = None,
    data: bytes = b"",
    alignment: int = 32,
) -> Path:
    """A GGUF built by hand: tensors are (name, ggml dims, type id, offset)."""
    tensors = tensors or []
    out = magic + struct.pack("<I", version)
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, n_kv)
    out += kvs
    for name, dims, type_id, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", type_id, offset)
    out += b"\0" * ((-len(out)) % alignment)
    path.write_bytes(out + data)
    return path


def assert_clean_error(exc: pytest.ExceptionInfo, role: str, name: str, tmp_path: Path) -> str:
    msg = str(exc.value)
    assert msg.startswith(f"{role} file {name}"), msg
    assert str(tmp_path) not in msg
    assert exc.value.role == role
    return msg


# --- header readers ----------------------------------------------------------------------


def test_safetensors_header(tmp_path: Path) -> None:
    p = tmp_path / "a.safetensors"
    save_file(
        {"w": np.zeros((4, 3), np.float16), "b": np.zeros((4,), np.float32)},
        str(p),
        metadata={"k": "v"},
    )
    h = read_header(p)
    assert h.format == "safetensors"
    assert h.tensors["w"] == TensorInfo("F16", (4, 3), 24)
    assert h.tensors["b"] == TensorInfo("F32", (4,), 16)
    assert h.data_bytes == 40
    assert h.file_size == p.stat().st_size == h.data_start + 40
    assert h.metadata == {"k": "v"}


def test_gguf_header_from_gguf_py(tmp_path: Path) -> None:
    import gguf
    from gguf.quants import quantize

    p = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(p), arch="test")
    w.add_uint32("u32", 7)
    w.add_string("s", "hello")
    w.add_array("arr", [1, 2, 3])
    w.add_array("strs", ["a", "bc"])
    w.add_float64("f64", 1.5)
    w.add_bool("flag", True)
    w.add_tensor(
        "q",
        quantize(np.ones((8, 64), np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("h", np.zeros((2, 3, 5), np.float16))
    w.add_tensor("b", np.zeros((5,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    h = validate_header(p, "vae")
    assert h.format == "gguf"
    assert h.metadata["general.architecture"] == "test"
    assert h.metadata["u32"] == 7 and h.metadata["s"] == "hello" and h.metadata["f64"] == 1.5
    assert h.metadata["arr"] == [1, 2, 3] and h.metadata["strs"] == ["a", "bc"]
    assert h.metadata["flag"] is True
    assert h.tensors["q"] == TensorInfo("Q8_0", (8, 64), 8 * 2 * 34)
    assert h.tensors["h"] == TensorInfo("F16", (2, 3, 5), 60)
    assert h.tensors["b"] == TensorInfo("F32", (5,), 20)
    assert h.data_start % 32 == 0
    assert h.data_start + h.data_bytes <= h.file_size
    reader = gguf.GGUFReader(str(p))
    assert reader.data_offset == h.data_start
    for t in reader.tensors:
        assert tuple(reversed(t.shape.tolist())) == h.tensors[t.name].shape
        assert t.n_bytes == h.tensors[t.name].nbytes


def test_gguf_custom_alignment(tmp_path: Path) -> None:
    kv = gguf_string("general.alignment") + struct.pack("<II", 4, 64)
    p = write_gguf_raw(
        tmp_path / "x.gguf",
        n_kv=1,
        kvs=kv,
        tensors=[("t", [4], 0, 0)],
        alignment=64,
        data=b"\0" * 16,
    )
    h = read_header(p)
    assert h.data_start % 64 == 0 and h.data_bytes == 16


# --- error cases -------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        validate_header(tmp_path / "dit.safetensors", "diffusion_model")
    msg = assert_clean_error(exc, "diffusion_model", "dit.safetensors", tmp_path)
    assert "does not exist" in msg


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "dit.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError) as exc:
        validate_header(tmp_path / "dit.safetensors", "diffusion_model")
    assert "empty (0 bytes)" in assert_clean_error(
        exc, "diffusion_model", "dit.safetensors", tmp_path
    )


@pytest.mark.parametrize(
    "content", [b"hello world, not a model at all", b"abc", b"PK\x03\x04xxxxxxxx"]
)
def test_garbage_bytes(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "llm.gguf").write_bytes(content)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(tmp_path / "llm.gguf", "llm")
    msg = assert_clean_error(exc, "llm", "llm.gguf", tmp_path)
    assert "do not look like safetensors or GGUF" in msg


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    (tmp_path / "vae.safetensors").mkdir()
    with pytest.raises(ModelLoadError) as exc:
        validate_header(tmp_path / "vae.safetensors", "vae")
    assert_clean_error(exc, "vae", "vae.safetensors", tmp_path)


def test_header_claims_more_than_the_file(tmp_path: Path) -> None:
    p = write_raw_st(tmp_path / "t5.safetensors", {}, length=10_000)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "t5xxl")
    msg = assert_clean_error(exc, "t5xxl", "t5.safetensors", tmp_path)
    assert "corrupt safetensors header" in msg and "10,000" in msg


def test_header_claims_a_terabyte(tmp_path: Path) -> None:
    p = write_raw_st(tmp_path / "t5.safetensors", {}, length=10**12)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "t5xxl")
    assert "1,000,000,000,000" in assert_clean_error(exc, "t5xxl", "t5.safetensors", tmp_path)


def test_header_claims_less_than_the_json(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}
    p = write_raw_st(tmp_path / "clip.safetensors", header, b"\0" * 4, length=20)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "clip_l")
    msg = assert_clean_error(exc, "clip_l", "clip.safetensors", tmp_path)
    assert "invalid JSON" in msg


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 4]},  # size mismatch
        {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]},
        {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]},
        {"shape": [2], "data_offsets": [0, 4]},
        "not an object",
    ],
)
def test_corrupt_entries(tmp_path: Path, entry: object) -> None:
    p = write_raw_st(tmp_path / "v.safetensors", {"w": entry}, b"\0" * 8)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "vae")
    assert "corrupt safetensors header" in assert_clean_error(exc, "vae", "v.safetensors", tmp_path)


def test_truncated_safetensors(tmp_path: Path) -> None:
    p = write_st(tmp_path / "dit.safetensors", {"double_blocks.0.w": (64, 64)})
    full = p.read_bytes()
    p.write_bytes(full[:-5000])
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "diffusion_model")
    msg = assert_clean_error(exc, "diffusion_model", "dit.safetensors", tmp_path)
    assert "is truncated: tensor data needs 8,192 bytes" in msg
    assert "the file has 3,192" in msg


def test_truncated_gguf(tmp_path: Path) -> None:
    p = write_gguf_raw(tmp_path / "dit.gguf", tensors=[("t", [64, 64], 1, 0)], data=b"\0" * 100)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "diffusion_model")
    msg = assert_clean_error(exc, "diffusion_model", "dit.gguf", tmp_path)
    assert "tensor data needs 8,192 bytes" in msg and "the file has 100" in msg


def test_unknown_and_unsupported_dtypes(tmp_path: Path) -> None:
    p = write_raw_st(
        tmp_path / "a.safetensors",
        {"w": {"dtype": "F7", "shape": [2], "data_offsets": [0, 4]}},
        b"\0" * 4,
    )
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "vae")
    assert "unknown dtype 'F7'" in assert_clean_error(exc, "vae", "a.safetensors", tmp_path)

    p = write_raw_st(
        tmp_path / "b.safetensors",
        {"w": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}},
        b"\0" * 2,
    )
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "vae")
    assert "cannot load" in assert_clean_error(exc, "vae", "b.safetensors", tmp_path)

    p = write_gguf_raw(tmp_path / "c.gguf", tensors=[("t", [4], 99, 0)], data=b"\0" * 64)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "vae")
    assert "unknown ggml type 99" in assert_clean_error(exc, "vae", "c.gguf", tmp_path)


def test_gguf_bad_magic(tmp_path: Path) -> None:
    p = write_gguf_raw(tmp_path / "llm.gguf", magic=b"GGUX", tensors=[("t", [4], 0, 0)])
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "llm")
    assert "do not look like safetensors or GGUF" in assert_clean_error(
        exc, "llm", "llm.gguf", tmp_path
    )


def test_gguf_absurd_tensor_count(tmp_path: Path) -> None:
    p = write_gguf_raw(tmp_path / "llm.gguf", n_tensors=10**12)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "llm")
    msg = assert_clean_error(exc, "llm", "llm.gguf", tmp_path)
    assert "1,000,000,000,000 tensors" in msg


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"version": 1}, "version 1"),
        ({"version": 3 << 24}, "big-endian"),
        ({"n_kv": 10**15}, "key/value pairs"),
        ({"n_kv": 1, "kvs": gguf_string("k") + struct.pack("<I", 77)}, "unknown value type 77"),
        (
            {"n_kv": 1, "kvs": gguf_string("k") + struct.pack("<IIQ", 9, 4, 10**14)},
            "needs 400,000,000,000,000 bytes",
        ),
        (
            {"n_kv": 1, "kvs": gguf_string("k") + struct.pack("<IIQ", 9, 8, 10**14)},
            "claims 100,000,000,000,000 elements",
        ),
        ({"n_kv": 1, "kvs": struct.pack("<Q", 10**13)}, "needs 10,000,000,000,000 bytes"),
        (
            {"n_kv": 1, "kvs": gguf_string("general.alignment") + struct.pack("<IQ", 10, 32)},
            "general.alignment",
        ),
        ({"tensors": [("t", [1, 1, 1, 1, 1], 0, 0)]}, "5 dimensions"),
        ({"tensors": [("t", [33], 8, 0)]}, "not a multiple of its block of 32"),
        ({"tensors": [("t", [4], 0, 0), ("t", [4], 0, 32)]}, "duplicate tensor name"),
    ],
)
def test_gguf_corrupt_headers(tmp_path: Path, kwargs: dict, needle: str) -> None:
    p = write_gguf_raw(tmp_path / "m.gguf", data=b"\0" * 64, **kwargs)
    with pytest.raises(ModelLoadError) as exc:
        validate_header(p, "taesd")
    msg = assert_clean_error(exc, "taesd", "m.gguf", tmp_path)
    assert "corrupt GGUF header" in msg and needle in msg


def test_truncated_gguf_header(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ModelLoadError) as exc:
        validate_header(tmp_path / "m.gguf", "taesd")
    assert "corrupt GGUF header" in assert_clean_error(exc, "taesd", "m.gguf", tmp_path)


def test_role_none_says_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        validate_header(tmp_path / "x.gguf")
    assert str(exc.value).startswith("model file x.gguf does not exist")
    assert exc.value.role is None


# --- role detection ----------------------------------------------------------------------

ROLE_CASES: dict[str, dict[str, tuple[int, ...]]] = {
    "diffusion_model": {
        "double_blocks.0.img_attn.qkv.weight": (12, 4),
        "single_blocks.0.linear1.weight": (8, 4),
    },
    "taesd": {"decoder.layers.0.weight": (4, 4, 3, 3), "encoder.layers.1.weight": (4, 4, 3, 3)},
    "vae": {
        "decoder.conv_in.weight": (4, 4, 3, 3),
        "decoder.up.0.block.0.conv1.weight": (4, 4, 3, 3),
        "encoder.down.0.block.0.conv1.weight": (4, 4, 3, 3),
        "post_quant_conv.weight": (4, 4, 1, 1),
    },
    "llm": {
        "model.embed_tokens.weight": (32, 8),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.norm.weight": (8,),
    },
    "t5xxl": {
        "shared.weight": (32, 8),
        "encoder.block.0.layer.0.SelfAttention.q.weight": (8, 8),
        "encoder.final_layer_norm.weight": (8,),
    },
    "clip_l": {
        "text_model.encoder.layers.0.self_attn.q_proj.weight": (768, 768),
        "text_model.final_layer_norm.weight": (768,),
    },
    "clip_g": {
        "text_model.encoder.layers.0.self_attn.q_proj.weight": (1280, 1280),
        "text_model.final_layer_norm.weight": (1280,),
    },
    "checkpoint": {
        "model.diffusion_model.input_blocks.0.0.weight": (4, 4, 3, 3),
        "first_stage_model.decoder.conv_in.weight": (4, 4, 3, 3),
        "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight": (8, 8),
    },
}


@pytest.mark.parametrize("role", list(ROLE_CASES))
def test_detect_role(tmp_path: Path, role: str) -> None:
    p = write_st(tmp_path / f"{role}.safetensors", ROLE_CASES[role])
    assert detect_role(validate_header(p)) == role


SD_PREFIXES = {
    "diffusion_model": "model.diffusion_model.",
    "vae": "first_stage_model.",
    "taesd": "tae.",
    "llm": "text_encoders.llm.",
    "t5xxl": "text_encoders.t5xxl.transformer.",
    "clip_l": "cond_stage_model.transformer.",
    "clip_g": "text_encoders.clip_g.transformer.",
}


@pytest.mark.parametrize("role", list(SD_PREFIXES))
def test_detect_role_with_sd_prefixes(tmp_path: Path, role: str) -> None:
    shapes = {SD_PREFIXES[role] + n: s for n, s in ROLE_CASES[role].items()}
    p = write_st(tmp_path / "x.safetensors", shapes)
    assert detect_role(read_header(p)) == role


def test_detect_other_dits_and_unknown(tmp_path: Path) -> None:
    z_image = {"layers.0.adaLN_modulation.0.weight": (8, 4), "cap_embedder.0.weight": (4,)}
    mmdit = {"joint_blocks.0.x_block.attn.qkv.weight": (12, 4)}
    unet = {"input_blocks.0.0.weight": (4, 4, 3, 3), "middle_block.0.in_layers.0.weight": (4,)}
    unknown = {"foo.bar": (4,)}
    for i, (shapes, role) in enumerate(
        [
            (z_image, "diffusion_model"),
            (mmdit, "diffusion_model"),
            (unet, "diffusion_model"),
            (unknown, None),
        ]
    ):
        assert detect_role(read_header(write_st(tmp_path / f"{i}.safetensors", shapes))) == role


def test_detect_role_from_gguf(tmp_path: Path) -> None:
    p = write_gguf_raw(
        tmp_path / "llm.gguf",
        tensors=[
            ("model.embed_tokens.weight", [8, 32], 0, 0),
            ("model.layers.0.self_attn.q_proj.weight", [8, 8], 0, 1024),
        ],
        data=b"\0" * 2048,
    )
    role, evidence = detect_role_with_evidence(validate_header(p, "llm"))
    assert role == "llm" and evidence == "tensor names model.layers.*.self_attn"


def test_clip_hidden_size_from_gguf_dims_order(tmp_path: Path) -> None:
    # ggml stores dims reversed: [768, 1280] in a GGUF is PyTorch shape (1280, 768).
    p = write_gguf_raw(
        tmp_path / "clip.gguf",
        tensors=[
            ("text_model.encoder.layers.0.self_attn.q_proj.weight", [1280, 1280], 0, 0),
            ("text_model.final_layer_norm.weight", [1280], 0, 1280 * 1280 * 4),
        ],
        data=b"\0" * (1280 * 1281 * 4),
    )
    assert detect_role(validate_header(p)) == "clip_g"


# --- models ------------------------------------------------------------------------------


def make_model_dir(folder: Path, roles: list[str], manifest: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for role in roles:
        write_st(folder / f"{role}.safetensors", ROLE_CASES[role])
    if manifest is not None:
        (folder / "model.json").write_text(json.dumps(manifest))
    return folder


def test_from_dir_detects_roles(tmp_path: Path) -> None:
    folder = make_model_dir(tmp_path / "mymodel", ["diffusion_model", "llm", "taesd"])
    (folder / "README.txt").write_text("ignored")
    m = Model.from_dir(folder)
    assert m.name == "mymodel"
    assert list(m.files) == ["diffusion_model", "llm", "taesd"]
    assert m.native_size == (1024, 1024)  # a Flux-style DiT
    assert m.ctx_paths() == {
        "diffusion_model_path": str(folder / "diffusion_model.safetensors"),
        "llm_path": str(folder / "llm.safetensors"),
        "taesd_path": str(folder / "taesd.safetensors"),
    }
    roles = m.path_roles()
    assert roles[str(folder / "llm.safetensors")] == "<llm file>"
    assert roles[str(folder)] == "<model dir>"
    assert list(roles)[-1] == str(folder)  # files first: longer paths replaced first
    sizes = {r: (folder / f"{r}.safetensors").stat().st_size for r in m.files}
    assert m.total_bytes == sum(sizes.values())
    assert m.component_bytes() == {
        "diffusion": sizes["diffusion_model"],
        "text_encoders": sizes["llm"],
        "vae": sizes["taesd"],
    }


def test_from_dir_with_manifest(tmp_path: Path) -> None:
    folder = make_model_dir(
        tmp_path / "m",
        ["diffusion_model", "llm"],
        {
            "files": {"diffusion_model": "diffusion_model.safetensors", "llm": "llm.safetensors"},
            "native_size": [256, 320],
        },
    )
    write_st(folder / "extra.safetensors", {"foo": (2,)})  # not in the manifest: ignored
    m = Model.from_dir(folder)
    assert m.native_size == (256, 320) and set(m.files) == {"diffusion_model", "llm"}


@pytest.mark.parametrize(
    "fname", ["../x.safetensors", "/etc/passwd", "a/../../x", "C:\\x", "..\\x.safetensors"]
)
def test_manifest_path_escape_rejected(tmp_path: Path, fname: str) -> None:
    folder = make_model_dir(
        tmp_path / "m", ["diffusion_model"], {"files": {"diffusion_model": fname}}
    )
    with pytest.raises(ModelLoadError) as exc:
        Model.from_dir(folder)
    assert "inside the model folder" in str(exc.value)
    assert str(tmp_path) not in str(exc.value)


@pytest.mark.parametrize(
    "manifest",
    [{"files": {"unet": "a.safetensors"}}, {"native_size": [0, 512]}, {"files": []}, [1, 2]],
)
def test_bad_manifests(tmp_path: Path, manifest: object) -> None:
    folder = make_model_dir(tmp_path / "m", ["diffusion_model"], manifest)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="model.json of model m"):
        Model.from_dir(folder)


def test_bad_manifest_json(tmp_path: Path) -> None:
    folder = make_model_dir(tmp_path / "m", ["diffusion_model"])
    (folder / "model.json").write_text("{nope")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        Model.from_dir(folder)


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model folder nothere does not exist"):
        Model.from_dir(tmp_path / "nothere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no .safetensors or .gguf"):
        Model.from_dir(tmp_path / "empty")

    folder = make_model_dir(tmp_path / "unk", ["diffusion_model"])
    write_st(folder / "mystery.safetensors", {"foo.bar": (2,)})
    with pytest.raises(ModelLoadError) as exc:
        Model.from_dir(folder)
    assert "mystery.safetensors" in str(exc.value) and "role cannot be told" in str(exc.value)

    folder = make_model_dir(tmp_path / "dup", ["diffusion_model", "llm"])
    write_st(folder / "llm2.safetensors", ROLE_CASES["llm"])
    with pytest.raises(ModelLoadError) as exc:
        Model.from_dir(folder)
    assert str(exc.value).startswith("llm files llm.safetensors and llm2.safetensors")

    folder = make_model_dir(tmp_path / "nodit", ["llm", "taesd"])
    with pytest.raises(ModelLoadError, match="no diffusion_model or checkpoint"):
        Model.from_dir(folder)

    folder = make_model_dir(tmp_path / "bad", ["diffusion_model"])
    (folder / "broken.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as exc:
        Model.from_dir(folder)
    assert str(exc.value).startswith("model file broken.gguf has a corrupt GGUF header")
    assert str(tmp_path) not in str(exc.value)


def test_wrong_role_given(tmp_path: Path) -> None:
    llm = write_st(tmp_path / "llm.safetensors", ROLE_CASES["llm"])
    dit = write_st(tmp_path / "dit.safetensors", ROLE_CASES["diffusion_model"])
    with pytest.raises(ModelLoadError) as exc:
        Model.from_files({"diffusion_model": llm})
    msg = str(exc.value)
    assert msg == (
        "diffusion_model file llm.safetensors: given as diffusion_model, it looks like an llm "
        "file (tensor names model.layers.*.self_attn)"
    )
    assert exc.value.role == "diffusion_model"

    with pytest.raises(ModelLoadError, match="given as taesd, it looks like a diffusion_model"):
        Model.from_files({"diffusion_model": dit, "taesd": dit})

    clip_l = write_st(tmp_path / "clip_l.safetensors", ROLE_CASES["clip_l"])
    with pytest.raises(ModelLoadError, match="given as clip_g, it looks like a clip_l"):
        Model.from_files({"diffusion_model": dit, "clip_g": clip_l})

    with pytest.raises(ModelLoadError, match="unknown role 'unet'"):
        Model.from_files({"unet": dit})


def test_from_files_accepts_undetectable_and_diffusion_as_checkpoint(tmp_path: Path) -> None:
    dit = write_st(tmp_path / "dit.safetensors", ROLE_CASES["diffusion_model"])
    odd = write_st(tmp_path / "odd.safetensors", {"foo.bar": (2,)})
    m = Model.from_files({"checkpoint": dit, "vae": odd})
    assert m.name == "dit" and m.directory == tmp_path
    assert m.ctx_paths() == {"model_path": str(dit), "vae_path": str(odd)}


def test_from_files_error_names_no_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        Model.from_files({"diffusion_model": tmp_path / "sub" / "dit.gguf"})
    assert str(exc.value) == "diffusion_model file dit.gguf does not exist"


def test_checkpoint_component_bytes(tmp_path: Path) -> None:
    shapes = {
        "model.diffusion_model.input_blocks.0.0.weight": (100, 10),  # 2000 bytes f16
        "first_stage_model.decoder.conv_in.weight": (30, 10),  # 600
        "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight": (20, 10),
        "alphas_cumprod": (10,),  # 20: no component -> diffusion
    }
    p = write_st(tmp_path / "sd.safetensors", shapes)
    m = Model.from_files({"checkpoint": p})
    parts = m.component_bytes()
    assert parts["vae"] == 600 and parts["text_encoders"] == 400
    assert sum(parts.values()) == m.total_bytes == p.stat().st_size
    assert m.native_size == (512, 512)


def _header(shapes: dict[str, tuple[int, ...]]) -> FileHeader:
    tensors = {n: TensorInfo("F16", s, 2 * int(np.prod(s))) for n, s in shapes.items()}
    return FileHeader("safetensors", tensors, 8, 0, 8)


@pytest.mark.parametrize(
    ("shapes", "arch", "size"),
    [
        (
            {
                "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (
                    320,
                    768,
                )
            },
            "sd1",
            512,
        ),
        ({"input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (320, 1024)}, "sd2", 512),
        (
            {"input_blocks.0.0.weight": (320, 4, 3, 3), "label_emb.0.0.weight": (1280, 2816)},
            "sdxl",
            1024,
        ),
        ({"input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight": (640, 2048)}, "sdxl", 1024),
        ({"joint_blocks.0.x_block.attn.qkv.weight": (12, 4)}, "mmdit", 1024),
        ({"double_blocks.0.img_attn.qkv.weight": (12, 4)}, "flux", 1024),
        ({"layers.0.adaLN_modulation.0.weight": (8, 4)}, "dit", 1024),
        ({"foo.weight": (8, 4)}, "unknown", 512),
    ],
)
def test_native_size_by_architecture(shapes: dict, arch: str, size: int) -> None:
    h = _header(shapes)
    assert guess_architecture(h) == arch
    assert native_size_for(h) == (size, size)


def test_role_params_cover_every_role() -> None:
    assert set(ROLE_PARAMS) == {
        "checkpoint",
        "diffusion_model",
        "high_noise_diffusion_model",
        "clip_l",
        "clip_g",
        "t5xxl",
        "llm",
        "clip_vision",
        "vae",
        "taesd",
    }
    assert ROLE_PARAMS["checkpoint"] == "model_path"
    assert ROLE_PARAMS["clip_vision"] == "clip_vision_path"
