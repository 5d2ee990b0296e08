"""Which decoder turns a job's latent into pixels: the model's full VAE or its TAESD.

A job's `decoder` (sdfarm.native.params) is `default` (the model's own: its full VAE, or its
TAESD when it has no VAE), `vae` or `taesd`. TAESD is a tiny distilled decoder: on the H200 it
decoded a 512x512 image in 20 ms against the full VAE's 70 ms (300 against 60 at 1024;
docs/gpu.md), at a quality cost docs/gpu.md states.

master-596 fixes the decoder when it makes a context (src/stable-diffusion.cpp, new_sd_ctx):
with `taesd_path` set and `tae_preview_only` off, the TAESD is the context's only decoder and
the VAE's weights are not even read; with `tae_preview_only` on, the VAE decodes and the TAESD
only draws previews; `sd_img_gen_params_t` has no decoder field. Measured with the tiny model
(`make_vae_test_model`): a context of VAE + TAESD with tae_preview_only gives the VAE-only
context's pixels, one without it the TAESD-only context's, each the same on every call. So
one context cannot decode both ways: a TAESD-decoded job of a model whose own decoder is its
VAE runs on another engine, named by its engine key (`+decoder:taesd`,
sdfarm.native.enginekey), as a ControlNet's does.
"""

from __future__ import annotations

from typing import Any

from sdfarm.native.errors import InvalidParameterError

DECODERS = ("default", "vae", "taesd")
"""A job's choices: the model's own decoder, its full VAE, its TAESD."""


def has_vae(model: Any) -> bool:
    """Whether `model` (sdfarm.native.model.Model) holds a full VAE decoder: a `vae` file or
    a checkpoint with VAE decoder tensors (`first_stage_model.decoder.*`, `vae.decoder.*`)."""
    if "vae" in model.files:
        return True
    ckpt = model.files.get("checkpoint")
    return ckpt is not None and any(
        n.startswith(("first_stage_model.decoder.", "vae.decoder.")) for n in ckpt.header.tensors
    )


def available(model: Any) -> tuple[str, ...]:
    """The decoders `model` can decode with, the full VAE first: ("vae", "taesd"), ("vae",),
    ("taesd",) or () (a model of a diffusion model alone, which the runtime refuses)."""
    return tuple(d for d, ok in (("vae", has_vae(model)), ("taesd", "taesd" in model.files)) if ok)


def own(decoders: tuple[str, ...] | list[str]) -> str:
    """The decoder a model with `decoders` uses when a job does not choose: the full VAE
    (the better image), else the TAESD."""
    return "taesd" if "vae" not in decoders and "taesd" in decoders else "vae"


def resolve(asked: str, decoders: tuple[str, ...] | list[str], model: str) -> str:
    """The decoder (vae or taesd) a job asking `asked` gets from model `model` that has
    `decoders`; InvalidParameterError naming `decoder` when the model has not got it."""
    if asked not in DECODERS:
        raise InvalidParameterError(
            "decoder", f"unknown decoder {asked!r}; choose one of {', '.join(DECODERS)}"
        )
    if asked == "default":
        return own(decoders)
    if asked not in decoders:
        what = {"taesd": "no TAESD file (role taesd)", "vae": "no full VAE"}[asked]
        has = f"it decodes with {' or '.join(decoders)}" if decoders else "it has no decoder"
        raise InvalidParameterError(
            "decoder", f"model {model!r} has {what}: {has}; use decoder default"
        )
    return asked


def engine_decoder(asked: str) -> str:
    """The decoder part of a job's engine key: "taesd" for a job that asks for the TAESD,
    "" otherwise (the model's own engine, which decodes with its VAE when it has one). The
    key follows the job alone, so every door and the worker agree on it without knowing the
    model's files; the cost: a model whose only decoder is its TAESD gets a second, identical
    engine for jobs that name `taesd` beside jobs that do not."""
    return "taesd" if asked == "taesd" else ""


def ctx_settings(
    decoders: tuple[str, ...], decoder: str, taesd_encodes: bool, encodes: bool
) -> tuple[bool, bool]:
    """(pass the TAESD file to the runtime, tae_preview_only) for an engine decoding with
    `decoder` (vae or taesd) of a model with `decoders`. An engine decoding with the VAE
    keeps the TAESD for previews (a few MB; a TAE preview then costs a TAESD decode, not a
    VAE decode), unless the context encodes (`encodes`) and the TAESD has no encoder: the
    runtime then builds the preview TAESD's encoder too and would miss its tensors."""
    if "taesd" not in decoders:
        return False, False
    if decoder == "taesd":
        return True, False
    return (taesd_encodes or not encodes), True
