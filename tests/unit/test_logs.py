"""Log records: ring decoding, levels, path-to-role and prompt scrubbing (pure)."""

from __future__ import annotations

import pytest

from sdfarm.native import logs


def ring_bytes(entries):
    out = b""
    for seq, level, source, text in entries:
        data = text.encode()
        out += logs.HEADER.pack(seq, len(data), level, source, 0) + data
    return out


def test_parse_ring_round_trips_records():
    entries = [(1, 0, 0, "a.cpp:1    - hello"), (2, 3, 1, "ggml error"), (9, 2, 0, "")]
    assert logs.parse_ring(ring_bytes(entries)) == entries


def test_records_get_the_prefix_and_location_and_paths_become_roles():
    scrub = logs.Scrubber(
        {"/models/tiny/dit.safetensors": "<diffusion_model file>", "/models/tiny": "<model dir>"}
    )
    raw = [(5, 1, 0, "model.cpp:403  - loading '/models/tiny/dit.safetensors' from /models/tiny")]
    (rec,) = logs.to_records(raw, scrub)
    assert rec.message == ("stable_diffusion: loading '<diffusion_model file>' from <model dir>")
    assert rec.location == "model.cpp:403"
    assert rec.seq == 5 and rec.level == "info"


PROMPT_LINES = [
    "parse 'a zebra eating marmalade' to [['a', 1], ['zebra', 1]]",
    'split prompt "a zebra eating marmalade" to tokens ["a", "zebra", "eating"]',
    "prompt: a zebra eating marmalade\nnegative_prompt: blurry toast\nwidth: 64",
    "something about a zebra eating marmalade here",
]


@pytest.mark.parametrize("line", PROMPT_LINES)
def test_prompt_text_is_redacted_unless_asked_for(line):
    scrub = logs.Scrubber({}, ["a zebra eating marmalade", "blurry toast"])
    out = scrub(line)
    for word in ("zebra", "marmalade", "blurry toast"):
        assert word not in out
    assert "redacted" in out
    keep = logs.Scrubber({}, ["a zebra eating marmalade"], log_prompts=True)
    assert keep(line) == line


LEVEL_CASES = [
    ("none", "none", []),
    ("debug", "none", []),
    ("none", "debug", []),
    ("debug", "debug", ["debug", "info", "warn", "error"]),
    ("info", "debug", ["info", "warn", "error"]),
    ("debug", "warn", ["warn", "error"]),
    ("error", "error", ["error"]),
]


@pytest.mark.parametrize(("level", "native", "expected"), LEVEL_CASES)
def test_a_record_passes_both_levels(level, native, expected):
    recs = [logs.LogRecord(i, lv, "m") for i, lv in enumerate(["debug", "info", "warn", "error"])]
    assert [r.level for r in logs.visible(recs, level, native)] == expected


def test_unknown_level_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        logs.level_number("loud")


def test_dropped_record_names_the_count():
    rec = logs.dropped_record(123, 7, 4096)
    assert rec.level == "warn" and "123 log records were dropped" in rec.message
    assert rec.message.startswith("stable_diffusion: ")


def test_a_short_prompt_does_not_eat_ordinary_words():
    scrub = logs.Scrubber({}, ["a", "cat"])
    assert scrub("latent 1 decoded, taking 0.14s") == "latent 1 decoded, taking 0.14s"
    assert scrub("allocate the concatenation") == "allocate the concatenation"
