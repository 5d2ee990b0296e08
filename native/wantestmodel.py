"""A random-weight Wan 2.1 text-to-video model of the real size, the video model the runtime loads.

The runtime's Wan DiT takes its layer count from the tensors but builds only the two real
widths (30 layers: Wan 2.1 1.3B, dim 1536; 40 layers: the 14B models; any other count aborts
the process, src/wan.hpp of master-596), and the Wan VAE has one fixed size. No tiny Wan can
load, so the video tests use one of the real architecture, kept small:

- `dit.gguf`: Wan2.1-T2V-1.3B (30 blocks, dim 1536, ffn 8960, 12 heads; 1.42 B parameters).
  Linear weights q4_0 (random 4-bit values under a fixed f16 scale per tensor, so that
  x ~ N(0, 1/fan_in) in spread: no float data is drawn or quantised for 1.4 B weights), the
  patch embedding f16 (the runtime's Conv3d is f16), norms, biases and modulations f32.
- `vae.safetensors`: the Wan 2.1 VAE (encoder and decoder, 127 M parameters) in f16, 5-D
  convolution shapes as the original file has them; norm gains 1, biases 0, weights
  N(0, 1/fan_in).
- no text encoder: the runtime's Wan conditioner runs without umT5-XXL (4.6 B parameters, fixed)
  and conditions on zeros, so the prompt is ignored (the job's warnings say so).
- `wan-vace-test`: the same DiT plus one VACE block and the VACE patch embedding: the runtime
  reads it as Wan2.1-VACE-1.3B, which takes an init image (its reference image).

Deterministic (each tensor from its own seeded generator): the same bytes on every run.
`cached_wan_test_model()` writes it once under the runtime's cache folder, keyed by this
generator's version, so tests and CI pay the write once.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SEED = 20261201
VERSION = "1"  # bump when the bytes written change: the cache key
NAME = "wan-t2v-test"
NATIVE_SIZE = (64, 64)
DIT_FILE = "dit.gguf"
VAE_FILE = "vae.safetensors"

# Wan2.1-T2V-1.3B (WanRunner in src/wan.hpp): the runtime fixes these for a 30-layer model.
LAYERS = 30
DIM = 1536
FFN_DIM = 8960
FREQ_DIM = 256
TEXT_DIM = 4096
IN_DIM = 16
OUT_DIM = 16
PATCH = (1, 2, 2)
VACE_IN_DIM = 96
VACE_NAME = "wan-vace-test"
VACE_LAYERS = 1
"""The VACE test model's VACE blocks: the real VACE 1.3B has 15 (one every second layer); the
runtime maps any count evenly over the 30 layers, and one keeps the file small."""

Q4_0_BLOCK = 32
Q4_0_BYTES = 18  # f16 scale + 16 bytes of 4-bit values
Q4_0_SPREAD = 4.61  # standard deviation of (q - 8) for q uniform on 0..15


def dit_specs(layers: int = LAYERS, vace_layers: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (PyTorch shape, kind)} of the T2V DiT, names as in the original file (the runtime
    prefixes `model.diffusion_model.`). kind: "linear" (q4_0), "conv" (f16), "f32".
    `vace_layers` > 0 adds that many VACE blocks and the VACE patch embedding (a VACE model,
    which reads a reference image; the real VACE 1.3B has 15, the runtime takes any count)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def linear(name: str, fin: int, fout: int) -> None:
        out[f"{name}.weight"] = ((fout, fin), "linear")
        out[f"{name}.bias"] = ((fout,), "f32")

    def block(b: str) -> None:
        out[f"{b}.modulation"] = ((1, 6, DIM), "f32")
        for attn in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o"):
                linear(f"{b}.{attn}.{p}", DIM, DIM)
            out[f"{b}.{attn}.norm_q.weight"] = ((DIM,), "f32")
            out[f"{b}.{attn}.norm_k.weight"] = ((DIM,), "f32")
        out[f"{b}.norm3.weight"] = ((DIM,), "f32")
        out[f"{b}.norm3.bias"] = ((DIM,), "f32")
        linear(f"{b}.ffn.0", DIM, FFN_DIM)
        linear(f"{b}.ffn.2", FFN_DIM, DIM)

    # The runtime's Conv3d weight is 4-D [kw, kh, kd, in*out]; GGUF holds at most 4 dims.
    out["patch_embedding.weight"] = ((DIM * IN_DIM, *PATCH), "conv")
    out["patch_embedding.bias"] = ((DIM,), "f32")
    linear("text_embedding.0", TEXT_DIM, DIM)
    linear("text_embedding.2", DIM, DIM)
    linear("time_embedding.0", FREQ_DIM, DIM)
    linear("time_embedding.2", DIM, DIM)
    linear("time_projection.1", DIM, DIM * 6)
    for i in range(layers):
        block(f"blocks.{i}")
    out["head.modulation"] = ((1, 2, DIM), "f32")
    linear("head.head", DIM, OUT_DIM * PATCH[0] * PATCH[1] * PATCH[2])
    for i in range(vace_layers):
        block(f"vace_blocks.{i}")
        if i == 0:
            linear(f"vace_blocks.{i}.before_proj", DIM, DIM)
        linear(f"vace_blocks.{i}.after_proj", DIM, DIM)
    if vace_layers:
        out["vace_patch_embedding.weight"] = ((DIM * VACE_IN_DIM, *PATCH), "conv")
        out["vace_patch_embedding.bias"] = ((DIM,), "f32")
    return out


def vae_specs() -> dict[str, tuple[int, ...]]:
    """{name: PyTorch shape} of the Wan 2.1 VAE (WanVAE in src/wan.hpp: dim 96, z 16, dim_mult
    1 2 4 4, two residual blocks per level), encoder included, names as in the original file."""
    out: dict[str, tuple[int, ...]] = {}
    dim, z_dim, mult = 96, 16, (1, 2, 4, 4)

    def conv3d(name: str, cin: int, cout: int, k: tuple[int, int, int] = (3, 3, 3)) -> None:
        out[f"{name}.weight"] = (cout, cin, *k)
        out[f"{name}.bias"] = (cout,)

    def conv2d(name: str, cin: int, cout: int, k: int) -> None:
        out[f"{name}.weight"] = (cout, cin, k, k)
        out[f"{name}.bias"] = (cout,)

    def residual(name: str, cin: int, cout: int) -> None:
        out[f"{name}.residual.0.gamma"] = (cin, 1, 1, 1)
        conv3d(f"{name}.residual.2", cin, cout)
        out[f"{name}.residual.3.gamma"] = (cout, 1, 1, 1)
        conv3d(f"{name}.residual.6", cout, cout)
        if cin != cout:
            conv3d(f"{name}.shortcut", cin, cout, (1, 1, 1))

    def attention(name: str, c: int) -> None:
        out[f"{name}.norm.gamma"] = (c, 1, 1)
        conv2d(f"{name}.to_qkv", c, c * 3, 1)
        conv2d(f"{name}.proj", c, c, 1)

    def middle(prefix: str, c: int) -> None:
        residual(f"{prefix}.middle.0", c, c)
        attention(f"{prefix}.middle.1", c)
        residual(f"{prefix}.middle.2", c, c)

    # Encoder3d: temporal downsampling at levels 1 and 2.
    dims = [dim] + [dim * m for m in mult]
    conv3d("encoder.conv1", 3, dims[0])
    index = 0
    for i in range(len(mult)):
        cin, cout = dims[i], dims[i + 1]
        for _ in range(2):
            residual(f"encoder.downsamples.{index}", cin, cout)
            cin = cout
            index += 1
        if i != len(mult) - 1:
            conv2d(f"encoder.downsamples.{index}.resample.1", cout, cout, 3)
            if i in (1, 2):
                conv3d(f"encoder.downsamples.{index}.time_conv", cout, cout, (3, 1, 1))
            index += 1
    middle("encoder", dims[-1])
    out["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv3d("encoder.head.2", dims[-1], z_dim * 2)
    conv3d("conv1", z_dim * 2, z_dim * 2, (1, 1, 1))

    # Decoder3d: temporal upsampling at levels 0 and 1; levels 1-3 take half the channels in.
    ddims = [dim * mult[-1]] + [dim * m for m in reversed(mult)]
    conv3d("decoder.conv1", z_dim, ddims[0])
    middle("decoder", ddims[0])
    index = 0
    for i in range(len(mult)):
        cin, cout = ddims[i], ddims[i + 1]
        if i in (1, 2, 3):
            cin //= 2
        for _ in range(3):
            residual(f"decoder.upsamples.{index}", cin, cout)
            cin = cout
            index += 1
        if i != len(mult) - 1:
            conv2d(f"decoder.upsamples.{index}.resample.1", cout, cout // 2, 3)
            if i in (0, 1):
                conv3d(f"decoder.upsamples.{index}.time_conv", cout, cout * 2, (3, 1, 1))
            index += 1
    out["decoder.head.0.gamma"] = (ddims[-1], 1, 1, 1)
    conv3d("decoder.head.2", ddims[-1], 3)
    conv3d("conv2", z_dim, z_dim, (1, 1, 1))
    return out


def _rng(part: str, name: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(f"{part}/{name}".encode())])


def _float_weight(part: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Norm gains 1, biases 0, others N(0, 1/fan_in) (fan_in: all dims but the first)."""
    if name.endswith(".bias"):
        return np.zeros(shape, dtype=np.float32)
    if name.endswith("gamma") or (len(shape) == 1 and "norm" in name):
        return np.ones(shape, dtype=np.float32)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    w = _rng(part, name).standard_normal(shape, dtype=np.float32)
    w *= np.float32(1.0 / np.sqrt(fan_in))
    return w


def _q4_0_weight(name: str, shape: tuple[int, int]) -> np.ndarray:
    """Rows of q4_0 blocks as bytes: a fixed f16 scale d with d * 4.61 = 1/sqrt(fan_in), then
    16 bytes of random 4-bit values (value = d * (q - 8))."""
    rows, cols = shape
    blocks = rows * cols // Q4_0_BLOCK
    d = np.float16(1.0 / (np.sqrt(cols) * Q4_0_SPREAD))
    data = np.empty((blocks, Q4_0_BYTES), dtype=np.uint8)
    data[:, :2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    data[:, 2:] = np.frombuffer(_rng("dit", name).bytes(blocks * 16), dtype=np.uint8).reshape(
        blocks, 16
    )
    return data.reshape(rows, cols // Q4_0_BLOCK * Q4_0_BYTES)


def _dit_tensors(layers: int, vace_layers: int = 0) -> Iterator[tuple[str, np.ndarray, object]]:
    import gguf

    q4_0 = gguf.GGMLQuantizationType.Q4_0
    for name, (shape, kind) in dit_specs(layers, vace_layers).items():
        if kind == "linear":
            yield name, _q4_0_weight(name, shape), q4_0  # type: ignore[arg-type]
        elif kind == "conv":
            yield name, _float_weight("dit", name, shape).astype(np.float16), None
        else:
            yield name, _float_weight("dit", name, shape), None


def write_dit(path: Path, layers: int = LAYERS, vace_layers: int = 0) -> None:
    """The DiT as GGUF, streamed tensor by tensor (peak memory: the largest tensor)."""
    import gguf

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        writer = gguf.GGUFWriter(str(tmp), arch="sdfarm-wan-test")
        writer.add_name(f"sdfarm random-weight Wan2.1 T2V test model, seed {SEED}")
        for name, arr, raw in _dit_tensors(layers, vace_layers):  # shapes first
            writer.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=raw)  # type: ignore[arg-type]
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _name, arr, _raw in _dit_tensors(layers, vace_layers):
            writer.write_tensor_data(arr)
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_vae(path: Path) -> None:
    from safetensors.numpy import save_file

    tensors = {
        n: (w.astype(np.float16) if w.ndim >= 2 else w)
        for n, w in ((n, _float_weight("vae", n, s)) for n, s in vae_specs().items())
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"sdfarm": f"random-weight Wan 2.1 VAE, seed {SEED}"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


VARIANTS: dict[str, int] = {NAME: 0, VACE_NAME: VACE_LAYERS}
"""The test models: folder name -> VACE blocks (0: text-to-video)."""


def make_wan_test_model(out_dir: str | os.PathLike[str], name: str = NAME) -> Path:
    """Write `out_dir/NAME/` (dit.gguf, vae.safetensors, model.json) for a name of VARIANTS
    and return it. The VAE is the same file for every variant: hard-linked from a sibling
    variant's folder when one has it."""
    folder = Path(out_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    write_dit(folder / DIT_FILE, LAYERS, VARIANTS[name])
    vae = folder / VAE_FILE
    siblings = [Path(out_dir) / n / VAE_FILE for n in VARIANTS if n != name]
    for sibling in siblings:
        if sibling.exists() and not vae.exists():
            with contextlib.suppress(OSError):  # another filesystem: written below
                os.link(sibling, vae)
    if not vae.exists():
        write_vae(vae)
    manifest = {
        "files": {"diffusion_model": DIT_FILE, "vae": VAE_FILE},
        "native_size": list(NATIVE_SIZE),
    }
    (folder / "model.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return folder


def cache_dir() -> Path:
    from sdfarm.native.build import cache_root

    return cache_root() / "testmodels" / f"wan-v{VERSION}-{SEED}"


def cached_wan_test_model(name: str = NAME) -> Path:
    """Test model `name`'s folder under the runtime's cache, written on first use (about
    1 GB for the first, 0.8 GB more for the VACE one, which shares the VAE; a second writer
    racing the first replaces whole files, never half ones)."""
    root = cache_dir()
    folder = root / name
    done = root / f".complete-{name}"
    if not done.exists():
        make_wan_test_model(root, name)
        done.write_text(VERSION + "\n", encoding="utf-8")
    return folder
