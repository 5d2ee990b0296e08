"""PNG encoding with the generation parameters in two text chunks: ours (`sdfarm`, JSON, what
read_params gives back) and A1111's infotext (`parameters`, sdfarm.native.infotext), the one
image tools read.

The chunks hold only what made the image (prompt, seed, size, steps, sampler, model, runtime
version), never timings or hosts, so the same seed gives the same PNG bytes everywhere.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

from PIL import Image, PngImagePlugin

from sdfarm.native.infotext import infotext
from sdfarm.native.params import NAMES
from sdfarm.native.upscale_params import UPSCALE_NAMES
from sdfarm.native.video_params import VIDEO_NAMES

_RECORDED = ("kind", "frame", "model", "model_hash", "lora_hashes", "drawn_size", "sd_version")
PARAM_KEYS = tuple(dict.fromkeys((*NAMES, *UPSCALE_NAMES, *VIDEO_NAMES, *_RECORDED)))
"""What the chunk records: every job parameter (sdfarm.native.params, and an upscale's,
sdfarm.native.upscale_params, its image by digest; a video's, sdfarm.native.video_params, and
the frame's index), the model with its short hashes (sdfarm.native.filehash), the size the
runtime drew when it was cropped to the asked one (sdfarm.native.drawsize) and the runtime
version."""


def png_bytes(image: Image.Image, params: Mapping[str, Any], compress_level: int = 1) -> bytes:
    """Encode `image`; `params` goes into an `sdfarm` iTXt chunk as JSON (what read_params gives
    back) plus, for an image with a prompt, a `parameters` text chunk in AUTOMATIC1111's
    infotext format (sdfarm.native.infotext), the one image viewers and readers such as
    sd-parsers recognise. The chunk is tEXt, or iTXt when the text is not Latin-1, as A1111
    writes it. Level 1 keeps encoding off the critical path (about 4x faster than the default
    level 6 for a few percent more bytes)."""
    kept = {k: params[k] for k in PARAM_KEYS if k in params}
    info = PngImagePlugin.PngInfo()
    info.add_itxt("sdfarm", json.dumps(kept, sort_keys=True))
    if "prompt" in kept:
        info.add_text("parameters", infotext(params))
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info, compress_level=compress_level)
    return buf.getvalue()


def read_params(data: bytes) -> dict[str, Any]:
    """The parameters stored by png_bytes (empty when absent)."""
    with Image.open(io.BytesIO(data)) as im:
        text = im.text.get("sdfarm") if hasattr(im, "text") else None
    return json.loads(text) if text else {}
