"""The command line's job flags, derived from the one job schema (sdfarm.native.params): each
generation parameter and job option becomes `--name-with-dashes`, typed, with its help text
and range; likewise each upscale parameter (sdfarm.native.upscale_params) for `sdfarm
upscale`. A new parameter gets its flag without an edit here."""

from __future__ import annotations

import argparse
from typing import Any

from sdfarm.native.params import OPTIONS, PARAMS, Param
from sdfarm.native.upscale_params import UPSCALE_PARAMS


def flag(p: Param) -> str:
    return "--" + p.name.replace("_", "-")


def _add(parser: argparse.ArgumentParser, p: Param, default: Any, required: bool = False) -> None:
    if p.kind == "bool":
        parser.add_argument(flag(p), action="store_true", default=default, help=p.help)
        return
    if p.kind == "loras":
        parser.add_argument(
            flag(p),
            action="append",
            default=None,
            metavar="NAME[:WEIGHT]",
            help=f"{p.help}: {p.range_text} (repeat the flag; a weight left out is 1)",
        )
        return
    if p.kind in ("image", "images"):  # a file path; the job schema reads and checks it
        parser.add_argument(
            flag(p),
            action="append" if p.kind == "images" else "store",
            default=None,
            metavar="PATH",
            help=f"{p.help}: {p.range_text}" + (" (repeat the flag)" if p.kind == "images" else ""),
        )
        return
    shown = "" if default is None else f"; default {p.default}"
    parser.add_argument(
        flag(p),
        type=p.python_type,
        default=default,
        required=required,
        metavar=p.name.upper(),
        help=f"{p.help} ({p.range_text}{shown})",
    )


def add_param_flags(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """A flag per generation parameter but the prompt. Without `defaults` a flag left out is
    None, so the farm's defaults (or a batch item's own fields) apply."""
    for p in PARAMS:
        if p.name != "prompt":
            _add(parser, p, p.default if defaults else None)


def add_option_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """Flags for the job options `names` (priority, submitter, log_level, webhook, ...)."""
    for p in OPTIONS:
        if p.name in names:
            _add(parser, p, p.default if p.kind == "bool" else None)


def given_params(args: argparse.Namespace) -> dict[str, Any]:
    """The generation parameters the user gave as flags, but the prompt (those left out are
    absent)."""
    return {
        p.name: getattr(args, p.name)
        for p in PARAMS
        if p.name != "prompt" and getattr(args, p.name, None) is not None
    }


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The job options the user gave as flags."""
    return {
        p.name: getattr(args, p.name)
        for p in OPTIONS
        if getattr(args, p.name, None) not in (None, False, "")
    }


def add_upscale_flags(parser: argparse.ArgumentParser) -> None:
    """`sdfarm upscale`: the image as the positional argument, a flag per other upscale
    parameter (sdfarm.native.upscale_params; a required one a required flag)."""
    parser.add_argument("image", help=f"{UPSCALE_PARAMS[0].help}: {UPSCALE_PARAMS[0].range_text}")
    for p in UPSCALE_PARAMS:
        if p.kind != "image":
            _add(parser, p, None if p.required else p.default, required=p.required)


def given_upscale(args: argparse.Namespace) -> dict[str, Any]:
    """The upscale parameters from their flags and the positional image (a path)."""
    return {p.name: getattr(args, p.name) for p in UPSCALE_PARAMS}
