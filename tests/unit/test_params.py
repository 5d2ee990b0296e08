"""Parameters the runtime does not survive are refused with the parameter and its range."""

from __future__ import annotations

import pytest

from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import GenerationParams, validate

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
