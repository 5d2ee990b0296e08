"""`sdfarm convert MODEL --type TYPE [--models DIR] [--out NAME] [--tensor-type-rules RULES]`:
a model of the models folders written again in another weight type, as a new model folder
beside it (sdfarm.native.convert says how and why), with its sizes before and after and its
estimate on this host's devices, so a user sees whether it now fits."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sdfarm.cli.main import emit, fail


def add_convert_command(sub: Any) -> None:
    from sdfarm.native.convert import TYPES

    p = sub.add_parser(
        "convert",
        help="write a model again in another weight type (e.g. q8_0) as a new model folder",
    )
    p.add_argument("model", help="a model name inside the models folders")
    p.add_argument("--type", required=True, help=f"one of: {', '.join(TYPES)}")
    p.add_argument(
        "--models",
        action="append",
        default=[],
        help="a directory of models, one per subfolder (also $SDFARM_MODELS)",
    )
    p.add_argument("--out", default=None, help="the new model's name (default MODEL-TYPE)")
    p.add_argument(
        "--tensor-type-rules",
        default="",
        help="PATTERN=TYPE,... : tensors whose name matches a pattern get that type instead",
    )
    p.add_argument("--backend", default=None, help="whose devices the estimate is shown for")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from sdfarm.native.convert import convert_model, estimates, plan
    from sdfarm.native.devices import format_bytes
    from sdfarm.native.errors import EngineError

    try:
        checked = plan(args.model, args.type, args.models, args.out, args.tensor_type_rules)
        if not args.json:
            print(
                f"converting {checked.model.name} to {checked.type} as {checked.out_dir.name} "
                f"({', '.join(f'{f.role}: {f.action}' for f in checked.files)})",
                file=sys.stderr,
            )
        doc = convert_model(checked)
    except (EngineError, ValueError, OSError) as exc:
        return fail(args, exc)
    try:
        doc["estimates"] = estimates(checked.out_dir, checked.model.directory, args.backend)
    except Exception as exc:  # noqa: BLE001 - the model is written; the estimate is a bonus
        doc["estimates"] = []
        doc["estimate_error"] = f"{type(exc).__name__}: {exc}"
    if args.json:
        emit(doc)
        return 0
    before, after = doc["bytes_before"], doc["bytes_after"]
    print(
        f"{doc['folder']}: {format_bytes(before)} -> {format_bytes(after)} "
        f"({after / before:.0%}) in {doc['convert_s']:.1f} s"
    )
    need = doc.get("need") or {}
    if need:
        print(f"  needed about {format_bytes(need['memory'])} of memory and "
              f"{format_bytes(need['disk'])} of disk")  # fmt: skip
    for f in doc["files"]:
        print(f"  {f['role']:<16} {f['file']:<24} {f['action']:<8} "
              f"{format_bytes(f['before']):>10} -> {format_bytes(f['after'])}")  # fmt: skip
    for e in doc["estimates"]:
        verdict = "fits" if e["fits"] else "does not fit"
        was = "fitted" if e["fitted_before"] else "did not fit"
        print(f"  estimate on {e['device']}: {format_bytes(e['estimate_before'])} ({was}) -> "
              f"{format_bytes(e['estimate'])} ({verdict}; figure "
              f"{format_bytes(e['figure'])})")  # fmt: skip
    return 0
