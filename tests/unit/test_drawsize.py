"""The sizes the runtime draws and how a job gets its asked size back (sdfarm.native.drawsize):
the rounding rule per architecture, the centre crop, input images padded (never stretched)
into the drawn canvas, and the estimate of the drawn size."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sdfarm.native.drawsize import Canvas, round_up, size_multiple
from sdfarm.native.estimate import ModelFacts


@pytest.mark.parametrize(
    ("arch", "asked", "drawn"),
    [("sd1", (72, 72), (128, 128)), ("sdxl", (1000, 1024), (1024, 1024)),
     ("sd2", (512, 520), (512, 576)), ("flux", (72, 72), (72, 72)),
     ("dit", (136, 64), (136, 64)), ("unknown", (72, 80), (72, 80))],
)  # fmt: skip
def test_unets_draw_multiples_of_64_and_dits_the_size_asked(
    arch: str, asked: tuple[int, int], drawn: tuple[int, int]
) -> None:
    assert Canvas.of(asked, asked, size_multiple(arch)).drawn == drawn


def test_round_up_matches_the_runtimes_align_up() -> None:
    assert [round_up(v, 64) for v in (64, 65, 72, 128, 129)] == [64, 128, 128, 128, 192]


def test_the_crop_is_the_asked_size_at_the_centre_of_the_drawn() -> None:
    canvas = Canvas.of((72, 64), (72, 64), 64)
    drawn = np.arange(128 * 64, dtype=np.uint32).reshape(64, 128)
    image = Image.fromarray((drawn % 251).astype(np.uint8), "L")
    out = canvas.crop(image)
    assert out.size == (72, 64)
    assert np.array_equal(np.asarray(out), np.asarray(image)[:, 28:100])
    assert canvas.crop(out) is out  # already the asked size: untouched


def test_a_hires_jobs_final_image_is_cropped_from_its_rounded_target() -> None:
    canvas = Canvas.of((72, 64), (144, 128), 64)
    assert (canvas.drawn, canvas.final_drawn) == ((128, 64), (192, 128))
    assert canvas.crop(Image.new("RGB", (192, 128))).size == (144, 128)


def test_inputs_are_padded_at_the_centre_with_their_border_and_a_mask_with_keep() -> None:
    canvas = Canvas.of((72, 64), (72, 64), 64)
    rgb = np.zeros((64, 72, 3), np.uint8)
    rgb[:, :36] = 10
    rgb[:, 36:] = 200
    out = np.frombuffer(canvas.pad(rgb.tobytes(), 3), np.uint8).reshape(64, 128, 3)
    assert np.array_equal(out[:, 28:100], rgb)  # the image itself, unstretched
    assert (out[:, :28] == 10).all() and (out[:, 100:] == 200).all()  # its border, repeated
    mask = np.full((64, 72, 1), 255, np.uint8)
    padded = np.frombuffer(canvas.pad(mask.tobytes(), 1, mask=True), np.uint8).reshape(64, 128)
    assert (padded[:, 28:100] == 255).all() and (padded[:, :28] == 0).all()
    same = Canvas.of((64, 64), (64, 64), 64)
    assert same.pad(b"abc", 3) == b"abc" and not same.rounded


def test_the_estimate_is_the_drawn_sizes_and_travels_in_the_heartbeat() -> None:
    unet = ModelFacts(1 << 30, (512, 512), decode_per_pixel=100, size_multiple=64)
    assert unet.estimate(72, 72) == unet.estimate(128, 128) > unet.estimate(64, 64)
    assert ModelFacts.from_json(unet.as_json()) == unet
    dit = ModelFacts(1 << 30, (512, 512), decode_per_pixel=100)
    assert dit.estimate(72, 72) < dit.estimate(128, 128)
    assert "size_multiple" not in dit.as_json()
    assert ModelFacts.cautious([unet, dit]).size_multiple == 64
