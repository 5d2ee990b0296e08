"""The suite's command line: the arguments, the runtimes, the stages in order (`RUNNERS`), and
the `_child` entry every measurement's process comes in by."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from pathlib import Path

from . import __doc__ as SUITE_DOC
from .children import _kill_live, _on_term, child_main
from .harness import Deadline, Runtime, Stage, alias_runtime, error_text
from .stage_devices import stage_devices
from .stage_farm import stage_farm
from .stage_features import stage_features
from .stage_memory import stage_memory
from .stage_rules import stage_rules
from .stage_speed import stage_speed
from .stage_warmup import stage_warmup

STAGES = ("devices", "rules", "warmup", "speed", "memory", "farm", "features")

RUNNERS = {
    "devices": stage_devices,
    "rules": stage_rules,
    "warmup": stage_warmup,
    "speed": stage_speed,
    "memory": stage_memory,
    "farm": stage_farm,
    "features": stage_features,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=SUITE_DOC.split("\n\n")[0])
    p.add_argument("stage", choices=(*STAGES, "all"))
    p.add_argument("--out", required=True, help="folder for gpu-STAGE.json")
    p.add_argument(
        "--model", default="/tmp/models/sd-turbo-random", help="the full-size model folder"
    )
    p.add_argument("--taesd-model", default=None, help="the same with a TAESD decoder")
    p.add_argument(
        "--backend",
        default="cuda",
        choices=("cuda", "vulkan", "cpu"),
        help="where it computes (cpu hides the GPUs of a GPU runtime)",
    )
    p.add_argument(
        "--runtime-dir", default=None, help="the runtime build to load (a folder with build.json)"
    )
    p.add_argument(
        "--also-runtime",
        action="append",
        default=[],
        metavar="BACKEND=DIR",
        help="further runtimes whose figures devices/rules record (repeatable; "
        "DIR may be empty for the cached build)",
    )
    p.add_argument("--cli", default=None, help="the runtime's sd-cli (speed: the comparison)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sizes", default="512,1024", help="e.g. 512,1024 or 512x768")
    p.add_argument("--steps", default="1,4", help="speed: step counts (first at every size)")
    p.add_argument(
        "--steady",
        type=int,
        default=0,
        help="speed: timed generations of the steady loop (default max(runs, 3))",
    )
    p.add_argument("--jobs", type=int, default=200, help="farm: batch size")
    p.add_argument("--seq-jobs", type=int, default=20, help="farm: sequential latency sample")
    p.add_argument("--batch-count", type=int, default=8)
    p.add_argument(
        "--speed-batch",
        type=int,
        default=0,
        help="speed: also one call of N images per fresh process, ours against sd-cli",
    )
    p.add_argument(
        "--farm-log-dir", default=None, help="farm: the parts' logs (default OUT/farm-logs)"
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new case this long after the start",
    )
    p.add_argument("--case-timeout", type=float, default=300.0)
    p.add_argument(
        "--hold-gib",
        type=float,
        default=0.0,
        help="rules: GiB the holder takes (0: all but --hold-leave-gib)",
    )
    p.add_argument(
        "--hold-leave-gib",
        type=float,
        default=1.5,
        help="rules: GiB left free by the holder when --hold-gib is 0",
    )
    p.add_argument("--holder-python", default=sys.executable)
    p.add_argument(
        "--no-nowarm",
        action="store_true",
        help="speed: leave out our engine loaded without warm-up",
    )
    p.add_argument("--work-dir", default=None, help="scratch folder (default: the system's)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return child_main(json.loads(argv[1]))
    args = build_parser().parse_args(argv)
    os.environ["SDFARM_SUITE_BACKEND"] = args.backend  # sd-cli gets the engine's settings
    Path(args.out).mkdir(parents=True, exist_ok=True)
    args.model = str(Path(args.model).resolve())
    if args.taesd_model:
        args.taesd_model = str(Path(args.taesd_model).resolve())
    runtimes = [Runtime.make(args.backend, args.runtime_dir)]
    for spec in args.also_runtime:
        label, _, directory = spec.partition("=")
        if label not in ("cuda", "vulkan", "cpu"):
            raise SystemExit(f"--also-runtime {spec!r}: BACKEND must be cuda, vulkan or cpu")
        runtimes.append(Runtime.make(label, directory or None))
    for rt in runtimes:
        try:
            rt.alias = alias_runtime(rt)
        except Exception as e:  # noqa: BLE001 - recorded; the child may still load
            rt.alias = {"error": error_text(e)}
    deadline = Deadline(args.deadline)
    signal.signal(signal.SIGTERM, _on_term)
    try:
        run_stages(args, deadline, runtimes)
    finally:
        _kill_live()
    return 0


def run_stages(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    stages = STAGES if args.stage == "all" else (args.stage,)
    for name in stages:
        if deadline.expired():
            print(f"== {name}: skipped (deadline)", flush=True)
            Stage(name, args, deadline, runtimes).skip(name, "deadline")
            continue
        try:
            RUNNERS[name](args, deadline, runtimes)
        except Exception as e:  # noqa: BLE001 - a stage's own failure is recorded, next one runs
            path = Path(args.out) / f"gpu-{name}.json"
            doc = json.loads(path.read_text()) if path.exists() else {"stage": name}
            doc.setdefault("errors", []).append(
                {"case": "(stage)", "error": error_text(e), "traceback": traceback.format_exc()}
            )
            path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            print(f"== {name}: FAILED {error_text(e)}", flush=True)
