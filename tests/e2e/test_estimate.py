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


def test_scheduler_worker_cache_and_engine_judge_a_job_by_one_estimate(models_dir: Path) -> None:
    """A 384x384 job (above the native 256x256, so the size term counts) on a real farm: the
    estimate the scheduler placed it with (its record), the figure the worker's engine cache
    made room for (the `loading` event) and the one the engine checked (the result's
    metadata) are one number, and an engine loaded here computes the same."""
    from sdfarm.client.farm import Farm
    from sdfarm.native.engine import Engine

    from helpers.gateway import cpu_farm

    with cpu_farm(models_dir, "estimatehost") as local, Farm(local.url) as farm:
        job = farm.submit("tiny-f16", "one estimate", width=384, height=384, steps=1)
        result = job.result(120)
        placed = int(job.record()["estimate"])
        loading = [e for e in job.events() if e["event"] == "loading"]
    assert [e["estimate"] for e in loading] == [placed]  # this job made the worker load
    assert result.metadata["estimate"] == placed
    with Engine.load(models_dir / "tiny-f16", threads=1) as engine:
        assert engine.estimate_for(384, 384) == placed
        assert engine.capabilities.estimate == engine.facts.resident() < placed
