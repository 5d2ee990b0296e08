"""The size the runtime really draws, and how a job still gets exactly the size it asked.

master-596 rounds every generation's width and height UP to a multiple of its VAE's scale
times the diffusion model's down factor (src/stable-diffusion.cpp,
`GenerationRequest::align_image_size`): 8 x 8 = 64 pixels for the UNets of SD 1.x, 2.x and
XL, 8 x 1 = 8 for the DiTs (Flux, SD3, the tiny Ovis-Image model). It then draws the whole
larger image, stretches input images (init, mask, control) to it, and returns it: measured
with the SD 1.x test model, 72x72 came back 128x128 and 136x64 192x64, while our metadata said
72x72. The hires pass's target is rounded the same way.

What a job gets instead (a demanding user asks for a size because something downstream needs
that size): exactly the asked width x height, the centre of what the runtime drew, cropped
(no resampling: every pixel is the model's own, nothing is squeezed). Input images are put
into the drawn canvas unstretched, at the same centre, their border repeated outward (a
mask's border is "keep"), so the crop lines up pixel for pixel with the init image and an
inpainted picture's kept part stays where it was. The job's warnings say what was drawn and
cropped, its metadata carries `drawn_size`, and its memory estimate is the drawn size's
(sdfarm.native.estimate.ModelFacts rounds up by `size_multiple`), since that is what the
runtime holds. The size in the PNG's chunks and in the infotext is the asked one, which is the
image's size. To have the whole drawn image, ask a multiple of 64 (on a UNet).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from sdfarm.native.params import SIZE_STEP

UNET_ARCHITECTURES = ("sd1", "sd2", "sdxl")
UNET_MULTIPLE = 64
"""The runtime's size multiple for a UNet: its VAE's 8 times the UNet's three 2x downs."""


def size_multiple(architecture: str) -> int:
    """The multiple the runtime rounds sizes up to for a model of `architecture`
    (sdfarm.native.roles.guess_architecture): 64 for the UNets, else our 8-pixel step, which
    every size already is (a DiT with a 16x VAE, Flux.2's, would round to 16: not yet told
    apart here)."""
    return UNET_MULTIPLE if architecture in UNET_ARCHITECTURES else SIZE_STEP


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`, as the runtime's align_up does."""
    return -(-int(value) // multiple) * multiple


@dataclass(frozen=True)
class Canvas:
    """A job's asked sizes (its first pass and its final image, which differ with a hires
    pass) and what the runtime draws for each."""

    asked: tuple[int, int]
    drawn: tuple[int, int]
    final: tuple[int, int]
    final_drawn: tuple[int, int]

    @classmethod
    def of(cls, asked: tuple[int, int], final: tuple[int, int], multiple: int) -> Canvas:
        """The canvas of a job asking `asked` (and `final` after its hires pass)."""
        return cls(
            asked,
            (round_up(asked[0], multiple), round_up(asked[1], multiple)),
            final,
            (round_up(final[0], multiple), round_up(final[1], multiple)),
        )

    @property
    def rounded(self) -> bool:
        """Whether the runtime draws more than was asked (the output is then cropped)."""
        return self.drawn != self.asked or self.final_drawn != self.final

    def crop(self, image: Image.Image) -> Image.Image:
        """The asked final size out of the centre of a drawn image (unchanged when the runtime
        drew exactly that, or something unexpected: a crop never invents pixels)."""
        w, h = self.final
        if image.size == (w, h) or image.width < w or image.height < h:
            return image
        left, top = (image.width - w) // 2, (image.height - h) // 2
        return image.crop((left, top, left + w, top + h))

    def pad(self, raw: bytes, channels: int, mask: bool = False) -> bytes:
        """Pixels of the asked first-pass size (8-bit, `channels` a pixel) put at the centre
        of the drawn size, the border repeated outward (a mask's padding is 0: keep).
        Plain bytes, no numpy: numpy imported before a load crashes the runtime on some hosts
        (docs/gpu.md), and this module is imported by the engine."""
        (w, h), (dw, dh) = self.asked, self.drawn
        if (w, h) == (dw, dh):
            return raw
        left, top = (dw - w) // 2, (dh - h) // 2
        right, bottom = dw - w - left, dh - h - top
        stride = w * channels
        rows = []
        for y in range(h):
            row = raw[y * stride : (y + 1) * stride]
            if mask:
                first = last = bytes(channels)
            else:
                first, last = row[:channels], row[-channels:]
            rows.append(first * left + row + last * right)
        blank = bytes(dw * channels)
        head = [blank if mask else rows[0]] * top
        tail = [blank if mask else rows[-1]] * bottom
        return b"".join(head + rows + tail)

    def warning(self, model: str, multiple: int, drawn: tuple[int, int]) -> str:
        """The job's warning when the runtime drew `drawn`, more than the final size asked."""
        (w, h), (dw, dh) = self.final, drawn
        return (
            f"model {model} is drawn in multiples of {multiple} pixels: the runtime drew "
            f"{dw}x{dh} and the {w}x{h} asked is its centre, cropped (input images were placed "
            f"unstretched at that centre); ask multiples of {multiple} to keep the whole image"
        )
