"""A random-weight SD 1.x model, ControlNet and textual-inversion embedding the runtime loads.

ControlNet applies only to the UNets of SD 1.x/2.x/XL in master-596 (src/control.hpp builds the
SD 1.x encoder half with 13 zero convolutions for the UNet's skips) and embeddings only to CLIP
text encoders (`FrozenCLIPEmbedderWithCustomWords`), so the tiny Ovis-Image model
(sdfarm.native.testmodel) can test neither. The runtime fixes SD 1.x's sizes (UNet 320
channels, CLIP ViT-L/14 12 layers, 768 wide), so this is the real architecture with random
weights. The smaller SD 1.x variants it detects (the tiny UNet of BK-SDM, SDXS) build the UNet
with one res block a level, three levels and no middle block, while the ControlNet stays the
full SD 1.x encoder (13 outputs, the middle one at 1/8 size): its outputs cannot be added to
that UNet's 6 skips (bench/controlnet_tiny_unet.py: the runtime aborts), so ControlNet
needs the full UNet.

To keep it small and fast to write and load:
- one GGUF checkpoint `sd1.gguf` (UNet `model.diffusion_model.*` + CLIP-L
  `cond_stage_model.transformer.text_model.*`), linear weights q4_0 (written as blocks of
  random 4-bit values under one small fp16 scale per tensor, so no float draws or quantising),
  convolution weights f16 (the runtime keeps convolutions in f16 whatever the file holds:
  quantised ones would be converted at every load), 1-D tensors f32, embedding tables f16;
- a TAESD (`taesd.safetensors`, 4-channel latents, encoder and decoder) instead of the 84M
  parameter KL VAE, as the VAE role: decoding (and encoding a control image) takes milliseconds;
- the ControlNet `controlnets/sd1-control.gguf` in the same form;
- embeddings `embeddings/sd1-emb.safetensors` (and a second, `sd1-emb2`): one tensor
  `emb_params` of shape [4, 768], the layout textual-inversion files have.

Every value is deterministic (seeded per tensor name), so the files are byte-identical on
every machine, and the folder is written once into a cache keyed by this generator's version
(`ensure_sd1_test_model`), where the tests and CI find it.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SEED = 20261201
VERSION = "sd1-q4-v1"
"""Bump when the files change: the cache folder is named after it."""
MODEL = "sd1-tiny"
CONTROLNET = "sd1-control"
EMBEDDINGS = ("sd1-emb", "sd1-emb2")
EMBEDDING_VECTORS = 4
NATIVE_SIZE = (512, 512)
QK4_0 = 32
CLIP_WIDTH = 768

Spec = tuple[str, tuple[int, ...], str]
"""(name, shape in PyTorch order, kind): kind "linear" (q4_0 when the row length allows),
"conv" (f16), "table" (f16 embedding table), "one", "zero"."""


# -- layouts ----------------------------------------------------------------------------------


def _linear(name: str, n_out: int, n_in: int, bias: bool = True) -> list[Spec]:
    out: list[Spec] = [(f"{name}.weight", (n_out, n_in), "linear")]
    return out + ([(f"{name}.bias", (n_out,), "zero")] if bias else [])


def _conv(name: str, n_out: int, n_in: int, k: int = 3, bias: bool = True) -> list[Spec]:
    out: list[Spec] = [(f"{name}.weight", (n_out, n_in, k, k), "conv")]
    return out + ([(f"{name}.bias", (n_out,), "zero")] if bias else [])


def _norm(name: str, n: int) -> list[Spec]:
    return [(f"{name}.weight", (n,), "one"), (f"{name}.bias", (n,), "zero")]


def _resblock(p: str, n_in: int, n_out: int, emb: int) -> list[Spec]:
    out = _norm(f"{p}.in_layers.0", n_in) + _conv(f"{p}.in_layers.2", n_out, n_in)
    out += _linear(f"{p}.emb_layers.1", n_out, emb)
    out += _norm(f"{p}.out_layers.0", n_out) + _conv(f"{p}.out_layers.3", n_out, n_out)
    if n_in != n_out:
        out += _conv(f"{p}.skip_connection", n_out, n_in, k=1)
    return out


def _transformer(p: str, ch: int, context: int) -> list[Spec]:
    """SD 1.x's SpatialTransformer: 1x1 convolutions in and out, one block, GEGLU."""
    b = f"{p}.transformer_blocks.0"
    out = _norm(f"{p}.norm", ch) + _conv(f"{p}.proj_in", ch, ch, k=1)
    for attn, kv in (("attn1", ch), ("attn2", context)):
        out += _linear(f"{b}.{attn}.to_q", ch, ch, bias=False)
        out += _linear(f"{b}.{attn}.to_k", ch, kv, bias=False)
        out += _linear(f"{b}.{attn}.to_v", ch, kv, bias=False)
        out += _linear(f"{b}.{attn}.to_out.0", ch, ch)
    out += _linear(f"{b}.ff.net.0.proj", ch * 8, ch) + _linear(f"{b}.ff.net.2", ch, ch * 4)
    for i in (1, 2, 3):
        out += _norm(f"{b}.norm{i}", ch)
    return out + _conv(f"{p}.proj_out", ch, ch, k=1)


MC, MULT, RES, ATTN, CONTEXT = 320, (1, 2, 4, 4), 2, (0, 1, 2), CLIP_WIDTH


def _encoder(p: str, zero_convs: bool) -> tuple[list[Spec], list[int], int]:
    """The UNet's time embedding, input blocks and middle block (the ControlNet copies them,
    with a zero convolution after each input block and the middle block)."""
    emb = MC * 4
    out = _linear(f"{p}time_embed.0", emb, MC) + _linear(f"{p}time_embed.2", emb, emb)
    out += _conv(f"{p}input_blocks.0.0", MC, 4)
    if zero_convs:
        out += _conv(f"{p}zero_convs.0.0", MC, MC, k=1)
    skips, ch, idx = [MC], MC, 1
    for level, mult in enumerate(MULT):
        for _ in range(RES):
            out += _resblock(f"{p}input_blocks.{idx}.0", ch, MC * mult, emb)
            ch = MC * mult
            if level in ATTN:
                out += _transformer(f"{p}input_blocks.{idx}.1", ch, CONTEXT)
            if zero_convs:
                out += _conv(f"{p}zero_convs.{idx}.0", ch, ch, k=1)
            skips.append(ch)
            idx += 1
        if level != len(MULT) - 1:
            out += _conv(f"{p}input_blocks.{idx}.0.op", ch, ch)
            if zero_convs:
                out += _conv(f"{p}zero_convs.{idx}.0", ch, ch, k=1)
            skips.append(ch)
            idx += 1
    out += _resblock(f"{p}middle_block.0", ch, ch, emb)
    out += _transformer(f"{p}middle_block.1", ch, CONTEXT)
    out += _resblock(f"{p}middle_block.2", ch, ch, emb)
    return out, skips, ch


def unet_specs(p: str = "model.diffusion_model.") -> list[Spec]:
    """The SD 1.x UNet (LDM names)."""
    out, skips, ch = _encoder(p, zero_convs=False)
    emb, idx = MC * 4, 0
    for level in reversed(range(len(MULT))):
        for i in range(RES + 1):
            blk = f"{p}output_blocks.{idx}"
            out += _resblock(f"{blk}.0", ch + skips.pop(), MC * MULT[level], emb)
            ch, sub = MC * MULT[level], 1
            if level in ATTN:
                out += _transformer(f"{blk}.1", ch, CONTEXT)
                sub = 2
            if level and i == RES:
                out += _conv(f"{blk}.{sub}.conv", ch, ch)
            idx += 1
    return out + _norm(f"{p}out.0", ch) + _conv(f"{p}out.2", 4, ch)


def tiny_unet_specs(p: str = "model.diffusion_model.") -> list[Spec]:
    """The SD 1.x tiny UNet (BK-SDM-Tiny) as unet.hpp builds it: one res block a level, three
    levels, no middle block, an index skipped after each level's res block (and at the second
    output upsample). Not part of the test model: bench/controlnet_tiny_unet.py shows the
    runtime aborting when it is given the SD 1.x ControlNet."""
    emb, mult = MC * 4, (1, 2, 4)
    out = _linear(f"{p}time_embed.0", emb, MC) + _linear(f"{p}time_embed.2", emb, emb)
    out += _conv(f"{p}input_blocks.0.0", MC, 4)
    skips, ch, idx = [MC], MC, 0
    for level, m in enumerate(mult):
        idx += 1
        out += _resblock(f"{p}input_blocks.{idx}.0", ch, MC * m, emb)
        ch = MC * m
        out += _transformer(f"{p}input_blocks.{idx}.1", ch, CONTEXT)
        skips.append(ch)
        idx += 1  # the tiny UNet skips an index
        if level != len(mult) - 1:
            idx += 1
            out += _conv(f"{p}input_blocks.{idx}.0.op", ch, ch)
            skips.append(ch)
    oidx = 0
    for level in reversed(range(len(mult))):
        for j in range(2):
            out += _resblock(f"{p}output_blocks.{oidx}.0", ch + skips.pop(), MC * mult[level], emb)
            ch = MC * mult[level]
            out += _transformer(f"{p}output_blocks.{oidx}.1", ch, CONTEXT)
            if level and j == 1:
                oidx += 1
                out += _conv(f"{p}output_blocks.{oidx}.{1 if oidx == 2 else 2}.conv", ch, ch)
            oidx += 1
    return out + _norm(f"{p}out.0", ch) + _conv(f"{p}out.2", 4, ch)


def controlnet_specs() -> list[Spec]:
    """An SD 1.x ControlNet as control.hpp builds it (names without `control_model.`)."""
    out, _, ch = _encoder("", zero_convs=True)
    hint = [(3, 16), (16, 16), (16, 32), (32, 32), (32, 96), (96, 96), (96, 256), (256, MC)]
    for i, (cin, cout) in enumerate(hint):
        out += _conv(f"input_hint_block.{2 * i}", cout, cin)
    return out + _conv("middle_block_out.0", ch, ch, k=1)


def clip_l_specs(p: str = "cond_stage_model.transformer.text_model.") -> list[Spec]:
    """OpenAI CLIP ViT-L/14's text model (Hugging Face names)."""
    w = CLIP_WIDTH
    out: list[Spec] = [
        (f"{p}embeddings.token_embedding.weight", (49408, w), "table"),
        (f"{p}embeddings.position_embedding.weight", (77, w), "table"),
    ]
    for i in range(12):
        r = f"{p}encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += _linear(f"{r}.self_attn.{proj}", w, w)
        out += _norm(f"{r}.layer_norm1", w) + _norm(f"{r}.layer_norm2", w)
        out += _linear(f"{r}.mlp.fc1", w * 4, w) + _linear(f"{r}.mlp.fc2", w, w * 4)
    return out + _norm(f"{p}final_layer_norm", w)


def taesd_specs(z: int = 4, channels: int = 64) -> list[Spec]:
    """TAESD (madebyollin) for 4-channel latents, decoder and encoder, as tae.hpp builds it."""
    from sdfarm.native.testmodel import tae_encoder_specs

    out: list[Spec] = []
    p = "decoder.layers"

    def block(i: int) -> list[Spec]:
        return [s for k in (0, 2, 4) for s in _conv(f"{p}.{i}.conv.{k}", channels, channels)]

    out += _conv(f"{p}.0", channels, z)
    idx = 2
    for stage in range(3):
        for _ in range(3):
            out += block(idx)
            idx += 1
        idx += 1
        out += _conv(f"{p}.{idx}", channels, channels, bias=False)
        idx += 1
        if stage == 2:
            out += block(idx)
            idx += 1
    out += _conv(f"{p}.{idx}", 3, channels)
    for name, shape in tae_encoder_specs(z_channels=z, channels=channels).items():
        out.append((name, shape, "conv" if len(shape) == 4 else "zero"))
    return out


# -- values -----------------------------------------------------------------------------------


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(name.encode())])


def _fan_in(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


def _f16(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random f16 values of about N(0, 1/fan_in), from random int8 (fast: no float draws)."""
    q = _rng(name).integers(-127, 128, size=shape, dtype=np.int8)
    scale = np.float16(1.0 / (73.0 * np.sqrt(_fan_in(shape))))  # int8 uniform: std ~73
    return q.astype(np.float16) * scale


def _q4_0(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """q4_0 blocks (2-byte fp16 scale + 16 bytes of nibbles per 32 values) of uniform random
    4-bit values under one fixed scale giving about N(0, 1/fan_in): uint8 rows as ggml stores
    them."""
    n_out, n_in = shape
    blocks = n_in // QK4_0
    data = _rng(name).integers(0, 256, size=(n_out, blocks, 18), dtype=np.uint8)
    d = np.float16(1.0 / (4.6 * np.sqrt(n_in)))  # (q - 8) for uniform q in 0..15: std ~4.6
    data[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    return data.reshape(n_out, blocks * 18)


def _value(name: str, shape: tuple[int, ...], kind: str) -> tuple[np.ndarray, bool]:
    """(array, is q4_0)."""
    if kind == "one":
        return np.ones(shape, dtype=np.float32), False
    if kind == "zero":
        return np.zeros(shape, dtype=np.float32), False
    if kind == "linear" and shape[-1] % QK4_0 == 0:
        return _q4_0(name, shape), True
    if kind == "linear" and len(shape) == 1:
        return np.zeros(shape, dtype=np.float32), False
    return _f16(name, shape), False


# -- files ------------------------------------------------------------------------------------


def write_gguf(path: Path, specs: list[Spec], arch: str) -> Path:
    """Stream `specs` into a GGUF file (header first, then each tensor as it is made)."""
    import gguf

    from sdfarm.native.testmodel import _write_atomically

    q4 = gguf.GGMLQuantizationType.Q4_0

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch=arch)
        writer.add_name(f"sdfarm random-weight {arch}, seed {SEED}")
        for name, shape, kind in specs:
            quant = kind == "linear" and shape[-1] % QK4_0 == 0 and len(shape) == 2
            if quant:
                row = shape[1] // QK4_0 * 18  # the writer takes the shape in bytes
                writer.add_tensor_info(
                    name, (shape[0], row), np.dtype(np.uint8), shape[0] * row, raw_dtype=q4
                )
            else:
                dtype = np.float32 if kind in ("one", "zero") else np.float16
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, kind in specs:
            value, _ = _value(name, shape, kind)
            writer.write_tensor_data(value)
        writer.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, write)
    return path


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], note: str) -> Path:
    from safetensors.numpy import save_file

    from sdfarm.native.testmodel import _write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"sdfarm": note}))
    return path


def _values(specs: list[Spec]) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape, kind in specs:
        yield name, _value(name, shape, "conv" if kind == "linear" else kind)[0]


def make_sd1_test_model(out_dir: str | os.PathLike[str]) -> Path:
    """Write into `out_dir`: `sd1-tiny/` (sd1.gguf, taesd.safetensors, model.json),
    `controlnets/sd1-control.gguf` and `embeddings/sd1-emb*.safetensors`; returns the model
    folder."""
    from sdfarm.native.catalog import CONTROLNETS_FOLDER, EMBEDDINGS_FOLDER
    from sdfarm.native.testmodel import _write_atomically

    out = Path(out_dir)
    folder = out / MODEL
    write_gguf(folder / "sd1.gguf", unet_specs() + clip_l_specs(), "sdfarm-sd1")
    write_safetensors(
        folder / "taesd.safetensors", dict(_values(taesd_specs())), f"sdfarm TAESD, seed {SEED}"
    )
    manifest = {
        "files": {"checkpoint": "sd1.gguf", "taesd": "taesd.safetensors"},
        "native_size": list(NATIVE_SIZE),
    }
    text = json.dumps(manifest, indent=2) + "\n"
    _write_atomically(folder / "model.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    write_gguf(out / CONTROLNETS_FOLDER / f"{CONTROLNET}.gguf", controlnet_specs(), "sdfarm-cn")
    for name in EMBEDDINGS:
        emb = _rng(f"embedding/{name}").standard_normal((EMBEDDING_VECTORS, CLIP_WIDTH))
        write_safetensors(
            out / EMBEDDINGS_FOLDER / f"{name}.safetensors",
            {"emb_params": (0.02 * emb).astype(np.float32)},
            f"sdfarm random textual inversion, seed {SEED}",
        )
    return folder


def cache_root() -> Path:
    """Where generated test models are kept between runs: `testmodels/` in the runtime's
    cache (sdfarm.native.build.cache_root: `$SDFARM_CACHE` or ~/.cache/sdfarm), which CI
    keeps for the build anyway."""
    from sdfarm.native.build import cache_root as build_cache

    return build_cache() / "testmodels"


def ensure_sd1_test_model(root: str | os.PathLike[str] | None = None) -> Path:
    """The models directory holding the SD 1.x test model, its ControlNet and embeddings,
    written once into the cache (`cache_root()/VERSION`) and reused after: writing takes
    seconds, not minutes, but the files are 800 MB. A folder is complete when its `done`
    marker exists (a writer that died leaves no marker, and the next call writes again)."""
    base = Path(root) if root is not None else cache_root()
    final = base / VERSION
    if (final / "done").exists():
        return final
    tmp = base / f".{VERSION}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make_sd1_test_model(tmp)
    (tmp / "done").write_text(VERSION + "\n", encoding="utf-8")
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "done").exists():
            raise
    return final
