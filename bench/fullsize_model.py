"""A random-weight model of SD-Turbo's exact architecture, for full-size speed and memory runs.

No real weights can be downloaded where we measure; time and memory do not depend on weight
values. This writes one safetensors checkpoint with the original sd_turbo.safetensors layout
(SD 2.x, LDM names): model.diffusion_model.* (UNet, 865.9M params), cond_stage_model.model.*
(OpenCLIP ViT-H/14 text tower, 354.0M) and first_stage_model.* (KL-f8 VAE, 83.7M); f16 gives
a file of about 2.607 GB that stable-diffusion.cpp loads as "Version: SD 2.x".

    python bench/fullsize_model.py OUT_DIR [--arch sd-turbo] [--dtype f16] [--seed 0] [--taesd]

writes OUT_DIR/sd-turbo-random/{model.safetensors,model.json}; with --taesd also
OUT_DIR/sd-turbo-random-taesd/ holding the same checkpoint (hard link when possible),
a TAESD decoder for 4-channel latents (taesd.safetensors, decoder.layers.* as sd.cpp's tae.hpp
expects) and a manifest naming both. Through sdfarm that folder decodes with the checkpoint's
VAE unless a job asks for `decoder` taesd (sdfarm.native.decoders); sd-cli's `--taesd`
decodes with the TAESD.

Weights ~ N(0, 1/fan_in) (fan_in = product of all but the first dimension), norm gains 1,
biases 0, drawn per tensor from numpy's PCG64 seeded with (seed, crc32(name)): the same bytes
every run on every machine. The file is streamed (header first, then each tensor in chunks):
peak memory stays near 100 MB. Standalone on purpose (numpy and the standard library only):
it runs on machines that lack our package, where a 2.6 GB file cannot be copied to.

Left out of the original: the DDPM schedule buffers (betas, alphas_cumprod, ...) that LDM
checkpoints may carry; sd.cpp computes its own schedule, and would load a file's alphas_cumprod
into it. The original's text_projection (1024x1024) is kept: sd.cpp does not use it for SD 2.x
and logs it once as "unknown tensor", as it does for the original file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ARCHS = ("sd-turbo",)
DTYPES = {"f16": ("F16", 2), "bf16": ("BF16", 2), "f32": ("F32", 4)}
NATIVE_SIZE = (512, 512)
MODEL_DIR = "sd-turbo-random"
TAESD_DIR = "sd-turbo-random-taesd"
CHECKPOINT = "model.safetensors"
TAESD_FILE = "taesd.safetensors"
LORA_NAME = "sd-turbo-lora"
LORA_RANK = 64
CHUNK = 1 << 22  # elements drawn at a time: 16 MB of float32

# Component of a checkpoint tensor, by name prefix (for the per-component parameter counts).
COMPONENTS = (
    ("unet", "model.diffusion_model."),
    ("text", "cond_stage_model."),
    ("vae", "first_stage_model."),
)

# (name, shape, init): init is "w" (random, N(0, 1/fan_in)), "one", "zero" or a float constant.
Spec = tuple[str, tuple[int, ...], object]


# ---------------------------------------------------------------------------------------------
# Layouts


def _linear(name: str, n_out: int, n_in: int, bias: bool = True) -> list[Spec]:
    out: list[Spec] = [(f"{name}.weight", (n_out, n_in), "w")]
    if bias:
        out.append((f"{name}.bias", (n_out,), "zero"))
    return out


def _conv(name: str, n_out: int, n_in: int, k: int = 3, bias: bool = True) -> list[Spec]:
    out: list[Spec] = [(f"{name}.weight", (n_out, n_in, k, k), "w")]
    if bias:
        out.append((f"{name}.bias", (n_out,), "zero"))
    return out


def _norm(name: str, n: int) -> list[Spec]:
    return [(f"{name}.weight", (n,), "one"), (f"{name}.bias", (n,), "zero")]


def _unet_resblock(p: str, n_in: int, n_out: int, emb: int) -> list[Spec]:
    out = _norm(f"{p}.in_layers.0", n_in) + _conv(f"{p}.in_layers.2", n_out, n_in)
    out += _linear(f"{p}.emb_layers.1", n_out, emb)
    out += _norm(f"{p}.out_layers.0", n_out) + _conv(f"{p}.out_layers.3", n_out, n_out)
    if n_in != n_out:
        out += _conv(f"{p}.skip_connection", n_out, n_in, k=1)
    return out


def _spatial_transformer(p: str, ch: int, context: int) -> list[Spec]:
    """SD 2.x: linear proj_in/proj_out, one BasicTransformerBlock with a GEGLU feed-forward."""
    b = f"{p}.transformer_blocks.0"
    out = _norm(f"{p}.norm", ch) + _linear(f"{p}.proj_in", ch, ch)
    for attn, kv in (("attn1", ch), ("attn2", context)):
        out += _linear(f"{b}.{attn}.to_q", ch, ch, bias=False)
        out += _linear(f"{b}.{attn}.to_k", ch, kv, bias=False)
        out += _linear(f"{b}.{attn}.to_v", ch, kv, bias=False)
        out += _linear(f"{b}.{attn}.to_out.0", ch, ch)
        if attn == "attn1":
            out += _linear(f"{b}.ff.net.0.proj", ch * 8, ch) + _linear(f"{b}.ff.net.2", ch, ch * 4)
    for i in (1, 2, 3):
        out += _norm(f"{b}.norm{i}", ch)
    return out + _linear(f"{p}.proj_out", ch, ch)


def unet_specs(
    prefix: str = "model.diffusion_model.",
    in_channels: int = 4,
    model_channels: int = 320,
    channel_mult: tuple[int, ...] = (1, 2, 4, 4),
    num_res_blocks: int = 2,
    attention_levels: tuple[int, ...] = (0, 1, 2),
    context_dim: int = 1024,
) -> list[Spec]:
    """The LDM openaimodel UNet of SD 2.x (in the original's tensor order)."""
    p, mc = prefix, model_channels
    emb = mc * 4
    out = _linear(f"{p}time_embed.0", emb, mc) + _linear(f"{p}time_embed.2", emb, emb)
    out += _conv(f"{p}input_blocks.0.0", mc, in_channels)
    skips = [mc]
    ch, idx = mc, 1
    for level, mult in enumerate(channel_mult):
        for _ in range(num_res_blocks):
            out += _unet_resblock(f"{p}input_blocks.{idx}.0", ch, mc * mult, emb)
            ch = mc * mult
            if level in attention_levels:
                out += _spatial_transformer(f"{p}input_blocks.{idx}.1", ch, context_dim)
            skips.append(ch)
            idx += 1
        if level != len(channel_mult) - 1:
            out += _conv(f"{p}input_blocks.{idx}.0.op", ch, ch)
            skips.append(ch)
            idx += 1
    out += _unet_resblock(f"{p}middle_block.0", ch, ch, emb)
    out += _spatial_transformer(f"{p}middle_block.1", ch, context_dim)
    out += _unet_resblock(f"{p}middle_block.2", ch, ch, emb)
    idx = 0
    for level in reversed(range(len(channel_mult))):
        mult = channel_mult[level]
        for i in range(num_res_blocks + 1):
            blk = f"{p}output_blocks.{idx}"
            out += _unet_resblock(f"{blk}.0", ch + skips.pop(), mc * mult, emb)
            ch = mc * mult
            sub = 1
            if level in attention_levels:
                out += _spatial_transformer(f"{blk}.1", ch, context_dim)
                sub = 2
            if level and i == num_res_blocks:
                out += _conv(f"{blk}.{sub}.conv", ch, ch)
            idx += 1
    return out + _norm(f"{p}out.0", ch) + _conv(f"{p}out.2", in_channels, ch)


def open_clip_text_specs(
    prefix: str = "cond_stage_model.model.",
    vocab: int = 49408,
    n_ctx: int = 77,
    width: int = 1024,
    layers: int = 24,
    mlp: int = 4096,
    embed_dim: int = 1024,
) -> list[Spec]:
    """The OpenCLIP ViT-H/14 text tower as SD 2.x checkpoints hold it (visual tower removed)."""
    p = prefix
    out: list[Spec] = [
        (f"{p}positional_embedding", (n_ctx, width), "w"),
        (f"{p}text_projection", (width, embed_dim), "w"),
        (f"{p}logit_scale", (), math.log(1 / 0.07)),
        (f"{p}token_embedding.weight", (vocab, width), "w"),
    ]
    for i in range(layers):
        r = f"{p}transformer.resblocks.{i}"
        out += [
            (f"{r}.attn.in_proj_weight", (3 * width, width), "w"),
            (f"{r}.attn.in_proj_bias", (3 * width,), "zero"),
        ]
        out += _linear(f"{r}.attn.out_proj", width, width) + _norm(f"{r}.ln_1", width)
        out += _linear(f"{r}.mlp.c_fc", mlp, width) + _linear(f"{r}.mlp.c_proj", width, mlp)
        out += _norm(f"{r}.ln_2", width)
    return out + _norm(f"{p}ln_final", width)


def _vae_resblock(p: str, n_in: int, n_out: int) -> list[Spec]:
    out = _norm(f"{p}.norm1", n_in) + _conv(f"{p}.conv1", n_out, n_in)
    out += _norm(f"{p}.norm2", n_out) + _conv(f"{p}.conv2", n_out, n_out)
    if n_in != n_out:
        out += _conv(f"{p}.nin_shortcut", n_out, n_in, k=1)
    return out


def _vae_mid(p: str, ch: int) -> list[Spec]:
    out = _vae_resblock(f"{p}.mid.block_1", ch, ch) + _norm(f"{p}.mid.attn_1.norm", ch)
    for part in ("q", "k", "v", "proj_out"):
        out += _conv(f"{p}.mid.attn_1.{part}", ch, ch, k=1)
    return out + _vae_resblock(f"{p}.mid.block_2", ch, ch)


def vae_specs(
    prefix: str = "first_stage_model.",
    ch: int = 128,
    ch_mult: tuple[int, ...] = (1, 2, 4, 4),
    num_res_blocks: int = 2,
    z: int = 4,
) -> list[Spec]:
    """The LDM AutoencoderKL (KL-f8) with its quant_conv/post_quant_conv."""
    e, d = f"{prefix}encoder", f"{prefix}decoder"
    out = _conv(f"{e}.conv_in", ch, 3)
    block_in = ch
    for level, mult in enumerate(ch_mult):
        for j in range(num_res_blocks):
            out += _vae_resblock(f"{e}.down.{level}.block.{j}", block_in, ch * mult)
            block_in = ch * mult
        if level != len(ch_mult) - 1:
            out += _conv(f"{e}.down.{level}.downsample.conv", block_in, block_in)
    out += _vae_mid(e, block_in)
    out += _norm(f"{e}.norm_out", block_in) + _conv(f"{e}.conv_out", 2 * z, block_in)
    out += _conv(f"{d}.conv_in", block_in, z) + _vae_mid(d, block_in)
    for level in reversed(range(len(ch_mult))):
        for j in range(num_res_blocks + 1):
            out += _vae_resblock(f"{d}.up.{level}.block.{j}", block_in, ch * ch_mult[level])
            block_in = ch * ch_mult[level]
        if level:
            out += _conv(f"{d}.up.{level}.upsample.conv", block_in, block_in)
    out += _norm(f"{d}.norm_out", block_in) + _conv(f"{d}.conv_out", 3, block_in)
    out += _conv(f"{prefix}quant_conv", 2 * z, 2 * z, k=1)
    return out + _conv(f"{prefix}post_quant_conv", z, z, k=1)


def taesd_decoder_specs(z: int = 4, channels: int = 64, num_blocks: int = 3) -> list[Spec]:
    """madebyollin's TAESD decoder in diffusers naming (decoder.layers.N), as tae.hpp builds it:
    conv, ReLU, 3 blocks, (upsample, conv without bias, 3 blocks) x 2, upsample, conv without
    bias, 1 block, conv to RGB."""
    p = "decoder.layers"

    def block(i: int) -> list[Spec]:
        return [s for k in (0, 2, 4) for s in _conv(f"{p}.{i}.conv.{k}", channels, channels)]

    out = _conv(f"{p}.0", channels, z)
    idx = 2  # 1 is the ReLU
    for stage in range(3):
        for _ in range(num_blocks):
            out += block(idx)
            idx += 1
        idx += 1  # nn.Upsample
        out += _conv(f"{p}.{idx}", channels, channels, bias=False)
        idx += 1
        if stage == 2:
            out += block(idx)
            idx += 1
    return out + _conv(f"{p}.{idx}", 3, channels)


def _diffusers_transformer(ldm: str) -> str | None:
    """The diffusers name of an SD 2.x UNet transformer's LDM prefix ("input_blocks.1.1" ->
    "down_blocks.0.attentions.0"), None for anything else."""
    parts = ldm.split(".")
    if parts[0] == "middle_block" and parts[1] == "1":
        return "mid_block.attentions.0"
    if len(parts) < 3 or parts[2] != "1":
        return None
    i = int(parts[1])
    if parts[0] == "input_blocks" and i % 3 in (1, 2) and i < 9:
        return f"down_blocks.{i // 3}.attentions.{i % 3 - 1}"
    if parts[0] == "output_blocks" and i >= 3:
        return f"up_blocks.{i // 3}.attentions.{i % 3}"
    return None


def lora_specs(rank: int = LORA_RANK, arch: str = "sd-turbo") -> list[Spec]:
    """A rank-`rank` LoRA on every linear layer of the UNet's transformers (attention q/k/v/out,
    feed-forward, proj_in/proj_out) in kohya's layout, as most SD 1.x/2.x LoRAs are shared:
    `lora_unet_<diffusers name with _>.lora_down/lora_up.weight` + `.alpha`. Rank 64 makes a
    file of 55 MB in f16 (192 layers), the size of a common LoRA."""
    out: list[Spec] = []
    for name, shape, _ in checkpoint_specs(arch):
        if not name.startswith("model.diffusion_model.") or len(shape) != 2:
            continue
        if "norm" in name or not name.endswith(".weight"):
            continue
        ldm = name.removeprefix("model.diffusion_model.")[: -len(".weight")]
        head = ".".join(ldm.split(".")[: 3 if ldm.startswith(("input", "output")) else 2])
        block = _diffusers_transformer(head)
        if block is None:
            continue
        key = "lora_unet_" + (block + ldm[len(head) :]).replace(".", "_")
        n_out, n_in = shape
        out.append((f"{key}.lora_down.weight", (rank, n_in), "w"))
        out.append((f"{key}.lora_up.weight", (n_out, rank), "w"))
        out.append((f"{key}.alpha", (), float(rank)))
    return out


def checkpoint_specs(arch: str = "sd-turbo") -> list[Spec]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (known: {', '.join(ARCHS)})")
    return unet_specs() + open_clip_text_specs() + vae_specs()


def tensor_list(arch: str = "sd-turbo") -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the checkpoint, in the original's module order."""
    return [(name, shape) for name, shape, _ in checkpoint_specs(arch)]


def taesd_tensor_list() -> list[tuple[str, tuple[int, ...]]]:
    return [(name, shape) for name, shape, _ in taesd_decoder_specs()]


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def param_counts(tensors: list[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """Parameters per component (unet, text, vae; anything else under "other")."""
    out = {name: 0 for name, _ in COMPONENTS}
    for name, shape in tensors:
        comp = next((c for c, prefix in COMPONENTS if name.startswith(prefix)), "other")
        out[comp] = out.get(comp, 0) + numel(shape)
    return out


# ---------------------------------------------------------------------------------------------
# Writing


def _to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f16":
        return x.astype(np.float16)
    if dtype == "f32":
        return x.astype(np.float32)
    # bf16: round to nearest even on the top 16 bits of the float32.
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def tensor_chunks(
    name: str, shape: tuple[int, ...], init: object, dtype: str, seed: int
) -> Iterator[np.ndarray]:
    """The tensor's values in row-major order, CHUNK elements at a time, already converted."""
    n = numel(shape)
    if init == "w":
        rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
        std = 1.0 / math.sqrt(numel(shape[1:]) if len(shape) > 1 else shape[0])
        for start in range(0, n, CHUNK):
            x = rng.standard_normal(min(CHUNK, n - start), dtype=np.float32)
            x *= np.float32(std)
            yield _to_dtype(x, dtype)
        return
    value = {"one": 1.0, "zero": 0.0}.get(init, init)  # type: ignore[arg-type]
    for start in range(0, n, CHUNK):
        yield _to_dtype(np.full(min(CHUNK, n - start), value, dtype=np.float32), dtype)


def header_bytes(specs: list[Spec], dtype: str, metadata: dict[str, str]) -> bytes:
    """The safetensors header (length prefix included), padded with spaces to 8 bytes."""
    st_dtype, size = DTYPES[dtype]
    doc: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, shape, _ in specs:
        end = offset + numel(shape) * size
        doc[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(
    path: Path, specs: list[Spec], dtype: str, seed: int, metadata: dict[str, str]
) -> int:
    """Stream the file (header, then each tensor's bytes, sorted by name as safetensors
    writes them) through a temporary name; returns its size."""
    specs = sorted(specs, key=lambda s: s[0])
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(header_bytes(specs, dtype, metadata))
        for name, shape, init in specs:
            for chunk in tensor_chunks(name, shape, init, dtype, seed):
                f.write(chunk.tobytes())
    os.replace(tmp, path)
    return path.stat().st_size


def _write_manifest(folder: Path, files: dict[str, str]) -> None:
    doc = {"files": files, "native_size": list(NATIVE_SIZE)}
    (folder / "model.json").write_text(json.dumps(doc, indent=2) + "\n")


def _link_or_copy(src: Path, dst: Path) -> str:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
        return "hard link"
    except OSError:
        shutil.copyfile(src, dst)
        return "copy"


def _peak_rss_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def make(
    out_dir: Path, arch: str, dtype: str, seed: int, taesd: bool, lora: bool = False
) -> list[Path]:
    specs = checkpoint_specs(arch)
    meta = {
        "format": "pt",
        "sdfarm": f"random weights of {arch}'s architecture (bench/fullsize_model.py)",
        "seed": str(seed),
    }
    counts = param_counts([(n, s) for n, s, _ in specs])
    total = sum(counts.values())
    for comp, n in counts.items():
        print(f"{comp:>6}: {n:>13,} params ({n / 1e6:.2f}M)")
    print(f" total: {total:>13,} params in {len(specs)} tensors")

    folder = out_dir / MODEL_DIR
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    size = write_safetensors(folder / CHECKPOINT, specs, dtype, seed, meta)
    took = time.perf_counter() - start
    _write_manifest(folder, {"checkpoint": CHECKPOINT})
    print(f"wrote {folder / CHECKPOINT}: {size:,} bytes ({dtype}) in {took:.1f} s")
    done = [folder]

    if taesd:
        tfolder = out_dir / TAESD_DIR
        tfolder.mkdir(parents=True, exist_ok=True)
        how = _link_or_copy(folder / CHECKPOINT, tfolder / CHECKPOINT)
        tspecs = taesd_decoder_specs()
        tmeta = dict(meta, sdfarm="random weights of a TAESD decoder (bench/fullsize_model.py)")
        tsize = write_safetensors(tfolder / TAESD_FILE, tspecs, dtype, seed, tmeta)
        tparams = sum(numel(s) for _, s, _ in tspecs)
        _write_manifest(tfolder, {"checkpoint": CHECKPOINT, "taesd": TAESD_FILE})
        print(
            f"wrote {tfolder / TAESD_FILE}: {tparams:,} params in {len(tspecs)} tensors, "
            f"{tsize:,} bytes; {CHECKPOINT} there is a {how}"
        )
        done.append(tfolder)
    if lora:
        lpath = out_dir / "loras" / f"{LORA_NAME}.safetensors"
        lpath.parent.mkdir(parents=True, exist_ok=True)
        lspecs = lora_specs(arch=arch)
        lmeta = dict(meta, sdfarm=f"random weights of a rank-{LORA_RANK} LoRA for {arch}")
        lsize = write_safetensors(lpath, lspecs, dtype, seed, lmeta)
        print(f"wrote {lpath}: {len(lspecs) // 3} layers, rank {LORA_RANK}, {lsize:,} bytes")
        done.append(lpath)
    rss = _peak_rss_mib()
    if rss is not None:
        print(f"peak RSS {rss:.0f} MiB")
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--arch", default="sd-turbo", choices=ARCHS)
    p.add_argument("--dtype", default="f16", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--taesd", action="store_true", help="also write a TAESD variant folder")
    p.add_argument("--lora", action="store_true", help=f"also write loras/{LORA_NAME}")
    args = p.parse_args(argv)
    make(args.out_dir, args.arch, args.dtype, args.seed, args.taesd, args.lora)
    return 0


if __name__ == "__main__":
    sys.exit(main())
