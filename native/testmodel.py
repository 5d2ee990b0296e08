"""The tiny random-weight Ovis-Image model that the runtime really loads.

No weights can be downloaded on the machines that test sdfarm, so the end-to-end tests and
`sdfarm make-test-model DIR` build one: a Flux-style DiT (one double and one single block,
hidden 128), a one-layer Qwen3 text encoder (vocabulary kept at 151936 to cover the runtime's
built-in tokenizer) and a TAESD (decoder and encoder) for 16-channel latents. The runtime
infers every size from the tensor shapes, listed in `data/ovis-tiny-tensors.json` (PyTorch
order, names without sd.cpp's per-role prefixes; the encoder's are `tae_encoder_specs`).

Two folders are written, both loadable as models (`Model.from_dir`), a LoRA for them
(`loras/tiny-lora.safetensors`, sdfarm.native.loras) and two one-block ESRGAN upscalers
(`upscalers/tiny-esrgan-x2` and `-x4`, sdfarm.native.upscalers):
- `tiny-f16/`: safetensors, 2-D and larger tensors f16, 1-D f32;
- `tiny-q8_0/`: GGUF, 2-D and larger tensors q8_0 where the row length is a multiple of 32
  (else f16), 1-D f32: the quantised path through the runtime.

Weights are deterministic (each tensor from its own seeded generator), so the bytes are the
same on every run and every machine: norm gains 1, biases 0, other weights N(0, 1/fan_in),
which keeps activations finite through the random network (it draws noise, per seed).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from sdfarm.native.catalog import UPSCALERS_FOLDER

TENSORS_JSON = Path(__file__).parent / "data" / "ovis-tiny-tensors.json"
SEED = 20261129
NATIVE_SIZE = (256, 256)
# Component in the JSON -> (file stem, role).
PARTS: dict[str, tuple[str, str]] = {
    "dit": ("dit", "diffusion_model"),
    "llm": ("llm", "llm"),
    "tae": ("taesd", "taesd"),
}
Q8_0_BLOCK = 32
VARIANTS = ("tiny-f16", "tiny-q8_0")


def tensor_specs() -> dict[str, dict[str, tuple[int, ...]]]:
    """{component: {tensor name: shape}} from the shipped JSON plus the TAESD's encoder, names
    sorted."""
    doc = json.loads(TENSORS_JSON.read_text(encoding="utf-8"))
    doc["tae"] = {**doc["tae"], **tae_encoder_specs()}
    return {part: {n: tuple(doc[part][n]) for n in sorted(doc[part])} for part in PARTS}


def tae_encoder_specs(
    z_channels: int = 16, channels: int = 64, blocks: int = 3
) -> dict[str, tuple[int, ...]]:
    """The TAESD encoder the runtime builds for a 16-channel-latent model (TinyEncoder in
    src/tae.hpp of master-596): a conv from RGB, a block, then three stride-2 convs each
    followed by `blocks` residual blocks of three convs, and a conv to the latent channels.
    With it the tiny model can encode an image (img2img, inpainting)."""
    out: dict[str, tuple[int, ...]] = {}

    def conv(index: str, cin: int, cout: int, bias: bool = True) -> None:
        out[f"encoder.layers.{index}.weight"] = (cout, cin, 3, 3)
        if bias:
            out[f"encoder.layers.{index}.bias"] = (cout,)

    def block(index: int) -> None:
        for j in (0, 2, 4):
            conv(f"{index}.conv.{j}", channels, channels)

    conv("0", 3, channels)
    block(1)
    index = 2
    for _ in range(3):
        conv(str(index), channels, channels, bias=False)
        for i in range(index + 1, index + 1 + blocks):
            block(i)
        index += 1 + blocks
    conv(str(index), channels, z_channels)
    return out


def init_weight(part: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor's float32 initial value: norm gains 1, biases 0, other weights N(0, 1/fan_in)
    with fan_in the product of all dims but the first. The generator is seeded from the
    component and the name, so a tensor does not depend on the order it is made in."""
    if len(shape) == 1 and "norm" in name:
        return np.ones(shape, dtype=np.float32)
    if name.endswith(".bias"):
        return np.zeros(shape, dtype=np.float32)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    rng = np.random.default_rng([SEED, zlib.crc32(f"{part}/{name}".encode())])
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= np.float32(1.0 / np.sqrt(fan_in))
    return w


def _weights(part: str, specs: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape in specs.items():
        yield name, init_weight(part, name, shape)


def _write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a hidden temporary file then rename, so a reader (or a crash) never
    sees half a model file and a second run replaces the first cleanly. The temporary name is
    this process's own: two processes writing the same file at once (two test workers on a
    fresh cache) must not rename each other's half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        # The safetensors writer creates files readable by their owner only; workers may run
        # as another user, and these weights are no secret.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write_safetensors(path: Path, part: str, specs: dict[str, tuple[int, ...]]) -> None:
    from safetensors.numpy import save_file

    tensors = {
        name: (w.astype(np.float16) if w.ndim >= 2 else w) for name, w in _weights(part, specs)
    }
    # One key only: the safetensors library writes __metadata__ from a hash map, whose order
    # (and so the file's bytes) changes from run to run when it holds more than one entry.
    metadata = {"sdfarm": f"tiny random-weight test model, seed {SEED}"}
    _write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _write_gguf(path: Path, part: str, specs: dict[str, tuple[int, ...]]) -> None:
    import gguf
    from gguf.quants import quantize

    q8_0 = gguf.GGMLQuantizationType.Q8_0

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch=f"sdfarm-tiny-{PARTS[part][0]}")
        writer.add_name("sdfarm tiny random-weight test model")
        for name, w in _weights(part, specs):
            if w.ndim >= 2 and w.shape[-1] % Q8_0_BLOCK == 0:
                # quantize() returns uint8 rows of blocks; the writer derives the element
                # shape from those bytes and, like for plain arrays, reverses the numpy
                # shape into ggml's dims, so the dims read back equal the safetensors shape.
                writer.add_tensor(name, quantize(w, q8_0), raw_dtype=q8_0)
            elif w.ndim >= 2:
                writer.add_tensor(name, w.astype(np.float16))
            else:
                writer.add_tensor(name, w)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    _write_atomically(path, write)


def _write_manifest(folder: Path, suffix: str) -> None:
    manifest = {
        "files": {role: f"{stem}{suffix}" for stem, role in PARTS.values()},
        "native_size": list(NATIVE_SIZE),
    }
    text = json.dumps(manifest, indent=2) + "\n"
    _write_atomically(folder / "model.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))


def make_test_model(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write `out_dir/tiny-f16/` and `out_dir/tiny-q8_0/` (three weight files and a
    model.json each) and return the two folders. Idempotent: the same bytes every run."""
    out = Path(out_dir)
    specs = tensor_specs()
    folders = []
    for variant, suffix, writer in (
        ("tiny-f16", ".safetensors", _write_safetensors),
        ("tiny-q8_0", ".gguf", _write_gguf),
    ):
        folder = out / variant
        folder.mkdir(parents=True, exist_ok=True)
        for part, (stem, _role) in PARTS.items():
            writer(folder / f"{stem}{suffix}", part, specs[part])
        _write_manifest(folder, suffix)
        folders.append(folder)
    make_test_lora(out / "loras" / f"{TEST_LORA}.safetensors", specs["dit"])
    for name, (scale, layout) in TEST_UPSCALERS.items():
        make_test_upscaler(out / UPSCALERS_FOLDER / f"{name}.safetensors", scale, layout)
    return folders


VAE_VARIANT = "tiny-vae"
"""A third folder (`make_vae_test_model`): tiny-f16's files plus a full VAE (`vae.safetensors`),
so a job can choose its decoder (sdfarm.native.decoders): the VAE by default, the TAESD on
request. Not written by `make_test_model`, whose two folders every other test lists."""
VAE_CH = 32
"""The tiny VAE decoder's base width. master-596 infers the decoder's width from
`decoder.conv_in.weight` (AutoEncoderKLModel.detect_decoder_ch: its output channels over the
last ch_mult, 4) and keeps SD's layout (ch_mult 1, 2, 4, 4; two res blocks a level plus one;
one attention block in the middle); GroupNorm32 needs multiples of 32, so 32 is the least:
128/128/64/32 channels per level, 3.1 M parameters (6.3 MB in f16) against the real one's 49 M.
Its encoder's width is fixed at 128 (34 M parameters), so the tiny VAE has no encoder: its
engine cannot encode (img2img goes through the TAESD engine, which can)."""


def vae_decoder_specs(
    z_channels: int = 16, ch: int = VAE_CH, ch_mult: tuple[int, ...] = (1, 2, 4, 4),
    res_blocks: int = 2,
) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """The KL VAE decoder master-596 builds for a 16-channel-latent model (Decoder in
    src/auto_encoder_kl.hpp: conv_in, a middle of resnet + attention + resnet, per level from
    the deepest `res_blocks + 1` resnets and an upsample, norm_out, conv_out), in PyTorch
    order. Flux-style latents (16 channels) have no post_quant_conv."""
    out: dict[str, tuple[int, ...]] = {}

    def conv(name: str, cin: int, cout: int, k: int = 3) -> None:
        out[f"decoder.{name}.weight"] = (cout, cin, k, k)
        out[f"decoder.{name}.bias"] = (cout,)

    def norm(name: str, c: int) -> None:
        out[f"decoder.{name}.weight"] = (c,)
        out[f"decoder.{name}.bias"] = (c,)

    def resnet(name: str, cin: int, cout: int) -> None:
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cin, cout)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    block_in = ch * ch_mult[-1]
    conv("conv_in", z_channels, block_in)
    resnet("mid.block_1", block_in, block_in)
    norm("mid.attn_1.norm", block_in)
    for proj in ("q", "k", "v", "proj_out"):
        conv(f"mid.attn_1.{proj}", block_in, block_in, 1)
    resnet("mid.block_2", block_in, block_in)
    for i in reversed(range(len(ch_mult))):
        block_out = ch * ch_mult[i]
        for j in range(res_blocks + 1):
            resnet(f"up.{i}.block.{j}", block_in, block_out)
            block_in = block_out
        if i:
            conv(f"up.{i}.upsample.conv", block_in, block_in)
    norm("norm_out", block_in)
    conv("conv_out", block_in, 3)
    return dict(sorted(out.items()))


def _write_vae(path: Path, ch: int = VAE_CH) -> None:
    """The VAE decoder of base width `ch`, drawn like the model's weights (norm gains 1,
    biases 0)."""
    from safetensors.numpy import save_file

    specs = vae_decoder_specs(ch=ch)
    tensors = {n: (w.astype(np.float16) if w.ndim >= 2 else w) for n, w in _weights("vae", specs)}
    metadata = {"sdfarm": f"tiny random-weight test VAE, seed {SEED}"}
    _write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def make_vae_test_model(
    out_dir: str | os.PathLike[str], vae_ch: int = VAE_CH, name: str = VAE_VARIANT
) -> Path:
    """Write `out_dir/tiny-vae/`: tiny-f16's diffusion model, text encoder and TAESD plus the
    tiny VAE (`vae_decoder_specs`), and a model.json naming all four; returns the folder. The
    same bytes every run. `vae_ch` 128 writes the real VAE decoder's width (49 M parameters,
    98 MB), for measuring decode times (bench/decoder_quality.py)."""
    folder = Path(out_dir) / name
    folder.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs()
    files = {}
    for part, (stem, role) in PARTS.items():
        _write_safetensors(folder / f"{stem}.safetensors", part, specs[part])
        files[role] = f"{stem}.safetensors"
    _write_vae(folder / "vae.safetensors", vae_ch)
    files["vae"] = "vae.safetensors"
    manifest = {"files": files, "native_size": list(NATIVE_SIZE)}
    text = json.dumps(manifest, indent=2) + "\n"
    _write_atomically(folder / "model.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return folder


TEST_LORA = "tiny-lora"
LORA_TARGETS = ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_attn.qkv",
                "single_blocks.0.linear1")  # fmt: skip
LORA_RANK = 4


def make_test_lora(path: Path, dit: dict[str, tuple[int, ...]]) -> Path:
    """A rank-4 LoRA for the tiny DiT's attention and single block (`loras/tiny-lora`), in the
    common `diffusion_model.X.lora_down/lora_up.weight` + `.alpha` layout; deterministic."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    for target in LORA_TARGETS:
        out_f, in_f = dit[f"{target}.weight"]
        key = f"diffusion_model.{target}"
        for part, shape in (("lora_down", (LORA_RANK, in_f)), ("lora_up", (out_f, LORA_RANK))):
            rng = np.random.default_rng([SEED, zlib.crc32(f"lora/{key}.{part}".encode())])
            tensors[f"{key}.{part}.weight"] = (0.5 * rng.standard_normal(shape)).astype(np.float16)
        tensors[f"{key}.alpha"] = np.array(float(LORA_RANK), dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


TEST_UPSCALERS: dict[str, tuple[int, str]] = {
    "tiny-esrgan-x2": (2, "rrdbnet"),
    "tiny-esrgan-x4": (4, "esrgan"),
}
"""The tiny upscalers (`upscalers/NAME.safetensors`): name -> (scale, tensor-name layout)."""


def make_test_upscaler(path: Path, scale: int, layout: str = "rrdbnet") -> Path:
    """A one-block RRDBNet of the runtime's fixed widths (sdfarm.native.upscalers), weights
    f16 and biases f32 drawn like the model's, in the original layout or the old ESRGAN
    `model.N` one; deterministic, about 1.7 MB."""
    from safetensors.numpy import save_file

    from sdfarm.native.upscalers import esrgan_names, rrdbnet_specs

    specs = rrdbnet_specs(1, scale)
    rename = esrgan_names(1, scale) if layout == "esrgan" else {}
    tensors = {
        rename.get(n, n): (w.astype(np.float16) if w.ndim >= 2 else w)
        for n, w in _weights(f"esrgan-x{scale}", specs)
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"sdfarm": f"tiny random-weight test upscaler, seed {SEED}"}
    _write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m sdfarm.native.testmodel DIR`: write the model and print each file's size."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m sdfarm.native.testmodel DIR", file=sys.stderr)
        return 2
    for folder in make_test_model(args[0]):
        files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".gguf"))
        total = sum(p.stat().st_size for p in files)
        print(f"{folder.name}: {total:,} bytes")
        for p in files:
            print(f"  {p.name}: {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
