"""Parameters the runtime does not survive are refused with the parameter and its range."""

from __future__ import annotations

import pytest

from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import (
    BY_NAME,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MIN_STEPS,
    SAMPLERS,
    SCHEDULERS,
    GenerationParams,
    validate,
)

BAD = [
    ("width-0", {"width": 0}, "width", "outside 64..4096"),
    ("height-minus-8", {"height": -8}, "height", "outside 64..4096"),
    ("steps-0", {"steps": 0}, "steps", "outside 1..200"),
    ("steps-minus-1", {"steps": -1}, "steps", "outside 1..200"),
    ("huge", {"width": 100000, "height": 100000}, "width", "outside 64..4096"),
    ("not-multiple-of-8", {"width": 100}, "width", "not a multiple of 8"),
    ("sampler", {"sampler": "warp_drive"}, "sampler", "unknown sampler 'warp_drive'"),
    ("scheduler", {"scheduler": "someday"}, "scheduler", "unknown scheduler"),
    ("batch-0", {"batch_count": 0}, "batch_count", "outside 1..16"),
    ("cfg-nan", {"cfg_scale": float("nan")}, "cfg_scale", "outside 0..50"),
    ("seed", {"seed": -5}, "seed", "outside 0.."),
    ("nul", {"prompt": "a\x00b"}, "prompt", "NUL"),
    ("width-text", {"width": "wide"}, "width", "must be an integer"),
    ("width-bool", {"width": True}, "width", "must be an integer"),
]


@pytest.mark.parametrize(("kw", "param", "text"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_parameters_are_refused_naming_the_parameter(kw, param, text):
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(**{"prompt": "p", **kw}))
    assert err.value.parameter == param
    assert text in str(err.value)
    assert param in str(err.value)


def test_sampler_error_lists_the_choices():
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(prompt="p", sampler="nope"))
    assert "euler_a" in str(err.value) and "dpm++2m" in str(err.value)


def test_valid_parameters_pass_and_a_random_seed_is_resolved():
    p = validate(GenerationParams(prompt="p", width=512, height=768, steps=20, seed=-1))
    assert p.width == 512 and p.height == 768
    assert 0 <= p.seed < 2**31
    assert validate(GenerationParams(prompt="p", seed=7)).seed == 7


def test_integral_floats_and_digit_strings_are_accepted():
    p = validate(GenerationParams(prompt="p", width=256.0, steps="4"))
    assert p.width == 256 and p.steps == 4


def test_a_job_spec_carries_every_job_option() -> None:
    """JobSpec (what the store keeps) has a field for each JobOptions field, with the same
    default, so Farm.submit passes the options through without naming them."""
    from dataclasses import fields

    from sdfarm.native.params import OPTIONS
    from sdfarm.store import JobSpec

    spec = {f.name: f.default for f in fields(JobSpec)}
    for p in OPTIONS:
        assert p.name in spec, p.name
        assert spec[p.name] == (p.default or spec[p.name]), p.name


# -- rules found by the crasher sweep (bench/crasher_sweep.py, docs/crashers.md) -------------


@pytest.mark.parametrize("scheduler", sorted(MIN_STEPS))
def test_a_scheduler_below_its_minimum_steps_is_refused_naming_both(scheduler):
    least, _why = MIN_STEPS[scheduler]
    for sampler in ("default", *SAMPLERS):
        with pytest.raises(InvalidParameterError) as err:
            validate(GenerationParams(prompt="p", scheduler=scheduler, sampler=sampler, steps=1))
        assert err.value.parameter == "steps"
        text = str(err.value)
        assert f"scheduler {scheduler} needs at least {least} steps, got 1" in text
        assert "use 2 or more steps, or another scheduler" in text
        p = validate(GenerationParams(prompt="p", scheduler=scheduler, sampler=sampler, steps=2))
        assert p.steps == least == 2


def test_gits_with_one_step_says_the_runtime_crashes():
    with pytest.raises(InvalidParameterError, match=r"with 1 the runtime crashes \(SIGSEGV\)"):
        validate(GenerationParams(prompt="p", scheduler="gits", steps=1))
    with pytest.raises(InvalidParameterError, match=r"image comes back blank \(NaN\)"):
        validate(GenerationParams(prompt="p", scheduler="karras", steps=1))


@pytest.mark.parametrize("scheduler", ["default", *(s for s in SCHEDULERS if s not in MIN_STEPS)])
def test_other_schedulers_still_take_one_step(scheduler):
    assert validate(GenerationParams(prompt="p", scheduler=scheduler, steps=1)).steps == 1


def test_the_minimum_steps_rule_comes_after_the_range_checks():
    with pytest.raises(InvalidParameterError, match="outside 1..200") as err:
        validate(GenerationParams(prompt="p", scheduler="gits", steps=0))
    assert err.value.parameter == "steps"
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(prompt="p", scheduler="gits", steps=1, width=100))
    assert err.value.parameter == "width"


def test_the_prompt_budget_is_derived_from_the_token_budget():
    assert MAX_PROMPT_TOKENS == 1024
    assert MAX_PROMPT_BYTES == MAX_PROMPT_CHARS == 4 * MAX_PROMPT_TOKENS
    assert BY_NAME["prompt"].max_chars == BY_NAME["negative_prompt"].max_chars == 4096
    assert BY_NAME["prompt"].max_bytes == BY_NAME["negative_prompt"].max_bytes == 4096


@pytest.mark.parametrize("name", ["prompt", "negative_prompt"])
def test_a_prompt_over_the_character_limit_is_refused_saying_why(name):
    ok = validate(GenerationParams(**{"prompt": "p", name: "a" * MAX_PROMPT_CHARS}))
    assert len(getattr(ok, name)) == MAX_PROMPT_CHARS
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(**{"prompt": "p", name: "a" * (MAX_PROMPT_CHARS + 1)}))
    assert err.value.parameter == name
    text = str(err.value)
    assert text.startswith(f"invalid {name}: is 4097 characters, at most 4096: ")
    assert "none of its text encoders truncates" in text and "1,024 tokens" in text


@pytest.mark.parametrize("name", ["prompt", "negative_prompt"])
def test_a_prompt_over_the_byte_limit_is_refused_though_short_in_characters(name):
    # 3 bytes a character in UTF-8: 1365 of them are 4095 bytes, 1366 are 4098.
    ok = validate(GenerationParams(**{"prompt": "p", name: "灯" * 1365}))
    assert len(getattr(ok, name).encode()) == 4095
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(**{"prompt": "p", name: "灯" * 1366}))
    assert err.value.parameter == name
    text = str(err.value)
    assert "is 1366 characters but 4098 bytes in UTF-8, at most 4096 bytes: " in text
    assert "a token takes at least one byte" in text
    # An emoji is 4 bytes: 1024 of them fill the budget exactly.
    assert validate(GenerationParams(**{"prompt": "p", name: "\N{WATER WAVE}" * 1024}))
    with pytest.raises(InvalidParameterError, match="4100 bytes"):
        validate(GenerationParams(**{"prompt": "p", name: "\N{WATER WAVE}" * 1025}))


def test_the_long_prompt_that_crashed_the_runtime_is_refused():
    """9,000 CJK characters (27,000 bytes) passed the old 20,000-character limit and overflow
    the runtime's prompt parser's stack (SIGSEGV, docs/crashers.md)."""
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(prompt="灯" * 9000))
    assert err.value.parameter == "prompt"


def test_text_that_utf8_cannot_encode_is_refused():
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(prompt="a\ud800b"))
    assert err.value.parameter == "prompt"
    assert "'\\ud800' at 1, which UTF-8 cannot encode" in str(err.value)
    assert validate(GenerationParams(prompt="a\u00e9\u706f\N{WATER WAVE}b")).prompt


def test_the_hires_pass_sets_the_final_size_in_8_pixel_cells_and_within_the_caps() -> None:
    p = validate(GenerationParams(prompt="p", width=72, height=64, hires_scale=1.5))
    assert p.final_size == (112, 96)  # 108 rounds to 112
    assert validate(GenerationParams(prompt="p", width=72, height=64)).final_size == (72, 64)
    with pytest.raises(InvalidParameterError) as err:
        validate(GenerationParams(prompt="p", width=4096, height=64, hires_scale=1.5))
    assert err.value.parameter == "hires_scale" and "6144x96" in str(err.value)
    with pytest.raises(InvalidParameterError, match="outside 1..4"):
        validate(GenerationParams(prompt="p", hires_scale=0.5))


def test_step_cache_takes_the_runtimes_modes_only() -> None:
    from sdfarm.native.params import STEP_CACHES

    assert STEP_CACHES[0] == "off"  # SD_CACHE_DISABLED is 0 in the runtime's enum
    assert validate(GenerationParams(prompt="p", step_cache="cache_dit")).step_cache == "cache_dit"
    with pytest.raises(InvalidParameterError, match="unknown step_cache 'turbo'"):
        validate(GenerationParams(prompt="p", step_cache="turbo"))
