"""The estimate holds above the native size: a fresh process generating at 384x384 (above the
tiny model's native 256x256) peaks below Engine.estimate_for(384, 384). The full table for
more sizes comes from bench/estimate_growth.py (bench/results/estimate_growth-*.json)."""

from __future__ import annotations

import sys
from pathlib import Path

from sdfarm.native.memory import estimate_bytes

BENCH = Path(__file__).resolve().parents[2] / "bench" / "estimate_growth.py"


def test_peak_rss_above_the_native_size_stays_under_the_grown_estimate(tiny_models):
    sys.path.insert(0, str(BENCH.parent))
    try:
        from estimate_growth import measure
    finally:
        sys.path.pop(0)
    row = measure(str(tiny_models[0]), 384, 384, 1)
    assert row["native_size"] == [256, 256]
    assert 0 < row["peak_rss"] <= row["estimate"]
    total = sum(f.stat().st_size for f in tiny_models[0].iterdir() if f.suffix == ".safetensors")
    assert row["estimate"] > estimate_bytes(total, 256, 256, 256 * 256)
