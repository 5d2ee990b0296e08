"""Our changes to the pinned runtime's source, applied by `sdfarm build` to a copy of it.

Each patch names the backends whose build it changes, the files it adds (from
`native/patches/`) and the exact text it replaces; a replacement whose text is not found
exactly once fails the build by name, so a different source can never be half-patched. The
build's cache key includes the patches that apply, so a changed patch is a new build, and a
backend no patch touches keeps its key.

Eight patches. One applies to every backend (the last of `PATCHES`):
- a job's images sampled together (`patches/batch_sample.hpp`): the runtime samples a job's
  batch_count images one after another, each step of each image its own UNet call; with it a
  UNet model's images go through each step in one call (their latents on ggml's batch axis),
  each image still the one its seed makes alone (its own generators for the starting and the
  sampler's noise; the same pixels on the CPU). It also lets the UNet's flash attention
  return every image's heads, where the pinned source kept the first image's only (nothing
  sent it a batch). Text to image only, without previews, step caches or a hires pass;
  `SDFARM_BATCH_SAMPLING=0` samples one by one.

The other seven are CUDA only:
- a tiled im2col (`patches/im2col_tiled.cuh`): the same values at the same places, read along
  the input rows. On an H200 ggml's kernel was 186 of the 274 ms of a 1024x1024 VAE decode; with
  the tiled one a 1024x1024 image takes 281-284 ms instead of 438-443, the same pixels
  (docs/gpu.md, "Where an image's GPU time goes"). `SDFARM_IM2COL_TILED=0` in a process's
  environment switches it back to ggml's kernel at run time. It stores 4 values at a time
  where it can (`SDFARM_IM2COL_VEC`): 215-220 ms instead of 251-252 at 1024, the same pixels.
- a split group norm (`patches/group_norm_split.cuh`): each group over many blocks instead of
  one, and the weight and bias that follow it in the graph fused into its one writing pass;
  ggml's were 30.7 ms (group norm) + 20.2 ms (broadcasts) of a 1024x1024 image's 341.5 ms of
  kernels; with it 1024x1024 is 145.8 ms of kernels. Its sums are taken in another order, so
  pixels move by a rounding: on the H200 a third of the 8-bit values, by at most 4 of 255
  (PSNR 52 dB). `SDFARM_GROUPNORM_SPLIT=0` switches back to ggml's kernels. The silu that
  follows a resnet's norm is taken into the same pass (ggml's silu, the same pixels on the
  H200; `SDFARM_GN_SILU=0` leaves it to ggml's kernel).
- convolutions through cuDNN (`patches/conv2d_cudnn.cuh`), EXPERIMENTAL and inert unless
  `SDFARM_CUDNN` names a libcudnn.so.9: ggml's direct convolution node run by cuDNN's implicit
  GEMM, with its bias add. On the H200 the runtime's process crashed inside cuDNN's
  heuristics, where a bare process ran the same calls (docs/gpu.md).
- attention through cuDNN (`patches/fattn_cudnn.cuh`), inert unless `SDFARM_CUDNN` names a
  library and the build found cuDNN's and its frontend's headers
  (`build.cudnn_sdpa_flags`): ggml's unmasked flash-attention node run by cuDNN's fused
  SDPA, where ggml's kernel took 2.66 ms for the UNet's 16,384-token self-attention on an
  H200 and PyTorch's SDPA 0.78 ms. `SDFARM_CUDNN_SDPA=0` keeps ggml's kernel.
- the UNet's linear layers fused (`patches/linear_fused.cuh`): ggml's own cuBLAS call, then one
  pass writing the bias add, the residual add after it or GEGLU's product, where ggml made a
  pass of each; the same pixels. With eight engines on an H200 the farm made 5.88-5.96 images/s
  at 1024 x 4 steps instead of 4.95-4.98 (with the next patch). `SDFARM_LINEAR_FUSED=0` off.
- the layer norm fused (`patches/layer_norm_fused.cuh`): ggml's norm kernel writing the
  weight's multiply and the bias's add too; the same pixels. `SDFARM_LAYER_NORM_FUSED=0` off.
- the self-attention fused (`patches/attn_fused.cuh`): the input converted once, ggml's three
  cuBLAS calls (to_q, to_k, to_v) into f16 buffers that cuDNN's SDPA reads in place, instead
  of f32 products, three permuted copies and three conversions back to f16. Only where the
  attention goes to cuDNN; the same pixels, and 19.9 images/s at 512 x 4 steps with eight
  engines on an H200 instead of 18.6-18.7. `SDFARM_ATTN_FUSED=0` off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent / "patches"


class PatchError(RuntimeError):
    """A patch does not fit the source; the message names the patch, the file and the text."""


@dataclass(frozen=True)
class Edit:
    """Replace `old`, which must occur exactly once in `path`, with `new`."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Patch:
    name: str
    backends: frozenset[str]
    adds: dict[str, str] = field(default_factory=dict)  # source path -> file in patches/
    edits: tuple[Edit, ...] = ()


IM2COL = "ggml/src/ggml-cuda/im2col.cu"
NORM = "ggml/src/ggml-cuda/norm.cu"
NORM_H = "ggml/src/ggml-cuda/norm.cuh"
GRAPH = "ggml/src/ggml-cuda/ggml-cuda.cu"
CONV = "ggml/src/ggml-cuda/conv2d.cu"
CONV_H = "ggml/src/ggml-cuda/conv2d.cuh"
FATTN = "ggml/src/ggml-cuda/fattn.cu"
SD = "src/stable-diffusion.cpp"
GENERATE_IMAGE = (
    "SD_API sd_image_t* generate_image(sd_ctx_t* sd_ctx,"
    " const sd_img_gen_params_t* sd_img_gen_params) {\n"
)
SD_EXT = "src/ggml_extend.hpp"
# The flash-attention path's view of its output keeps the first image's heads only: right for
# the one image the runtime ever sends through a UNet call, wrong for a batch.
FLASH_VIEW = (
    "                kqv = ggml_view_3d(ctx, kqv, d_head, n_head, L_q,"
    " kqv->nb[1], kqv->nb[2], 0);\n"
)
SAMPLE_LOOP = (
    "    int64_t denoise_start = ggml_time_ms();\n"
    "    for (int b = 0; b < request.batch_count; b++) {\n"
)
# The first statement of ggml's own fusions in the graph loop: our hooks go before it.
FUSION_BLOCK = "                    ggml_cuda_topk_moe_args args;\n"
# ggml-cuda.cu's cuBLAS helpers, which the linear fusion calls, are defined above this line.
LINEAR_ANCHOR = (
    "static void ggml_cuda_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,"
    " const ggml_tensor * src1, ggml_tensor * dst) {\n"
)


def after(path: str, anchor: str, text: str) -> Edit:
    """Insert `text` right after `anchor`, which must occur exactly once in `path`."""
    return Edit(path, anchor, anchor + text)


def before(path: str, anchor: str, text: str) -> Edit:
    """Insert `text` right before `anchor`, which must occur exactly once in `path`."""
    return Edit(path, anchor, text + anchor)


def fusion_hook(op: str, fuse: str) -> str:
    """The graph loop's try of one of our fusions at a node of `op`, placed in its fusion block
    (GGML_CUDA_DISABLE_FUSION skips it with the rest): `fuse` returns the index of the last
    node it computed, or -1 when it launched nothing and ggml computes the node."""
    return (
        f"                    if (node->op == GGML_OP_{op}) {{\n"
        "                        const int sdfarm_last =\n"
        f"                            {fuse}(*cuda_ctx, cgraph, i);\n"
        "                        if (sdfarm_last > i) {\n"
        "                            i = sdfarm_last;\n"
        "                            continue;\n"
        "                        }\n"
        "                    }\n"
    )


# The fused group norm is tried first; the convolution with its bias add through cuDNN; a linear
# layer with its bias add and the GEGLU or residual add after it (where ggml would take cuBLAS's
# f16 path); a layer norm with its weight and bias; the self-attention from to_q's product to
# the attention through cuDNN.
GN_FUSION = fusion_hook("GROUP_NORM", "sdfarm_group_norm_fuse")
CONV_FUSION = fusion_hook("CONV_2D", "sdfarm_conv2d_fuse")
LINEAR_FUSION = fusion_hook("MUL_MAT", "sdfarm_linear_fuse")
LN_FUSION = fusion_hook("NORM", "sdfarm_layer_norm_fuse")
ATTN_FUSION = fusion_hook("MUL_MAT", "sdfarm_attn_fuse")

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="ggml-cuda-im2col-tiled",
        backends=frozenset({"cuda"}),
        adds={"ggml/src/ggml-cuda/im2col_tiled.cuh": "im2col_tiled.cuh"},
        edits=(
            after(IM2COL, '#include "im2col.cuh"\n', '#include "im2col_tiled.cuh"\n'),
            before(
                IM2COL,
                "    const int64_t IC_KH_KW = IC * KH * KW;\n"
                "    const int64_t num_blocks = (IC_KH_KW + CUDA_IM2COL_BLOCK_SIZE - 1)"
                " / CUDA_IM2COL_BLOCK_SIZE;\n",
                "    if (sdfarm_im2col_tiled<T>(x, dst, IW, IH, OW, OH, KW, KH, IC, N, IC_IH_IW,"
                " IH_IW, s0, s1, p0, p1, d0, d1, stream)) {\n"
                "        return;\n"
                "    }\n",
            ),
        ),
    ),
    Patch(
        name="ggml-cuda-group-norm-split",
        backends=frozenset({"cuda"}),
        adds={
            "ggml/src/ggml-cuda/group_norm_split.cuh": "group_norm_split.cuh",
            "ggml/src/ggml-cuda/sdfarm_graph.cuh": "sdfarm_graph.cuh",
        },
        edits=(
            after(NORM, '#include "norm.cuh"\n', '#include "group_norm_split.cuh"\n'),
            after(
                NORM,
                "void ggml_cuda_op_group_norm("
                "ggml_backend_cuda_context & ctx, ggml_tensor * dst) {\n",
                "    if (sdfarm_group_norm_launch(ctx, dst, dst, nullptr, nullptr)) {\n"
                "        return;\n"
                "    }\n",
            ),
            after(
                NORM_H,
                "void ggml_cuda_op_group_norm("
                "ggml_backend_cuda_context & ctx, ggml_tensor * dst);\n",
                "\nint sdfarm_group_norm_fuse(ggml_backend_cuda_context & ctx,"
                " ggml_cgraph * cgraph, int i);\n",
            ),
            after(GRAPH, "                if (!disable_fusion) {\n", GN_FUSION),
        ),
    ),
    Patch(
        name="ggml-cuda-conv2d-cudnn",
        backends=frozenset({"cuda"}),
        adds={
            "ggml/src/ggml-cuda/conv2d_cudnn.cuh": "conv2d_cudnn.cuh",
            "ggml/src/ggml-cuda/sdfarm_graph.cuh": "sdfarm_graph.cuh",
        },
        edits=(
            after(CONV, '#include "convert.cuh"\n', '#include "conv2d_cudnn.cuh"\n'),
            after(
                CONV,
                "void ggml_cuda_op_conv2d(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {\n",
                "    if (sdfarm_cudnn_conv2d(ctx, dst, dst, nullptr)) {\n        return;\n    }\n",
            ),
            after(
                CONV_H,
                "void ggml_cuda_op_conv2d(ggml_backend_cuda_context & ctx, ggml_tensor * dst);\n",
                "int sdfarm_conv2d_fuse("
                "ggml_backend_cuda_context & ctx, ggml_cgraph * cgraph, int i);\n",
            ),
            before(GRAPH, FUSION_BLOCK, CONV_FUSION),
        ),
    ),
    Patch(
        name="ggml-cuda-fattn-cudnn",
        backends=frozenset({"cuda"}),
        adds={"ggml/src/ggml-cuda/fattn_cudnn.cuh": "fattn_cudnn.cuh"},
        edits=(
            after(FATTN, '#include "fattn.cuh"\n', '#include "fattn_cudnn.cuh"\n'),
            after(
                FATTN,
                "void ggml_cuda_flash_attn_ext("
                "ggml_backend_cuda_context & ctx, ggml_tensor * dst) {\n"
                "    ggml_cuda_set_device(ctx.device);\n",
                "    if (sdfarm_cudnn_fattn(ctx, dst)) {\n        return;\n    }\n",
            ),
        ),
    ),
    Patch(
        name="ggml-cuda-linear-fused",
        backends=frozenset({"cuda"}),
        adds={
            "ggml/src/ggml-cuda/linear_fused.cuh": "linear_fused.cuh",
            "ggml/src/ggml-cuda/sdfarm_graph.cuh": "sdfarm_graph.cuh",
        },
        edits=(
            before(GRAPH, LINEAR_ANCHOR, '#include "ggml-cuda/linear_fused.cuh"\n\n'),
            before(GRAPH, FUSION_BLOCK, LINEAR_FUSION),
        ),
    ),
    Patch(
        name="ggml-cuda-layer-norm-fused",
        backends=frozenset({"cuda"}),
        adds={
            "ggml/src/ggml-cuda/layer_norm_fused.cuh": "layer_norm_fused.cuh",
            "ggml/src/ggml-cuda/sdfarm_graph.cuh": "sdfarm_graph.cuh",
        },
        edits=(
            after(NORM, '#include "norm.cuh"\n', '#include "layer_norm_fused.cuh"\n'),
            after(
                NORM_H,
                "void ggml_cuda_op_norm(ggml_backend_cuda_context & ctx, ggml_tensor * dst);\n",
                "\nint sdfarm_layer_norm_fuse(ggml_backend_cuda_context & ctx,"
                " ggml_cgraph * cgraph, int i);\n",
            ),
            before(GRAPH, FUSION_BLOCK, LN_FUSION),
        ),
    ),
    Patch(
        name="ggml-cuda-attn-fused",
        backends=frozenset({"cuda"}),
        adds={
            "ggml/src/ggml-cuda/attn_fused.cuh": "attn_fused.cuh",
            "ggml/src/ggml-cuda/sdfarm_graph.cuh": "sdfarm_graph.cuh",
        },
        edits=(
            after(
                GRAPH,
                '#include "ggml-cuda/linear_fused.cuh"\n',
                '#include "ggml-cuda/attn_fused.cuh"\n',
            ),
            before(GRAPH, FUSION_BLOCK, ATTN_FUSION),
        ),
    ),
    Patch(
        name="sd-batch-sampling",
        backends=frozenset({"cpu", "cuda", "vulkan", "metal"}),
        adds={"src/sdfarm_batch_sample.hpp": "batch_sample.hpp"},
        edits=(
            before(SD, GENERATE_IMAGE, '#include "sdfarm_batch_sample.hpp"\n\n'),
            Edit(
                SD_EXT,
                FLASH_VIEW,
                "                if (N == 1) {\n"
                "    "
                + FLASH_VIEW
                + "                } else {  // sdfarm: [d_head, n_head * N, L_q]"
                " -> [N, L_q, n_head, d_head]\n"
                "                    kqv = ggml_reshape_4d(ctx, kqv, d_head, n_head, N, L_q);\n"
                "                    kqv = ggml_permute(ctx, kqv, 0, 1, 3, 2);\n"
                "                }\n",
            ),
            Edit(
                SD,
                SAMPLE_LOOP,
                "    int64_t denoise_start = ggml_time_ms();\n"
                "    const int sdfarm_batched = sdfarm_batch_sample(\n"
                "        sd_ctx, sd_img_gen_params, request, plan, latents, embeds,"
                " final_latents);\n"
                "    if (sdfarm_batched < 0) {\n"
                "        if (sd_ctx->sd->free_params_immediately) {\n"
                "            sd_ctx->sd->diffusion_model->free_params_buffer();\n"
                "        }\n"
                "        return nullptr;\n"
                "    }\n"
                "    for (int b = sdfarm_batched ? request.batch_count : 0;"
                " b < request.batch_count; b++) {\n",
            ),
        ),
    ),
)


def for_backend(backend: str) -> list[Patch]:
    return [p for p in PATCHES if backend in p.backends]


def patch_id(patches: list[Patch]) -> str:
    """A digest of what the patches change ('' for none), for the build's cache key."""
    if not patches:
        return ""
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0")
        for dest, name in sorted(p.adds.items()):
            h.update(dest.encode() + b"\0" + (HERE / name).read_bytes())
        for e in p.edits:
            h.update(f"{e.path}\0{e.old}\0{e.new}\0".encode())
    return h.hexdigest()[:16]


def patched_text(text: str, edit: Edit, patch: str) -> str:
    count = text.count(edit.old)
    if count != 1:
        raise PatchError(
            f"patch {patch}: {edit.path} holds the text to replace {count} times, not once "
            f"(first line: {edit.old.splitlines()[0].strip()!r}); the source is not the pinned one"
        )
    return text.replace(edit.old, edit.new)


def apply(src: Path, out: Path, patches: list[Patch]) -> Path:
    """A copy of `src` at `out` with `patches` applied: files hard-linked where possible (the
    tree is 167 MB), every file a patch writes a new file, so `src` never changes."""
    if (out / ".sdfarm-patched").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link, ignore=shutil.ignore_patterns(".git"))
    for p in patches:
        for dest, name in p.adds.items():
            target = tmp / dest
            target.unlink(missing_ok=True)
            shutil.copyfile(HERE / name, target)
        for e in p.edits:
            target = tmp / e.path
            text = patched_text(target.read_text(), e, p.name)
            target.unlink()
            target.write_text(text)
    (tmp / ".sdfarm-patched").write_text("\n".join(p.name for p in patches) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
