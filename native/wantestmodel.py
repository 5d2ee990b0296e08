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
- `wan-moe-test`: a Wan 2.2-style MoE pair: the T2V DiT as the low-noise expert and another
  of the same architecture (other weights) as the `high_noise_diffusion_model`.

`I2V_14B` describes Wan2.2-I2V-14B's expert, the only variant that reads an end image, for
bench/wan22_i2v_cost.py: the runtime builds it only at full size (40 layers of dim 5120, 14.3 B
parameters, 8.06 GB in q4_0), so no test model of it is written for CI.

Deterministic (each tensor from its own seeded generator): the same bytes on every run.
`cached_wan_test_model()` writes it once under the runtime's cache folder, keyed by this
generator's version, so tests and CI pay the write once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
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

# OpenCLIP ViT-H/14's vision tower, the runtime's one CLIP vision encoder (src/clip.hpp).
VISION_DIM = 1280
VISION_MLP = 5120
VISION_LAYERS = 32
VISION_PATCH = 14
VISION_TOKENS = 257  # (224 / 14)^2 patches + the class token
VISION_PROJECTION = 1024

Q4_0_BLOCK = 32
Q4_0_BYTES = 18  # f16 scale + 16 bytes of 4-bit values
Q4_0_SPREAD = 4.61  # standard deviation of (q - 8) for q uniform on 0..15


@dataclass(frozen=True)
class WanArch:
    """The sizes of a Wan DiT as the runtime fixes them for a layer count (WanRunner in
    src/wan.hpp): it reads only the layer count (and the patch embedding's channels, for the
    variant) from the file, so a test DiT must have exactly these."""

    desc: str
    layers: int
    dim: int
    ffn_dim: int
    in_dim: int
    image_tokens: int = 0
    """0: text-to-video. Else an image-to-video DiT (Wan2.1 I2V): `img_emb` projects the CLIP
    vision encoder's tokens and every block's cross attention has `k_img`/`v_img`; 514 (two
    images of 257) adds `img_emb.emb_pos`, the first-last-frame position embedding."""


T2V_1_3B = WanArch("Wan2.1-T2V-1.3B", LAYERS, DIM, FFN_DIM, IN_DIM)
IMAGE_TOKENS = 257
"""The CLIP vision tokens of one image (a 224-pixel image in 14-pixel patches, plus one)."""
FLF_TOKENS = 514
"""The runtime's emb_pos length (flf_pos_embed_token_number in src/wan.hpp): two images' 257."""
I2V_1_3B = WanArch("Wan2.1-I2V-1.3B", LAYERS, DIM, FFN_DIM, 36, IMAGE_TOKENS)
"""An image-to-video DiT at the 1.3B width: the T2V 1.3B's blocks with Wan2.1 I2V's image
inputs (in_dim 36: 16 noise + 4 mask + 16 image-latent channels; img_emb; k_img/v_img). No
such checkpoint was released, but the runtime builds it from a 30-layer DiT with img_emb
(WanRunner: "Wan2.1-I2V-1.3B"): it encodes the init image through the CLIP vision encoder and
pins the init and end images as the first and last frames of the conditioning latent
(prepare_video_generation_latents). Not first-last-frame (no img_emb.emb_pos): at 30 layers
the runtime passes one image's 257 CLIP tokens to an emb_pos of 514 and aborts (MLPProj in
src/wan.hpp), so FLF2V exists at 40 layers only (Wan2.1-FLF2V-14B)."""
I2V_14B = WanArch("Wan2.2-I2V-14B", 40, 5120, 13824, 36)
"""Wan2.2-I2V-A14B's DiT (each of its two experts): 40 layers of dim 5120, in_dim 36 (16 noise
+ 4 mask + 16 image-latent channels), no img_emb, so the patch embedding has 184320 channels
and the runtime reads first and last frame without a CLIP vision encoder. 14.3 B parameters."""


def dit_specs(
    layers: int | None = None, vace_layers: int = 0, arch: WanArch = T2V_1_3B
) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (PyTorch shape, kind)} of a Wan DiT of `arch` (default the T2V 1.3B), names as in
    the original file (the runtime prefixes `model.diffusion_model.`). kind: "linear" (q4_0),
    "conv" (f16), "f32". `layers` overrides the architecture's layer count (header-only fakes
    of counts the runtime aborts on). `vace_layers` > 0 adds that many VACE blocks and the VACE
    patch embedding (a VACE model, which reads a reference image; the real VACE 1.3B has 15,
    the runtime takes any count)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    dim = arch.dim
    layers = arch.layers if layers is None else layers

    def linear(name: str, fin: int, fout: int) -> None:
        out[f"{name}.weight"] = ((fout, fin), "linear")
        out[f"{name}.bias"] = ((fout,), "f32")

    def block(b: str) -> None:
        out[f"{b}.modulation"] = ((1, 6, dim), "f32")
        for attn in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o"):
                linear(f"{b}.{attn}.{p}", dim, dim)
            out[f"{b}.{attn}.norm_q.weight"] = ((dim,), "f32")
            out[f"{b}.{attn}.norm_k.weight"] = ((dim,), "f32")
        if arch.image_tokens:  # WanI2VCrossAttention
            linear(f"{b}.cross_attn.k_img", dim, dim)
            linear(f"{b}.cross_attn.v_img", dim, dim)
            out[f"{b}.cross_attn.norm_k_img.weight"] = ((dim,), "f32")
        out[f"{b}.norm3.weight"] = ((dim,), "f32")
        out[f"{b}.norm3.bias"] = ((dim,), "f32")
        linear(f"{b}.ffn.0", dim, arch.ffn_dim)
        linear(f"{b}.ffn.2", arch.ffn_dim, dim)

    # The runtime's Conv3d weight is 4-D [kw, kh, kd, in*out]; GGUF holds at most 4 dims.
    out["patch_embedding.weight"] = ((dim * arch.in_dim, *PATCH), "conv")
    out["patch_embedding.bias"] = ((dim,), "f32")
    linear("text_embedding.0", TEXT_DIM, dim)
    linear("text_embedding.2", dim, dim)
    linear("time_embedding.0", FREQ_DIM, dim)
    linear("time_embedding.2", dim, dim)
    linear("time_projection.1", dim, dim * 6)
    for i in range(layers):
        block(f"blocks.{i}")
    out["head.modulation"] = ((1, 2, dim), "f32")
    linear("head.head", dim, OUT_DIM * PATCH[0] * PATCH[1] * PATCH[2])
    if arch.image_tokens:  # MLPProj of the CLIP vision tokens (width VISION_DIM)
        out["img_emb.proj.0.weight"] = ((VISION_DIM,), "gain")
        out["img_emb.proj.0.bias"] = ((VISION_DIM,), "f32")
        linear("img_emb.proj.1", VISION_DIM, VISION_DIM)
        linear("img_emb.proj.3", VISION_DIM, dim)
        out["img_emb.proj.4.weight"] = ((dim,), "gain")
        out["img_emb.proj.4.bias"] = ((dim,), "f32")
        if arch.image_tokens == FLF_TOKENS:
            out["img_emb.emb_pos"] = ((1, FLF_TOKENS, VISION_DIM), "f32")
    for i in range(vace_layers):
        block(f"vace_blocks.{i}")
        if i == 0:
            linear(f"vace_blocks.{i}.before_proj", dim, dim)
        linear(f"vace_blocks.{i}.after_proj", dim, dim)
    if vace_layers:
        out["vace_patch_embedding.weight"] = ((dim * VACE_IN_DIM, *PATCH), "conv")
        out["vace_patch_embedding.bias"] = ((dim,), "f32")
    return out


def vision_specs() -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (PyTorch shape, kind)} of OpenCLIP ViT-H/14's vision tower with Hugging Face
    names, as the clip_vision_h file of Wan2.1 I2V has them (the runtime prefixes
    `cond_stage_model.transformer.`). The runtime builds this encoder at its one size
    (FrozenCLIPVisionEmbedder, CLIPVisionModel in src/clip.hpp: 32 layers of 1280, MLP 5120,
    224-pixel images in 14-pixel patches) and loads nothing with a tensor missing
    (ModelLoader::load_tensors), so it cannot be smaller than 632 M parameters."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    d = VISION_DIM
    v = "vision_model"
    out[f"{v}.embeddings.patch_embedding.weight"] = ((d, 3, VISION_PATCH, VISION_PATCH), "conv")
    out[f"{v}.embeddings.class_embedding"] = ((d,), "f32")
    out[f"{v}.embeddings.position_embedding.weight"] = ((VISION_TOKENS, d), "f32")
    out[f"{v}.pre_layrnorm.weight"] = ((d,), "gain")  # sic: the Hugging Face name
    out[f"{v}.pre_layrnorm.bias"] = ((d,), "f32")
    for i in range(VISION_LAYERS):
        b = f"{v}.encoder.layers.{i}"
        for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{b}.self_attn.{p}.weight"] = ((d, d), "linear")
            out[f"{b}.self_attn.{p}.bias"] = ((d,), "f32")
        for n in ("layer_norm1", "layer_norm2"):
            out[f"{b}.{n}.weight"] = ((d,), "gain")
            out[f"{b}.{n}.bias"] = ((d,), "f32")
        out[f"{b}.mlp.fc1.weight"] = ((VISION_MLP, d), "linear")
        out[f"{b}.mlp.fc1.bias"] = ((VISION_MLP,), "f32")
        out[f"{b}.mlp.fc2.weight"] = ((d, VISION_MLP), "linear")
        out[f"{b}.mlp.fc2.bias"] = ((d,), "f32")
    out[f"{v}.post_layernorm.weight"] = ((d,), "gain")
    out[f"{v}.post_layernorm.bias"] = ((d,), "f32")
    out["visual_projection.weight"] = ((VISION_PROJECTION, d), "linear")
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


def _q4_0_weight(part: str, name: str, shape: tuple[int, int]) -> np.ndarray:
    """Rows of q4_0 blocks as bytes: a fixed f16 scale d with d * 4.61 = 1/sqrt(fan_in), then
    16 bytes of random 4-bit values (value = d * (q - 8))."""
    rows, cols = shape
    blocks = rows * cols // Q4_0_BLOCK
    d = np.float16(1.0 / (np.sqrt(cols) * Q4_0_SPREAD))
    data = np.empty((blocks, Q4_0_BYTES), dtype=np.uint8)
    data[:, :2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    data[:, 2:] = np.frombuffer(_rng(part, name).bytes(blocks * 16), dtype=np.uint8).reshape(
        blocks, 16
    )
    return data.reshape(rows, cols // Q4_0_BLOCK * Q4_0_BYTES)


def _tensors(
    specs: dict[str, tuple[tuple[int, ...], str]], part: str
) -> Iterator[tuple[str, np.ndarray, object]]:
    """Each tensor of `specs` as written: "linear" q4_0, "conv" f16, "gain" ones, else f32."""
    import gguf

    q4_0 = gguf.GGMLQuantizationType.Q4_0
    for name, (shape, kind) in specs.items():
        if kind == "linear":
            yield name, _q4_0_weight(part, name, shape), q4_0  # type: ignore[arg-type]
        elif kind == "conv":
            yield name, _float_weight(part, name, shape).astype(np.float16), None
        elif kind == "gain":
            yield name, np.ones(shape, dtype=np.float32), None
        else:
            yield name, _float_weight(part, name, shape), None


def write_dit(
    path: Path, arch: WanArch = T2V_1_3B, vace_layers: int = 0, part: str = "dit"
) -> None:
    """A DiT of `arch` as GGUF, streamed tensor by tensor (peak memory: the largest tensor).
    `part` seeds the weights: another part gives another DiT of the same architecture (the
    high-noise expert of a pair)."""
    _write_gguf(path, dit_specs(None, vace_layers, arch), part, arch.desc)


def write_vision(path: Path) -> None:
    """The CLIP vision encoder (`vision_specs`) as GGUF, linear weights q4_0."""
    _write_gguf(path, vision_specs(), "clip-vision", "OpenCLIP ViT-H/14 vision")


def _write_gguf(
    path: Path, specs: dict[str, tuple[tuple[int, ...], str]], part: str, desc: str
) -> None:
    import gguf

    from sdfarm.native.testmodel import _write_atomically

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch="sdfarm-wan-test")
        writer.add_name(f"sdfarm random-weight {desc} test model, seed {SEED}/{part}")
        for name, arr, raw in _tensors(specs, part):  # shapes first
            writer.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=raw)  # type: ignore[arg-type]
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _name, arr, _raw in _tensors(specs, part):
            writer.write_tensor_data(arr)
        writer.close()

    _write_atomically(path, write)


def write_vae(path: Path) -> None:
    from safetensors.numpy import save_file

    from sdfarm.native.testmodel import _write_atomically

    tensors = {
        n: (w.astype(np.float16) if w.ndim >= 2 else w)
        for n, w in ((n, _float_weight("vae", n, s)) for n, s in vae_specs().items())
    }
    note = {"sdfarm": f"random-weight Wan 2.1 VAE, seed {SEED}"}
    _write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=note))


@dataclass(frozen=True)
class DitFile:
    """One DiT file of a test model: its architecture, VACE blocks and the part of the seed
    its weights come from (another part: another DiT of the same architecture)."""

    name: str
    arch: WanArch = T2V_1_3B
    vace_layers: int = 0
    part: str = "dit"


HIGH_NOISE_FILE = "dit-high-noise.gguf"
MOE_NAME = "wan-moe-test"
I2V_NAME = "wan-i2v-test"
I2V_DIT_FILE = "dit-i2v.gguf"
VISION_FILE = "clip-vision.gguf"
VARIANTS: dict[str, dict[str, DitFile]] = {
    NAME: {"diffusion_model": DitFile(DIT_FILE)},
    VACE_NAME: {"diffusion_model": DitFile(DIT_FILE, vace_layers=VACE_LAYERS)},
    MOE_NAME: {
        "diffusion_model": DitFile(DIT_FILE),
        "high_noise_diffusion_model": DitFile(HIGH_NOISE_FILE, part="dit-high-noise"),
    },
    I2V_NAME: {"diffusion_model": DitFile(I2V_DIT_FILE, arch=I2V_1_3B)},
}
VISION_FILES: dict[str, str] = {I2V_NAME: VISION_FILE}
"""The test models that hold a CLIP vision encoder (role clip_vision) beside their DiT."""
"""The test models: folder name -> {role: DiT file}; each has the Wan 2.1 VAE beside. The MoE
one is a Wan 2.2-style pair (the T2V DiT as the low-noise expert, another of the same
architecture as the high-noise one): the runtime samples any pair of one variant alike, and two
1.3B DiTs keep it at 1.6 GB where a real A14B pair of 40-layer DiTs is 16 GB in q4_0."""


def _link_sibling(path: Path, out_dir: Path, name: str, spec: DitFile | None) -> bool:
    """Hard-link `path` from a sibling variant's folder holding the same file (the VAE when
    `spec` is None, else a DiT of the same spec); False when none does."""
    for other, files in VARIANTS.items():
        if other == name:
            continue
        if spec is None:
            found: Path | None = out_dir / other / VAE_FILE
        else:
            same = [f for f in files.values() if f == spec]
            found = out_dir / other / same[0].name if same else None
        if found is not None and found.exists():
            with contextlib.suppress(OSError):  # another filesystem: written instead
                os.link(found, path)
                return True
    return False


def make_wan_test_model(out_dir: str | os.PathLike[str], name: str = NAME) -> Path:
    """Write `out_dir/NAME/` (its DiTs, vae.safetensors, model.json) for a name of VARIANTS
    and return it. A file a sibling variant's folder already holds (the VAE, the T2V DiT) is
    hard-linked from it."""
    root = Path(out_dir)
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    files = VARIANTS[name]
    for spec in files.values():
        path = folder / spec.name
        if not path.exists() and not _link_sibling(path, root, name, spec):
            write_dit(path, spec.arch, spec.vace_layers, spec.part)
    vae = folder / VAE_FILE
    if not vae.exists() and not _link_sibling(vae, root, name, None):
        write_vae(vae)
    extra: dict[str, str] = {}
    if name in VISION_FILES:
        extra["clip_vision"] = VISION_FILES[name]
        if not (folder / VISION_FILES[name]).exists():
            write_vision(folder / VISION_FILES[name])
    manifest = {
        "files": {
            **{role: spec.name for role, spec in files.items()},
            **extra,
            "vae": VAE_FILE,
        },
        "native_size": list(NATIVE_SIZE),
    }
    (folder / "model.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return folder


def cache_dir() -> Path:
    from sdfarm.native.build import cache_root

    return cache_root() / "testmodels" / f"wan-v{VERSION}-{SEED}"


def cached_wan_test_model(name: str = NAME) -> Path:
    """Test model `name`'s folder under the runtime's cache, written on first use (about
    1 GB for the first, 0.8 GB more for the VACE one and for the MoE pair's high-noise DiT,
    the rest hard-linked). Test workers starting together on a fresh cache take turns: one
    writes, the others wait on a lock and find it done."""
    root = cache_dir()
    folder = root / name
    done = root / f".complete-{name}"
    if done.exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    # One writer at a time (test workers of one run start together on a fresh cache): the
    # others wait for it and find the model done instead of writing it again.
    with (root / f".lock-{name}").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            make_wan_test_model(root, name)
            done.write_text(VERSION + "\n", encoding="utf-8")
    return folder
