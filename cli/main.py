"""The `sdfarm` command line. Every command has `--json`: one JSON document on stdout and
nothing else (human-readable progress goes to stderr)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EXIT_INVALID, EXIT_TOO_LARGE, EXIT_LOAD, EXIT_GENERATE, EXIT_FARM = 2, 3, 4, 5, 6


@contextlib.contextmanager
def stdout_reserved(enabled: bool) -> Iterator[Any]:
    """With --json, file descriptor 1 is pointed at stderr while native code runs, so
    nothing the runtime or a backend prints can corrupt the one JSON document; the yielded
    stream writes to the real stdout."""
    if not enabled:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(os.dup(saved), "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        real.flush()
        real.close()


def emit(doc: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    out.write(json.dumps(doc, default=str) + "\n")
    out.flush()


def error_doc(exc: BaseException) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    for attr in ("parameter", "estimate", "figures", "role", "records"):
        if getattr(exc, attr, None) not in (None, [], {}):
            doc[attr] = getattr(exc, attr)
    return {"error": doc}


def exit_code(exc: BaseException) -> int:
    from sdfarm.native import errors

    return {
        errors.InvalidParameterError: EXIT_INVALID,
        errors.ModelTooLargeError: EXIT_TOO_LARGE,
        errors.ModelLoadError: EXIT_LOAD,
        errors.GenerationError: EXIT_GENERATE,
        errors.EnginePoisonedError: EXIT_GENERATE,
    }.get(type(exc), 1)


def fail(args: argparse.Namespace, exc: BaseException, out: Any = None) -> int:
    if getattr(args, "json", False):
        emit(error_doc(exc), out)
    else:
        print(f"error: {exc}", file=sys.stderr)
    return exit_code(exc)


def add_one_job_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a one-job command run by `run_one_job` (`upscale`, `video`): where it
    runs (a farm, or in this process on a device) and how its answer is printed."""
    p.add_argument("--in-process", action="store_true", help="run it here, without a farm")
    p.add_argument("--redis", default=None, help="the farm's Redis URL")
    p.add_argument("--device", default="auto", help="--in-process: auto, gpu, cpu or a name")
    p.add_argument("--no-check-memory", action="store_true", help="--in-process: no check")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the job")
    p.add_argument("--json", action="store_true")


def run_one_job(
    args: argparse.Namespace,
    checked: Callable[[], Any],
    in_process: Callable[[argparse.Namespace, Any], dict[str, Any]],
    on_farm: Callable[[argparse.Namespace, Any], dict[str, Any]],
    summary: Callable[[dict[str, Any]], str],
) -> int:
    """The body of a one-job command (`upscale`, `video`): its checked parameters
    (`checked()`), run here (`--in-process`) or on the farm, then one JSON document on stdout
    (`--json`) or a summary line; a bad input, a refusal or a farm error become a message and
    the exit code of their kind."""
    from sdfarm.native.errors import EngineError

    with stdout_reserved(args.json and args.in_process) as out:
        try:
            params = checked()
            doc = (in_process if args.in_process else on_farm)(args, params)
        except KeyboardInterrupt:
            return 130
        except (EngineError, ValueError, OSError) as exc:
            return fail(args, exc, out)
        except Exception as exc:  # noqa: BLE001 - farm errors become a message and EXIT_FARM
            rc = fail(args, exc, out)
            return EXIT_FARM if exit_code(exc) == 1 else rc
        if args.json:
            emit(doc, out)
        else:
            print(summary(doc), file=out)
    return 0


# -- native commands ------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    from sdfarm.native import build

    return build.run(args)


def cmd_devices(args: argparse.Namespace) -> int:
    from sdfarm.native.devices import format_bytes
    from sdfarm.native.report import devices_report

    doc = devices_report(args.backend)
    if args.json:
        emit(doc)
        return 0
    for d in doc["devices"]:
        print(
            f"{d['name']:<10} {d['type']:<5} {format_bytes(d['free']):>11} free of "
            f"{format_bytes(d['total']):>11}  figure {format_bytes(d['figure'])}  "
            f"{d['description']}"
        )
    print(f"MemAvailable {format_bytes(doc['mem_available'])}")
    print(
        f"auto -> {doc['choice']['auto']}, gpu -> {doc['choice']['gpu']}; "
        f"backend {doc['backend']} ({doc['sd_version']})"
    )
    return 0


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from sdfarm.native.testmodel import make_test_model

    dirs = make_test_model(Path(args.dir))
    if args.video:
        from sdfarm.native.wantestmodel import VARIANTS, make_wan_test_model

        dirs += [make_wan_test_model(Path(args.dir), name) for name in VARIANTS]
    if args.vae:
        from sdfarm.native.testmodel import make_vae_test_model

        dirs.append(make_vae_test_model(Path(args.dir)))
    if args.sd1:
        from sdfarm.native.sd1model import make_sd1_test_model

        dirs.append(make_sd1_test_model(Path(args.dir)))
    if args.json:
        emit({"models": [str(d) for d in dirs]})
    else:
        for d in dirs:
            print(d)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.in_process:
        from sdfarm.cli.jobs import generate_on_farm

        return generate_on_farm(args)
    from sdfarm.cli.inprocess import generate_in_process

    with stdout_reserved(args.json) as out:
        try:
            doc = generate_in_process(args)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a clear message
            from sdfarm.native.errors import EngineError

            if not isinstance(exc, EngineError | ValueError | OSError):
                raise
            return fail(args, exc, out)
        if args.json:
            emit(doc, out)
        else:
            print(
                f"{doc['output']}: seed {doc['seed']}, {doc['width']}x{doc['height']}, "
                f"{doc['steps']} steps, {doc['timings']['generate_s']:.2f} s on "
                f"{doc['device']}",
                file=out,
            )
            for r in doc["records"]:
                print(f"[{r['level']}] {r['message']}", file=sys.stderr)
    return 0


# -- parser ---------------------------------------------------------------------------------


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    """`sdfarm generate`: the prompt, every generation parameter and the job options as
    flags (sdfarm.cli.options), and where the image goes."""
    from sdfarm.cli.options import add_option_flags, add_param_flags

    p.add_argument("prompt")
    p.add_argument("--model", required=True, help="a model name (from --models) or folder")
    p.add_argument(
        "--models",
        action="append",
        default=[],
        help="a directory of models, one per subfolder (also $SDFARM_MODELS)",
    )
    p.add_argument("-o", "--output", default="out.png")
    add_param_flags(p)
    add_option_flags(p, "log_level", "log_prompts", "priority", "deadline_s", "webhook")
    p.add_argument("--device", default="auto", help="auto, gpu, cpu or a device name")
    p.add_argument(
        "--no-check-memory",
        action="store_true",
        help="load without the memory check (and without its warning)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sdfarm", description="A render farm for stable-diffusion.cpp")
    sub = p.add_subparsers(dest="command", required=True)

    from sdfarm.native import build

    b = sub.add_parser("build", help="build the runtime (cached)")
    build.add_arguments(b)
    b.set_defaults(func=cmd_build)

    d = sub.add_parser("devices", help="this host's devices and memory figures")
    d.add_argument("--backend", default=None)
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_devices)

    m = sub.add_parser("make-test-model", help="write the tiny random-weight test model")
    m.add_argument("dir")
    m.add_argument(
        "--video",
        action="store_true",
        help="also the random-weight Wan video models wan-t2v-test, wan-vace-test, "
        "wan-moe-test and wan-i2v-test (an image-to-video DiT with a CLIP vision encoder: it "
        "takes init and end images)",
    )
    m.add_argument(
        "--vae",
        action="store_true",
        help="also tiny-vae: the tiny model with a full VAE beside its TAESD, so a job can "
        "choose its decoder (--decoder taesd)",
    )
    m.add_argument(
        "--sd1",
        action="store_true",
        help="also a random-weight SD 1.x model (q4_0, 1.5 GB) with a ControlNet "
        "(controlnets/sd1-control, 0.5 GB) and embeddings (embeddings/sd1-emb*): the tiny model "
        "takes neither",
    )
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_make_test_model)

    g = sub.add_parser("generate", help="generate one image")
    add_generation_arguments(g)
    g.add_argument(
        "--in-process",
        action="store_true",
        help="run the engine in this process, without a farm or Redis",
    )
    g.add_argument("--redis", default=None, help="the farm's Redis URL")
    g.set_defaults(func=cmd_generate)

    from sdfarm.cli.farm import add_farm_commands

    add_farm_commands(sub)
    from sdfarm.cli.upscale import add_upscale_command

    add_upscale_command(sub)
    from sdfarm.cli.video import add_video_command

    add_video_command(sub)
    from sdfarm.cli.convert import add_convert_command

    add_convert_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
