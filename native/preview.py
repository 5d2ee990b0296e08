"""Previews of a running generation: which kind the runtime makes, the shim's slot that holds
the latest frame, and the small image a job's events carry.

The runtime (master-596) calls its preview callback on the thread that runs `generate_image`,
after the steps it previews, with frames it frees when the callback returns. So the shim owns
that callback (`sdf_preview_*` in shim/sdfarm_shim.c): it copies the first frame, downscaled to
PREVIEW_SIDE, into one slot the next frame overwrites (counted), and Python fetches it from
the engine's watcher thread, as it does progress. The runtime's own `interval` argument is
read by nothing in master-596 (it previews every step); the shim turns the runtime's preview
on only for every `preview_every`-th step, so the skipped steps cost nothing.

Kinds (sd.cpp's preview_t): TAE decodes the latent with the model's TAESD, whether the
engine decodes its images with it (a job's decoder taesd, or a model with no full VAE) or
holds it only for previews beside the full VAE (`tae_preview_only`, sdfarm.native.decoders:
a few MB more); PROJ projects the latent's channels to RGB with a fixed matrix (no model,
latent-sized frames, nothing for families the runtime has no matrix for). VAE would run the
full VAE decode once per previewed step: never chosen.

What it costs, measured with the tiny model on the 2-core development VM (shared with other
work: CPU seconds of the process are steadier than wall time there), 256x256, 4 steps,
2 threads, medians of 5 interleaved runs (bench/preview_cost.py,
bench/results/preview_cost-tiny-cpu.json): no previews 3.83 CPU s (7.5 s wall); TAE every step
15.5 CPU s (+304%; 33.9 s wall, +354%), every second step 10.1 (+162%): each TAE preview is
one TAESD decode at the image's size, about 2.9 CPU s here, which is most of what the tiny
model's whole job costs (its diffusion model is one block, so its final decode dominates);
PROJ every step 4.52 CPU s (+18%, within the runs' spread of 3.4..4.8 s for PROJ and 3.6..4.3
for none). Images are identical with and without previews. With a real model a step costs
far more than a TAESD decode (on the CPU a full-size SD 2.x step is seconds, its TAESD
decode at 512 about 4 s on 2 cores; on a GPU a TAESD decode takes milliseconds), so
preview_every is the knob: every step on a CPU is expensive, every 5th or 10th is not.
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from typing import Any

from PIL import Image

PREVIEW_SIDE = 256
"""The longest side of a preview, in pixels (the shim downscales frames to it)."""
MAX_PREVIEW_BYTES = 32 * 1024
"""The most bytes of one encoded preview (an event carries it as base64, 4/3 of that): an
image that does not fit at PREVIEW_SIDE is encoded smaller until it does."""
PREVIEW_QUALITY = 50
PREVIEW_FORMAT = "webp"
MODES = {"none": 0, "proj": 1, "tae": 2, "vae": 3}  # sd.cpp's preview_t, in its order


def mode_for(roles: set[str] | frozenset[str] | list[str]) -> str:
    """The preview kind for an engine whose context holds files of these roles: TAE when a
    TAESD is among them (as the decoder or for previews only), else the latent projection.
    `$SDFARM_PREVIEW_MODE` (proj, tae, vae) overrides, for measurements."""
    forced = os.environ.get("SDFARM_PREVIEW_MODE", "")
    if forced in MODES and forced != "none":
        return forced
    return "tae" if "taesd" in roles else "proj"


@dataclass(frozen=True)
class Preview:
    """One preview: the sampling step it shows (of `steps`; a batch or a high-resolution pass
    counts its steps again), its number in the generation, and the image (WebP bytes).
    `overwritten` counts frames the runtime made since the previous one that nobody fetched."""

    seq: int
    step: int
    steps: int
    width: int
    height: int
    data: bytes
    format: str = PREVIEW_FORMAT
    overwritten: int = 0

    @property
    def image(self) -> Image.Image:
        img = Image.open(io.BytesIO(self.data))
        img.load()
        return img

    def as_event(self) -> dict[str, Any]:
        """The fields of a job's `preview` event (the image base64)."""
        return {
            "seq": self.seq,
            "step": self.step,
            "steps": self.steps,
            "width": self.width,
            "height": self.height,
            "format": self.format,
            "image": base64.b64encode(self.data).decode(),
        }

    @classmethod
    def from_event(cls, doc: dict[str, Any]) -> Preview:
        """A preview from the fields of its event (KeyError/ValueError when malformed)."""
        return cls(
            seq=int(doc["seq"]),
            step=int(doc["step"]),
            steps=int(doc.get("steps") or 0),
            width=int(doc["width"]),
            height=int(doc["height"]),
            data=base64.b64decode(doc["image"], validate=True),
            format=str(doc.get("format", PREVIEW_FORMAT)),
        )

    def data_url(self) -> str:
        return f"data:image/{self.format};base64," + base64.b64encode(self.data).decode()


def encode(
    rgb: bytes,
    width: int,
    height: int,
    *,
    max_bytes: int = MAX_PREVIEW_BYTES,
    quality: int = PREVIEW_QUALITY,
) -> tuple[bytes, int, int]:
    """(WebP bytes, width, height) of an RGB frame, at most `max_bytes`: a frame that does
    not fit (noise compresses badly) is shrunk by 3/4 a side until it does."""
    img = Image.frombytes("RGB", (width, height), rgb)
    while True:
        buf = io.BytesIO()
        img.save(buf, "WEBP", quality=quality, method=0)
        data = buf.getvalue()
        if len(data) <= max_bytes or max(img.size) <= 16:
            return data, img.width, img.height
        img = img.resize(
            (max(1, img.width * 3 // 4), max(1, img.height * 3 // 4)), Image.Resampling.BOX
        )


class PreviewSlot:
    """Python's side of the shim's preview slot (process-wide, like the log ring)."""

    def __init__(self, ffi: Any, lib: Any, side: int = PREVIEW_SIDE) -> None:
        self._ffi, self._lib = ffi, lib
        self.side = side
        self._buf = ffi.new("uint8_t[]", side * side * 3)
        self._out = [ffi.new(t) for t in ("uint64_t*", "int*", "int*", "uint32_t*", "uint32_t*")]
        self._counts = (ffi.new("uint64_t*"), ffi.new("uint64_t*"))
        self.ignored = 0
        self.overwritten = 0

    def configure(self, mode: str, every: int) -> None:
        """Arm previews of `mode` every `every` steps (0, or mode "none": off)."""
        self.ignored = self.overwritten = 0
        self._lib.sdf_preview_configure(MODES[mode], every, self.side)

    def config(self) -> tuple[str, int]:
        """(mode, every) as the shim handed them to the runtime."""
        mode, every, side = (self._ffi.new("int*") for _ in range(3))
        self._lib.sdf_preview_config(mode, every, side)
        return {v: k for k, v in MODES.items()}[mode[0]], int(every[0])

    def take_raw(self) -> tuple[int, int, int, int, int, bytes, int] | None:
        """(seq, step, steps, width, height, RGB bytes, frames overwritten since the last
        take) of the latest frame when it is newer than the last taken, else None. The
        counters `overwritten` and `ignored` add up since `configure`."""
        seq, step, steps, w, h = self._out
        over, ign = self._counts
        n = self._lib.sdf_preview_get(seq, step, steps, w, h, self._buf, len(self._buf), over, ign)
        if n == 0:
            return None
        self.overwritten += int(over[0])
        self.ignored += int(ign[0])
        data = bytes(self._ffi.buffer(self._buf, n))
        return int(seq[0]), int(step[0]), int(steps[0]), int(w[0]), int(h[0]), data, int(over[0])

    def take(self) -> Preview | None:
        """The latest frame encoded (bounded), when there is a new one."""
        raw = self.take_raw()
        if raw is None:
            return None
        seq, step, steps, w, h, rgb, overwritten = raw
        data, ew, eh = encode(rgb, w, h)
        return Preview(seq, step, steps, ew, eh, data, overwritten=overwritten)

    def test_frames(self, n: int, width: int, height: int, channels: int = 3) -> None:
        """Test hook: the shim receives n frames (steps 1..n) as if the runtime sent them."""
        self._lib.sdf_preview_test_frames(n, width, height, channels)
