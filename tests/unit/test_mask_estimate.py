"""A UNet's self-attention key mask in the estimate: the runtime builds it where the latent's
token count is not a multiple of 256 (native/backendlimits.py), and its compute buffer grows
with it (MASK_BYTES_PER_VALUE, measured on the CPU), so the estimate must count it there and
nowhere else."""

from __future__ import annotations

import pytest

from sdfarm.native.backendlimits import self_attention_mask_values
from sdfarm.native.estimate import MASK_BYTES_PER_VALUE, ModelFacts

UNET = ModelFacts(1 << 30, (512, 512), decode_per_pixel=100, size_multiple=64)
DIT = ModelFacts(1 << 30, (512, 512), decode_per_pixel=100)


@pytest.mark.parametrize(("size", "values"), [(512, 0), (576, 5184 * 5376), (640, 0),
                                              (1216, 23104 * 23296), (1920, 0)])  # fmt: skip
def test_the_mask_counts_where_the_tokens_are_off_the_stride(size: int, values: int) -> None:
    assert self_attention_mask_values(size, size) == values
    assert UNET.mask_bytes(size, size) == values * MASK_BYTES_PER_VALUE
    assert DIT.mask_bytes(size, size) == 0


def test_the_estimate_carries_it_tiled_or_not() -> None:
    plain = ModelFacts(1 << 30, (512, 512), decode_per_pixel=100)  # the same, without the mask
    for tiled in (False, True):
        grown = UNET.estimate(1216, 1216, tiled=tiled) - plain.estimate(1216, 1216, tiled=tiled)
        assert grown == UNET.mask_bytes(1216, 1216) > 2**30
        assert UNET.estimate(1024, 1024, tiled=tiled) == plain.estimate(1024, 1024, tiled=tiled)
    assert UNET.estimate(576, 576) - plain.estimate(576, 576) == 5184 * 5376 * MASK_BYTES_PER_VALUE
