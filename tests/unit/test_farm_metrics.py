"""The pure parts of the farm's metrics: the hashes parse into counters and cumulative
histograms, bucket labels are written as prometheus_client writes them, the Lua constants
carry every bound."""

from __future__ import annotations

import math

from prometheus_client.utils import floatToGoString

from sdfarm.store.metrics import (
    BUCKETS,
    bucket_label,
    lua_constants,
    parse_jobs,
    parse_seconds,
)


def test_counters_parse_by_kind_model_and_device() -> None:
    raw = {
        b"done|m|h/CPU": b"3",
        b"submitted|m|": b"5",
        b"failed|a|b|h/GPU0": b"1",  # a bar in a model name still parses
        b"bogus|m|h/CPU": b"9",  # not a kind we count
    }
    assert parse_jobs(raw) == {
        ("done", "m", "h/CPU"): 3,
        ("submitted", "m", ""): 5,
        ("failed", "a|b", "h/GPU0"): 1,
    }


def test_histograms_are_made_cumulative_over_every_bound() -> None:
    raw = {
        b"load|m|h/CPU|0.5": b"2",
        b"load|m|h/CPU|5.0": b"1",
        b"load|m|h/CPU|+Inf": b"1",
        b"load|m|h/CPU|sum": b"7204.25",
    }
    hist = parse_seconds(raw)[("load", "m", "h/CPU")]
    buckets = dict(hist.buckets)
    assert len(hist.buckets) == len(BUCKETS) + 1 and hist.buckets[-1][0] == "+Inf"
    assert buckets["0.25"] == 0 and buckets["0.5"] == 2 and buckets["2.5"] == 2
    assert buckets["5.0"] == 3 and buckets["3600.0"] == 3 and buckets["+Inf"] == 4
    assert hist.count == 4 and hist.total == 7204.25


def test_bucket_labels_match_prometheus_client() -> None:
    for bound in (*BUCKETS, math.inf):
        assert bucket_label(bound) == floatToGoString(bound)


def test_lua_constants_carry_every_bound_in_order() -> None:
    text = lua_constants()
    bounds = text.split("METRICS_BOUNDS = {")[1].split("}")[0].split(", ")
    assert [float(b) for b in bounds] == list(BUCKETS)
    assert list(BUCKETS) == sorted(BUCKETS)
