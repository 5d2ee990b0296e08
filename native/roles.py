"""Model roles: what each role means and how a file's role is told from its tensor names.

A model is a set of files, each in one role that the runtime loads through its own context
parameter (`ROLE_PARAMS`). The role of a file can be told from its tensor names (read from its
header by `headers.py`), so a model folder needs no manifest and a file in the wrong role is
caught before the runtime silently loads nonsense.

The memory rules (`memory.py`) and the fit plan (`fitplan.py`) need sizes split by pipeline
component (`ROLE_COMPONENTS`; a checkpoint's tensors split by their prefixes) and the image
size the diffusion model was trained at, guessed from its architecture (`native_size_for`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .headers import FileHeader

# The roles, in the order the runtime loads them, and the sd_ctx_params_t field of each.
ROLE_PARAMS: dict[str, str] = {
    "checkpoint": "model_path",
    "diffusion_model": "diffusion_model_path",
    "high_noise_diffusion_model": "high_noise_diffusion_model_path",
    "clip_l": "clip_l_path",
    "clip_g": "clip_g_path",
    "t5xxl": "t5xxl_path",
    "llm": "llm_path",
    "clip_vision": "clip_vision_path",
    "vae": "vae_path",
    "taesd": "taesd_path",
}
ROLES: tuple[str, ...] = tuple(ROLE_PARAMS)
HIGH_NOISE = "high_noise_diffusion_model"
"""The high-noise expert of a Wan 2.2 MoE pair (the low-noise one is the diffusion_model): its
tensors are a Wan DiT's like the other's, so a file's names never tell this role; a manifest
names it (sdfarm.native.video.check_pair checks the pair)."""
CLIP_VISION = "clip_vision"
"""A CLIP vision encoder (OpenCLIP ViT-H/14, the file Wan2.1 I2V / FLF2V models ship as
clip_vision_h): the runtime encodes a video's init (and end) image through it for a Wan2.1
image-to-video DiT and loads no such DiT without one (sdfarm.native.video.check_clip_vision)."""

# Which part of the pipeline each role feeds (the fit plan places these three separately).
ROLE_COMPONENTS: dict[str, str] = {
    "diffusion_model": "diffusion",
    HIGH_NOISE: "diffusion",  # both experts stay loaded (free_params_immediately off)
    "clip_l": "text_encoders",
    "clip_g": "text_encoders",
    "t5xxl": "text_encoders",
    "llm": "text_encoders",
    # The runtime builds the CLIP vision encoder on the diffusion model's backend, not the
    # text encoders' (new_sd_ctx of master-596): keep_clip_on_cpu does not move it.
    CLIP_VISION: "diffusion",
    "vae": "vae",
    "taesd": "vae",
}
COMPONENTS: tuple[str, ...] = ("diffusion", "text_encoders", "vae")

DEFAULT_NATIVE_SIZE: tuple[int, int] = (512, 512)


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
# A CLIP vision encoder: Hugging Face names (vision_model.encoder.layers.N., as clip_vision_h
# has them) or OpenCLIP's (visual.transformer.resblocks.N.); checked before the diffusion
# evidence, which its `embeddings.patch_embedding` and `layers.N.` would otherwise match.
_VISION_RE = re.compile(
    r"^(?:model\.)?(?:vision_model\.encoder\.layers|visual\.transformer\.resblocks)\.\d+\."
)


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


UPSCALER = "upscaler"
"""An ESRGAN file's role: not a model's (no sd_ctx_params_t field), an upscaler of its own
(sdfarm.native.upscalers), told apart here so a model folder holding one says so."""
UPSCALER_BODY_RE = re.compile(r"^body\.(\d+)\.")
UPSCALER_SUB_RE = re.compile(r"^model\.1\.sub\.(\d+)\.RDB")


def vision_evidence(names: Iterable[str]) -> str | None:
    """The evidence that (prefix-stripped) tensor names are a CLIP vision encoder's and no
    text encoder's (a full CLIP file holds both towers: that is a text encoder to the runtime),
    or None."""
    names = list(names)
    found = next((m.group(0) for n in names if (m := _VISION_RE.match(n))), None)
    if found is None or any(_CLIP_RE.search(n) or "token_embedding" in n for n in names):
        return None
    return f"tensor names {_glob(found.rstrip('.'))} (a CLIP vision encoder)"


def is_upscaler(names: Iterable[str]) -> bool:
    """Whether tensor names are an ESRGAN's (RRDBNet), in the original layout (`conv_first`,
    `body.N.rdbM...`) or the old `model.N` one (`model.0`, `model.1.sub.N.RDBM...`)."""
    names = set(names)
    return ("conv_first.weight" in names and any(UPSCALER_BODY_RE.match(n) for n in names)) or (
        "model.0.weight" in names and any(UPSCALER_SUB_RE.match(n) for n in names)
    )


def detect_role_with_evidence(header: FileHeader) -> tuple[str | None, str]:
    """The role a file's tensor names point to and the evidence, in words, e.g.
    ("llm", "tensor names model.layers.*.self_attn"); (None, "") when nothing matches.

    A file holding the diffusion model together with a VAE or text encoder is a checkpoint
    (sd.cpp's model_path): loaded as diffusion_model, its other tensors would be misnamed.
    """
    names = [_strip(n) for n in header.tensors]
    if not names:
        return None, ""
    if is_upscaler(header.tensors):
        return UPSCALER, "tensor names of an ESRGAN (RRDBNet)"
    if ev := vision_evidence(names):
        return CLIP_VISION, ev
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


def split_checkpoint(header: FileHeader) -> dict[str, int]:
    """A checkpoint's tensor bytes per pipeline component, told by their prefixes (or,
    without one, their names); tensors of no known component count as diffusion."""
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
