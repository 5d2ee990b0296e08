"""VAE tiling: the tiled estimate's terms and the one plan (sdfarm.native.tiling), as tables."""

from __future__ import annotations

import pytest

from sdfarm.native.devices import GiB, MiB
from sdfarm.native.estimate import VAE_TILE_PIXELS, ModelFacts
from sdfarm.native.memory import (
    GROWTH_BYTES_PER_PIXEL,
    SEED_OVERHEAD,
    TILED_GROWTH_BYTES_PER_PIXEL,
    estimate_bytes,
    tiled_estimate_bytes,
)
from sdfarm.native.params import BY_NAME, GenerationParams, validate
from sdfarm.native.tiling import TilingPlan, least_estimate, plan_tiling

MODEL = 2 * GiB
NATIVE = 512 * 512
SEED = MODEL + MODEL // 4 + SEED_OVERHEAD


@pytest.mark.parametrize(
    ("size", "decode_per_pixel", "expected"),
    [
        # No larger than a tile: tiling bounds nothing, the untiled estimate.
        ((256, 256), 0, SEED),
        ((512, 512), 10 * 1024, SEED + NATIVE * 10 * 1024),
        # Above a tile: every pixel above native keeps the non-decode growth; the decode's
        # share of the growth and the decode term count one 512x512 tile.
        ((1024, 1024), 0, SEED + (1024 * 1024 - NATIVE) * TILED_GROWTH_BYTES_PER_PIXEL),
        (
            (4096, 4096),
            10 * 1024,
            SEED + (4096 * 4096 - NATIVE) * TILED_GROWTH_BYTES_PER_PIXEL + NATIVE * 10 * 1024,
        ),
        # A strip: the tile is as tall as the image, 512 wide.
        ((2048, 256), 0, SEED + (2048 * 256 - NATIVE) * TILED_GROWTH_BYTES_PER_PIXEL),
    ],
)
def test_tiled_estimate_terms(size: tuple[int, int], decode_per_pixel: int, expected: int) -> None:
    got = tiled_estimate_bytes(MODEL, *size, NATIVE, VAE_TILE_PIXELS, decode_per_pixel)
    assert got == expected
    assert got <= estimate_bytes(MODEL, *size, NATIVE, decode_per_pixel=decode_per_pixel)


def test_a_tile_above_the_native_size_counts_the_decode_share_of_its_growth() -> None:
    native = 256 * 256  # the tiny model: a 512x512 tile is above its native size
    got = tiled_estimate_bytes(MODEL, 2048, 2048, native, 512)
    decode_share = GROWTH_BYTES_PER_PIXEL - TILED_GROWTH_BYTES_PER_PIXEL
    assert got == (
        SEED
        + (2048 * 2048 - native) * TILED_GROWTH_BYTES_PER_PIXEL
        + (512 * 512 - native) * decode_share
    )


def test_model_facts_tiled_estimate_is_the_memory_rule_and_grows_slower() -> None:
    facts = ModelFacts(MODEL, (512, 512), decode_per_pixel=10 * 1024)
    for side in (1024, 2048, 4096):
        tiled = facts.estimate(side, side, tiled=True)
        assert tiled == tiled_estimate_bytes(MODEL, side, side, NATIVE, 512, 10 * 1024)
        assert tiled < facts.estimate(side, side)
    # An input image to encode doubles the per-pixel decode term, tiled as well.
    assert facts.estimate(2048, 2048, encodes=True, tiled=True) == tiled_estimate_bytes(
        MODEL, 2048, 2048, NATIVE, 512, 20 * 1024
    )
    assert facts.estimate(256, 256, tiled=True) == facts.estimate(256, 256)


U, T = 20 * GiB, 8 * GiB
WARN = "decoded in tiles: the untiled estimate 20.00 GiB does not fit this device's"

# (choice, figure, tiled?, estimate used, the warning starts with)
SCENARIOS = [
    ("auto", 32 * GiB, False, U, ""),  # fits untiled: no tiling
    ("auto", U, False, U, ""),  # exactly fits
    ("auto", 12 * GiB, True, T, WARN + " 12.00 GiB"),  # only the tiled estimate fits
    ("auto", 4 * GiB, True, T, WARN + " 4.00 GiB; the tiled estimate 8.00 GiB does not"),
    ("auto", None, False, U, ""),  # no figure (unchecked): nothing to fit
    ("on", 32 * GiB, True, T, ""),  # forced on, though it fits: no warning, the user chose
    ("on", None, True, T, ""),
    ("off", 12 * GiB, False, U, ""),  # forced off: the untiled estimate, the caller refuses
    ("off", 4 * GiB, False, U, ""),
]


@pytest.mark.parametrize(("choice", "figure", "tiled", "estimate", "warning"), SCENARIOS)
def test_plan(choice: str, figure: int | None, tiled: bool, estimate: int, warning: str) -> None:
    plan = plan_tiling(U, T, choice, figure)
    assert (plan.tiled, plan.estimate) == (tiled, estimate)
    assert plan.warning.startswith(warning) and bool(plan.warning) == bool(warning)
    assert TilingPlan.from_json(plan.as_json()) == plan


def test_auto_never_tiles_when_tiling_bounds_nothing() -> None:
    assert plan_tiling(U, U, "auto", 1 * GiB) == TilingPlan(False, U)


def test_least_estimate_and_a_bad_choice() -> None:
    assert [least_estimate(U, T, c) for c in ("auto", "on", "off")] == [T, T, U]
    with pytest.raises(ValueError, match="vae_tiling 'sometimes'"):
        plan_tiling(U, T, "sometimes", 1 * MiB)


def test_the_job_parameter() -> None:
    p = BY_NAME["vae_tiling"]
    assert (p.kind, p.default, p.choices) == ("choice", "auto", ("auto", "on", "off"))
    assert "auto" in p.help and "warnings" in p.help
    assert validate(GenerationParams(prompt="x", vae_tiling="on")).vae_tiling == "on"
    with pytest.raises(Exception, match="vae_tiling"):
        validate(GenerationParams(prompt="x", vae_tiling="yes"))
