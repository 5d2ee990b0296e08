"""Every door of an upscale job is derived from its one schema (UPSCALE_PARAMS): the CLI's
flags of `sdfarm upscale`, the gateway's request body and the PNG chunk name each parameter,
and a parameter the schema does not have is refused by each."""

from __future__ import annotations

import argparse

import pytest

from sdfarm.cli.main import build_parser
from sdfarm.gateway.schemas import UpscaleRequest
from sdfarm.native.png import PARAM_KEYS
from sdfarm.native.upscale_params import UPSCALE_NAMES, UPSCALE_PARAMS


def _upscale_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["upscale"]


def test_the_cli_flags_are_the_schema() -> None:
    dests = {a.dest for a in _upscale_parser()._actions}
    assert set(UPSCALE_NAMES) <= dests
    args = _upscale_parser().parse_args(["in.png", "--upscaler", "x", "--tile-size", "0"])
    assert (args.image, args.upscaler, args.factor, args.tile_size) == ("in.png", "x", 0, 0)
    with pytest.raises(SystemExit):  # the upscaler is required, like in the schema
        _upscale_parser().parse_args(["in.png"])


def test_the_gateway_body_and_the_png_chunk_are_the_schema() -> None:
    fields = UpscaleRequest.model_fields
    assert set(UPSCALE_NAMES) <= set(fields)
    assert {n for n, f in fields.items() if f.is_required()} == {
        p.name for p in UPSCALE_PARAMS if p.required
    }
    schema = UpscaleRequest.model_json_schema()["properties"]
    assert schema["tile_size"]["anyOf"][0] == {"const": 0}  # 0: the whole image
    assert set(UPSCALE_NAMES) <= set(PARAM_KEYS)
