"""What `sdfarm convert` needs and when it refuses (sdfarm.native.convertmem): the output size
from the headers by the runtime's own rule of which tensors it converts, the memory rule on a
scenario table of host figures, and a refusal that starts nothing and writes nothing. Host
memory and disk come from injected probes."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdfarm.native.convert import convert_model, convert_need, plan
from sdfarm.native.convertmem import (
    CONVERT_BASE,
    HEADER_MARGIN,
    ConvertNeed,
    converted,
    output_bytes,
    refusal,
    tensor_bytes,
    working_bytes,
)
from sdfarm.native.errors import ModelTooLargeError
from sdfarm.native.headers import FileHeader, TensorInfo

GiB = 1 << 30


def test_tensor_bytes_in_whole_blocks() -> None:
    assert tensor_bytes((64, 128), "f16") == 64 * 128 * 2
    assert tensor_bytes((64, 128), "q8_0") == 64 * 4 * 34  # 4 blocks of 32 a row
    assert tensor_bytes((320, 1280), "q4_k") == 320 * 5 * 144


@pytest.mark.parametrize(
    ("name", "shape", "type_name", "expected"),
    [("blocks.0.attn.qkv.weight", (384, 128), "q8_0", True),
     ("blocks.0.attn.qkv.bias", (384,), "f16", False),  # biases stay
     ("blocks.0.norm.scale", (128,), "f32", False),
     ("img_in.weight", (128, 64), "q8_0", False),  # Flux's input layer stays
     ("token_embedding.weight", (1000, 64), "q8_0", False),
     ("blocks.0.mlp.weight", (128, 48), "q8_0", False),  # rows of 48: not whole 32-blocks
     ("blocks.0.mlp.weight", (128, 128), "q4_k", False),  # nor whole 256-blocks
     ("blocks.0.mlp.weight", (128, 48), "f16", True)],
)  # fmt: skip
def test_which_tensors_the_runtime_converts(
    name: str, shape: tuple[int, ...], type_name: str, expected: bool
) -> None:
    assert converted(name, shape, type_name) is expected


def test_output_bytes_follow_rules_and_keep_what_the_runtime_keeps() -> None:
    tensors = {"a.weight": TensorInfo("F16", (64, 128), 64 * 128 * 2),
               "a.bias": TensorInfo("F32", (64,), 256),
               "vae.w": TensorInfo("F16", (64, 128), 64 * 128 * 2)}  # fmt: skip
    header = FileHeader("safetensors", tensors, 0, 0, 0)
    q8 = tensor_bytes((64, 128), "q8_0")
    assert output_bytes(header, "q8_0") == 2 * q8 + 256
    assert output_bytes(header, "q8_0", [(r"^vae\.", "f16")]) == q8 + 256 + 64 * 128 * 2


NEED = ConvertNeed(memory=3 * GiB, disk=2 * GiB)


@pytest.mark.parametrize(
    ("memory", "disk", "refused"),
    [(16 * GiB, 100 * GiB, None),
     (3 * GiB, 2 * GiB, None),  # exactly enough
     (3 * GiB - 1, 100 * GiB, "memory"),
     (2 * GiB, 1 * GiB, "memory"),  # memory is named first
     (16 * GiB, 2 * GiB - 1, "disk"),
     (None, None, None),  # unknown figures: not checked
     (None, 1 * GiB, "disk")],
)  # fmt: skip
def test_the_refusal_rule_on_host_figures(
    memory: int | None, disk: int | None, refused: str | None
) -> None:
    why = refusal(NEED, memory, disk)
    if refused is None:
        assert why is None
    elif refused == "memory":
        assert why is not None and "needs about 3.00 GiB of memory" in why
        assert f"has {memory / GiB:.2f} GiB available" in why
    else:
        assert why is not None and "needs about 2.00 GiB of disk" in why


def test_a_models_need_is_its_largest_result_and_buffers_plus_base_and_all_files_on_disk(
    tiny_models: list[Path],
) -> None:
    p = plan("tiny-f16", "q8_0", [str(tiny_models[0].parent)], "tiny-need")
    need = convert_need(p, threads=2)
    converted_files = [p.model.files[f.role].header for f in p.files if f.action == "convert"]
    results = [output_bytes(h, "q8_0") for h in converted_files]
    peaks = [
        r + working_bytes(h, "q8_0", (), 2) for r, h in zip(results, converted_files, strict=True)
    ]
    copied = sum(p.model.files[f.role].size for f in p.files if f.action == "copy")
    assert need.memory == max(peaks) + CONVERT_BASE
    assert need.disk == sum(results) + HEADER_MARGIN * len(results) + copied
    assert need.disk < p.model.total_bytes  # q8_0 of f16 weights shrinks
    assert convert_need(p, threads=8).memory > need.memory  # more loader threads, more buffers


def test_the_buffers_are_the_largest_converted_tensors_one_per_thread() -> None:
    tensors = {"big.weight": TensorInfo("F16", (256, 256), 256 * 256 * 2),
               "mid.weight": TensorInfo("F16", (128, 256), 128 * 256 * 2),
               "same.weight": TensorInfo("Q8_0", (512, 512), tensor_bytes((512, 512), "q8_0")),
               "big.bias": TensorInfo("F32", (4096,), 4096 * 4)}  # fmt: skip
    header = FileHeader("safetensors", tensors, 0, 0, 0)
    big, mid = 256 * 256 * (2 + 4), 128 * 256 * (2 + 4)  # source bytes + the f32 copy
    assert working_bytes(header, "q8_0", (), 1) == big  # q8_0 already and biases: read as is
    assert working_bytes(header, "q8_0", (), 2) == big + mid == working_bytes(header, "q8_0", (), 9)


@pytest.mark.parametrize(
    ("memory", "disk", "what"),
    [(64 << 20, None, "of memory"), (None, 1 << 20, "of disk")],
)
def test_a_refused_conversion_starts_no_child_and_writes_nothing(
    tiny_models: list[Path], memory: int | None, disk: int | None, what: str
) -> None:
    folder = tiny_models[0].parent
    before = sorted(p.name for p in folder.iterdir())
    p = plan("tiny-f16", "q8_0", [str(folder)], "tiny-refused")
    with pytest.raises(ModelTooLargeError) as err:
        convert_model(p, available_memory=lambda: memory, free_disk=lambda _f: disk)
    assert "cannot convert model tiny-f16 to q8_0" in str(err.value) and what in str(err.value)
    assert err.value.estimate == convert_need(p).memory
    assert sorted(p.name for p in folder.iterdir()) == before
